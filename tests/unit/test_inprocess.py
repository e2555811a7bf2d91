"""lab.inprocess: the in-process transport and swarm view, and that both they and the network's
classes satisfy the round loop's Protocols (peer/sync/transport.py RoundTransport,
peer/sync/membership.py RoundSwarm)."""

from __future__ import annotations

import inspect
import threading
import types
from typing import TYPE_CHECKING

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport, PieceRules
from lab.sim_results import butterfly_bytes
from peer.state.snapshot import make_snapshot
from peer.sync.membership import RoundSwarm, SwarmView
from peer.sync.transport import NetworkTransport, RoundTransport, SyncRequest
from protocol.errors import BadPayload, GroupNotFound, StateDownloadFailed
from protocol.manifest import CompressionSpec
from protocol.records import ProgressRecord

if TYPE_CHECKING:  # mypy checks the structural conformance here

    def _network(t: NetworkTransport, s: SwarmView) -> tuple[RoundTransport, RoundSwarm]:
        return t, s

    def _in_process(t: InProcessTransport, s: InProcessSwarm) -> tuple[RoundTransport, RoundSwarm]:
        return t, s


def _members(protocol) -> dict[str, object]:
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


@pytest.mark.parametrize(
    "protocol, implementations",
    [(RoundTransport, (NetworkTransport, InProcessTransport)), (RoundSwarm, (SwarmView, InProcessSwarm))],
)
def test_the_network_and_in_process_classes_have_every_member_with_a_compatible_signature(protocol, implementations):
    members = _members(protocol)
    assert len(members) >= 7
    for cls in implementations:
        for name, want in members.items():
            if isinstance(want, property):
                continue  # attributes: checked on instances below (SwarmView sets them in __init__)
            have = getattr(cls, name, None)
            assert callable(have), f"{cls.__name__} lacks {name}"
            got = inspect.signature(have).parameters
            for param in inspect.signature(want).parameters.values():
                assert param.name in got, f"{cls.__name__}.{name} lacks parameter {param.name}"
                other = got[param.name]
                assert other.kind == param.kind, f"{cls.__name__}.{name}({param.name}): {other.kind} != {param.kind}"
                assert (other.default is inspect.Parameter.empty) == (param.default is inspect.Parameter.empty), (
                    f"{cls.__name__}.{name}({param.name}): a default on one side only"
                )
            extra = [
                p
                for p in got.values()
                if p.name not in inspect.signature(want).parameters
                and p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            assert not extra, f"{cls.__name__}.{name} requires {extra} the round loop does not pass"
    assert isinstance(NetworkTransport.max_sync_seconds, property)


def test_instances_satisfy_the_runtime_checkable_protocols():
    view = SwarmView(None, run_id="r", signer=types.SimpleNamespace(peer_id="p"), record_ttl_s=60.0, max_sync_s=5.0)
    assert isinstance(view, RoundSwarm)
    hub = InProcessHub()
    assert isinstance(InProcessSwarm("a", hub), RoundSwarm)
    assert isinstance(InProcessTransport("a", hub), RoundTransport)
    assert not isinstance(object(), RoundTransport) and not isinstance(view, RoundTransport)


def _average(transports, payloads, weights, results, **kwargs):
    def one(t, p, w):
        request = SyncRequest(
            weight=w, round_=3, expected_group_size=len(transports), start_digest=f"d-{t.peer_id}", **kwargs
        )
        results[t.peer_id] = t.average(p, request=request)

    threads = [threading.Thread(target=one, args=args) for args in zip(transports, payloads, weights)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)


def test_a_group_gets_one_token_weighted_fp32_mean():
    hub = InProcessHub()
    transports = [InProcessTransport(p, hub, bytes_per_sync=None) for p in ("b", "a", "c")]
    payloads = [[torch.full((4,), float(i)), torch.ones(2, 2) * i] for i in (1, 2, 3)]
    results = {}
    _average(transports, payloads, [1.0, 1.0, 2.0], results)
    expected = [sum(x[k] * (w / 4.0) for x, w in zip(payloads, [1.0, 1.0, 2.0])) for k in range(2)]
    a, b, c = (results[p] for p in "abc")
    for r in (a, b, c):
        assert r.group == ["a", "b", "c"] and r.group_size == 3
        assert r.start_digests == {"a": "d-a", "b": "d-b", "c": "d-c"}
        assert r.bytes_sent == int(butterfly_bytes(8, 3)) == int(2 * 2 / 3 * 4 * 8)
        assert all(t.dtype == torch.float32 for t in r.mean)
    assert all(torch.equal(x, y) for x, y in zip(a.mean, b.mean)) and all(
        torch.equal(x, y) for x, y in zip(a.mean, c.mean)
    )
    torch.testing.assert_close(a.mean, expected)
    assert [t.calls[0][0] for t in transports] == [3, 3, 3]


def test_groups_are_keyed_by_fragment_and_group_index_and_a_late_peer_finds_none():
    hub = InProcessHub(matchmaking_s=0.2)
    a, b = InProcessTransport("a", hub), InProcessTransport("b", hub)
    with pytest.raises(GroupNotFound):  # alone in group index 0 when the window closes
        a.average([torch.ones(1)], request=SyncRequest(weight=1.0, round_=0, expected_group_size=2, group_index=0))
    results = {}
    _average([a, b], [[torch.ones(1)], [torch.zeros(1)]], [1.0, 1.0], results, fragment=1, fragments=2)
    assert results["a"].group_size == 2 and torch.equal(results["a"].mean[0], torch.tensor([0.5]))
    with pytest.raises(GroupNotFound):  # the group of (round 3, fragment 1) closed
        InProcessTransport("c", hub).average(
            [torch.ones(1)], request=SyncRequest(weight=1.0, round_=3, expected_group_size=2, fragment=1, fragments=2)
        )
    assert [c[:2] for c in a.carried] == [(0, None), (3, 1)]


def test_a_fixed_group_size_and_a_failing_transport():
    hub = InProcessHub(1)
    result = InProcessTransport("a", hub).average(
        [torch.ones(2)], request=SyncRequest(weight=5.0, round_=0, expected_group_size=4)
    )
    assert result.group == ["a"] and torch.equal(result.mean[0], torch.ones(2))

    def fail(round_, should_stop):
        raise GroupNotFound(f"round {round_}: scripted")

    with pytest.raises(GroupNotFound, match="scripted"):
        InProcessTransport("b", hub, fail=fail).average(
            [torch.ones(2)], request=SyncRequest(weight=1.0, round_=1, expected_group_size=1)
        )


class _FlippingOwner:
    """GroupHooks of a liar that sends every mean it owns sign-flipped; records each contribution."""

    def __init__(self, liar: str):
        self.liar, self.sent = liar, {}

    def contribution(self, peer_id, payload, weight, phi_from):
        self.sent.setdefault(peer_id, []).append([t.clone() for t in payload])
        return payload, weight

    def owner_mean(self, owner, receiver, piece, mean, phi):
        return -mean if owner == self.liar else mean

    def records(self, peer_id, record, hub):
        return [(peer_id, record)]

    def served(self, peer_id, snapshots):
        return snapshots


def test_a_skipped_piece_is_carried_into_the_next_contribution():
    """As the network's receipts and error feedback do: the pieces of an owner the group refuses
    move nothing that round, and each member adds its contribution there to its next one, once."""
    ids, shapes = ["a", "b", "c", "d"], [torch.Size([64, 32]), torch.Size([1024])]
    hooks = _FlippingOwner("d")
    hub = InProcessHub(rules=PieceRules(piece_elements=512), hooks=hooks)
    transports = [InProcessTransport(p, hub) for p in ids]
    gen = torch.Generator().manual_seed(5)
    rounds = [[[torch.randn(s, generator=gen) for s in shapes] for _ in ids] for _ in range(3)]
    results: dict[int, dict[str, object]] = {}
    for r, payloads in enumerate(rounds):
        results[r] = {}

        def one(t, p, r=r):
            results[r][t.peer_id] = t.average(
                p, request=SyncRequest(weight=1.0, round_=r, expected_group_size=len(ids))
            )

        threads = [threading.Thread(target=one, args=args) for args in zip(transports, payloads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    for m, member in enumerate(ids[:3]):
        assert any((results[0][member].mean[k] == 0).any() for k in range(2))  # the liar's pieces
        for k in range(2):
            extra = hooks.sent[member][1][k] - rounds[1][m][k]  # round 1's contribution minus its Δ
            held = rounds[0][m][k] * (results[0][member].mean[k] == 0)  # round 0's Δ where it moved nothing
            torch.testing.assert_close(extra, held)
            torch.testing.assert_close(hooks.sent[member][2][k], rounds[2][m][k])  # carried once
        assert not transports[m]._residuals


def _rounds(transports, rounds, start=0, **request):
    """Each round's payloads averaged by ``transports`` in threads, the first at round ``start``; per
    round, peer id → SyncResult."""
    results: dict[int, dict[str, object]] = {}
    for r, payloads in enumerate(rounds, start):
        results[r] = {}

        def one(t, p, r=r):
            results[r][t.peer_id] = t.average(
                p, request=SyncRequest(weight=1.0, round_=r, expected_group_size=len(transports), **request)
            )

        threads = [threading.Thread(target=one, args=args) for args in zip(transports, payloads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    return results


@pytest.mark.parametrize("feedback", [True, False])
def test_int8_contributions_and_means_go_through_the_codec_and_its_error_is_fed_back(feedback):
    """With a lossy codec every contribution an owner receives and every mean it sends are the
    codec's decoding (an owner's own rows exact), every member gets the same mean, and each member's
    next contribution adds what the codec dropped of its last (``compression.error_feedback``)."""
    ids, shapes = ["a", "b", "c", "d"], [torch.Size([64, 32]), torch.Size([1024])]
    recorder = _FlippingOwner("nobody")
    spec = CompressionSpec(codec="int8", error_feedback=feedback)
    hub = InProcessHub(rules=PieceRules(compression=spec, piece_elements=512), hooks=recorder)
    transports = [InProcessTransport(p, hub) for p in ids]
    gen = torch.Generator().manual_seed(6)
    rounds = [[[torch.randn(s, generator=gen) for s in shapes] for _ in ids] for _ in range(2)]
    results = _rounds(transports, rounds[:1])
    held = [dict(t._residuals) for t in transports]
    _rounds(transports, rounds[1:], start=1)
    plain = [sum(p[k] for p in rounds[0]) / len(ids) for k in range(2)]
    first = results[0]["a"].mean
    for member in ids:
        assert all(torch.equal(x, y) for x, y in zip(results[0][member].mean, first, strict=True))
    for got, want in zip(first, plain, strict=True):
        assert not torch.equal(got, want)  # through the codec
        assert (got - want).norm() < 0.05 * want.norm()
    for m, member in enumerate(ids):
        residuals = held[m]
        if not feedback:
            assert not residuals
            assert all(torch.equal(x, y) for x, y in zip(recorder.sent[member][1], rounds[1][m], strict=True))
            continue
        e = [residuals.get(k, torch.zeros(shape)) for k, shape in enumerate(shapes)]  # none held: zeros
        # its own pieces (every member owns one or more of the six of 512 values): exact, no residual
        assert sum(int((x == 0).sum()) for x in e) >= 512
        dropped, sent = torch.cat([x.flatten() for x in e]), torch.cat([x.flatten() for x in rounds[0][m]])
        assert 0 < dropped.norm() < 0.05 * sent.norm()  # what int8 dropped of its pieces to the others
        for k in range(2):
            torch.testing.assert_close(recorder.sent[member][1][k], rounds[1][m][k] + e[k])  # fed back


@pytest.mark.parametrize("codec, ratio", [("none", 1.0), ("fp16", 0.5), ("int8", (1 + 4 / 64) / 4)])
def test_a_hub_with_rules_reports_the_encoded_bytes_of_each_sync(codec, ratio):
    """Bytes of a sync through a hub with PieceRules: each member's contribution to the pieces the
    others own and its means to every other member, as the codec encodes them; for fp32 the
    butterfly's 2·(n − 1)/n × 4 bytes per value (plus each piece's header)."""
    ids, shapes = ["a", "b", "c", "d"], [torch.Size([64, 32]), torch.Size([1024])]
    hub = InProcessHub(rules=PieceRules(compression=CompressionSpec(codec=codec), piece_elements=512))
    transports = [InProcessTransport(p, hub, bytes_per_sync=None) for p in ids]
    gen = torch.Generator().manual_seed(7)
    results = _rounds(transports, [[[torch.randn(s, generator=gen) for s in shapes] for _ in ids]])
    fp32 = butterfly_bytes(3072, len(ids))
    total = sum(r.bytes_sent for r in results[0].values())
    assert total == sum(r.bytes_received for r in results[0].values())  # every byte sent is received
    assert total / len(ids) == pytest.approx(ratio * fp32, rel=0.03)


def test_a_blocking_sync_reports_the_skipped_rows_and_keeps_their_residual():
    """``carry_skipped`` False (a blocking sync): the liar's pieces move nothing, their rows are in
    ``kept_rows`` and nothing of them is carried (the landing keeps θ's progress there)."""
    ids, shapes = ["a", "b", "c", "d"], [torch.Size([64, 32]), torch.Size([1024])]
    hub = InProcessHub(rules=PieceRules(piece_elements=512), hooks=_FlippingOwner("d"))
    transports = [InProcessTransport(p, hub) for p in ids]
    gen = torch.Generator().manual_seed(5)
    results = _rounds(transports, [[[torch.randn(s, generator=gen) for s in shapes] for _ in ids]], carry_skipped=False)
    for m, member in enumerate(ids[:3]):
        result = results[0][member]
        assert result.kept_rows
        for t, start, stop in result.kept_rows:
            assert not result.mean[t][start:stop].any()
        assert not transports[m]._residuals


def _snapshot(value: float, run_id: str = "run", round_: int = 2):
    return make_snapshot(
        {"run_id": run_id, "round": round_, "inner_step": 20}, [torch.full((3,), value), torch.zeros(3)]
    )


def test_state_is_downloaded_from_a_registered_provider_and_checked():
    hub = InProcessHub()
    donor, joiner = InProcessTransport("d", hub), InProcessTransport("j", hub, shapes=[torch.Size([3])], run_id="run")
    snap = _snapshot(1.0)
    donor.share_state(lambda: [snap])
    got = joiner.download_state(["x", "d"], snap.digest.hex(), 1.0)
    assert got.state.round == 2 and torch.equal(got.state.phi[0], torch.ones(3))
    assert got.chunks_by_donor == {"d": 1} and "x" in got.failed
    with pytest.raises(StateDownloadFailed):
        joiner.download_state(["d"], "00" * 16, 1.0)
    other = _snapshot(1.0, run_id="other")
    hub.serve("m", lambda: [other])
    with pytest.raises(BadPayload, match="run"):
        joiner.download_state(["m"], other.digest.hex(), 1.0)
    forged = types.SimpleNamespace(meta=snap.meta, tensors=(torch.full((3,), 9.0), torch.zeros(3)), digest=snap.digest)
    hub.serve("m", lambda: [forged])
    with pytest.raises(BadPayload, match="hash"):
        joiner.download_state(["m"], snap.digest.hex(), 1.0)
    donor.share_state(None)
    with pytest.raises(StateDownloadFailed):
        joiner.download_state(["d"], snap.digest.hex(), 1.0)
    keeper = InProcessTransport("k", hub, keeps_serving=True)
    keeper.share_state(lambda: [snap])
    keeper.share_state(None)  # a peer that stays up serving after its round loop ended
    assert joiner.download_state(["k"], snap.digest.hex(), 1.0).chunks_by_donor == {"k": 1}


def test_the_swarm_view_reads_the_hubs_records():
    hub = InProcessHub(ghosts=("ghost",))
    a, b = InProcessSwarm("a", hub), InProcessSwarm("b", hub)
    record = ProgressRecord(round=1, inner_step=25, train_loss=1.0, tokens_per_s=512.0, group_size=2, bytes_sent=0)
    a.publish(record)
    assert {r.peer_id for r in b.live()} == {"ghost", "a"} and {r.peer_id for r in a.others()} == {"ghost"}
    assert b.step_now(1, inner_steps=20, batch_size_tokens=256) == 5  # no extrapolation
    assert b.seconds_to_finish(1, b.live(), inner_steps=20, batch_size_tokens=256) == pytest.approx(15 / 2)
    stop = threading.Event()
    assert b.wait_for(3, timeout_s=5.0, stop=stop, heartbeat=lambda: b.publish(record)) == 3
    assert InProcessSwarm("c", InProcessHub()).wait_for(2, timeout_s=0.1, stop=stop, heartbeat=lambda: None) == 1
    assert not a.prefetch()
