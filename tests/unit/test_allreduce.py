"""peer.sync.allreduce over real unix sockets (no hivemind): means, exclusion rules, byte counts."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
import torch

import peer.sync.screening as screening_module
from peer.sync.allreduce import GroupAllreduce
from peer.sync.pieces import GroupPlan, stronger_compression
from protocol import codecs
from protocol.errors import PartialAverage
from protocol.manifest import CompressionSpec
from protocol.wire import allreduce as frames, framing
from protocol.wire.pieces import piece_shape, plan_pieces
from tests.security.group import owner_means, signers


@pytest.fixture(autouse=True)
def share_check_on(monkeypatch):
    """The receivers' share check is off by default (peer/sync/screening.py OWNER_SHARE_CHECK):
    these tests test it, so they turn it on."""
    monkeypatch.setattr(screening_module, "OWNER_SHARE_CHECK", True)


SHAPES = [torch.Size([40, 16]), torch.Size([16]), torch.Size([]), torch.Size([0, 3]), torch.Size([9, 2, 3])]


class Peer:
    """One group member: a unix socket server that routes streams to its session."""

    def __init__(self, index: int, directory: Path):
        self.index, self.path = index, str(directory / f"peer{index}.sock")
        self.session: GroupAllreduce | None = None
        self.ready = asyncio.Event()
        self.server = None

    async def start(self):
        self.server = await asyncio.start_unix_server(self._handle, path=self.path)

    async def _handle(self, reader, writer):
        payload = await framing.read_frame(reader, max_bytes=frames.MAX_HELLO_BYTES, timeout=5)
        hello = frames.parse_hello(payload, group_size=frames.MAX_GROUP_SIZE)
        await asyncio.wait_for(self.ready.wait(), 5)
        await self.session.serve(hello.sender, payload, reader, writer)


async def _run_group(
    payloads,
    weights,
    spec=CompressionSpec(),
    *,
    corrupt=None,
    dead_owner=None,
    timeout=1.0,
    piece_elements=64,
    max_weight=None,
    liar=None,
    phi_from=None,
):
    n = len(payloads)
    with tempfile.TemporaryDirectory() as tmp:
        peers = [Peer(i, Path(tmp)) for i in range(n)]
        for p in peers:
            if p.index != dead_owner:
                await p.start()
        shapes = [t.shape for t in payloads[0]]
        pieces = plan_pieces(shapes, owners=list(range(n)), piece_elements=piece_elements)
        shapes_of_pieces = [piece_shape(shapes[p.tensor], p) for p in pieces]
        sessions = []
        for i in range(n):
            own_spec = spec[i] if isinstance(spec, list) else spec  # a peer's own codec (traffic budget)
            piece_codecs = [codecs.make_codec(own_spec, s) for s in shapes_of_pieces]
            plan = GroupPlan(
                group_id=b"g" * 8,
                peer_ids=tuple(range(n)),
                my_index=i,
                pieces=pieces,
                codecs=piece_codecs,
                mean_codecs=[c.for_mean(n) for c in piece_codecs],
                max_piece_bytes=[codecs.max_encoded_bytes(s) for s in shapes_of_pieces],
                seeds=[p.index for p in pieces],
            )

            async def open_stream(peer_id, _peers=peers):
                return await asyncio.open_unix_connection(_peers[peer_id].path)

            session = GroupAllreduce(
                plan,
                [t.clone() for t in payloads[i]],
                weight=weights[i],
                compensate=lambda piece, x: x,
                stage=lambda *a: None,
                open_stream=open_stream,
                next_chunk_timeout=timeout,
                max_weight=max_weight,
                phi_from=phi_from,
                signer=signers(n)[i],
                peer_key=lambda index, n=n: signers(n)[index].peer_id,
            )
            if liar is not None and i == liar[0]:
                session._mean_of = _lying(session, liar[1])
            if corrupt is not None and i == corrupt[0]:
                original = session._encode_contribution

                def bad(piece, _original=original, _how=corrupt[1]):
                    payload = _original(piece)
                    return payload + b"\0\0\0\0" if _how == "long" else payload[:-4]

                session._encode_contribution = bad
            peers[i].session = session
            peers[i].ready.set()
            sessions.append(session)
        live = [s for s in sessions if s.plan.my_index != dead_owner]
        outcomes = await asyncio.gather(*(s.run() for s in live), return_exceptions=True)
        for s, outcome in zip(live, outcomes):
            if not isinstance(outcome, BaseException):
                s.apply()
            s.close()
        for p in peers:
            if p.server is not None:
                p.server.close()
        return live, outcomes


def _lying(session, forge):
    """``session._mean_of`` of an owner that sends ``forge(honest mean)`` instead of the mean."""
    honest = session._mean_of

    def mean_of(piece, parts, included):
        _, value, clipped = honest(piece, parts, included)
        data, forged = session._roundtrip(piece, forge(value), session.plan.mean_codecs[piece.index])
        return frames.encode_mean(piece.index, included, data), forged, clipped

    return mean_of


def _expected(payloads, weights, members):
    total = sum(weights[i] for i in members)
    return [sum(payloads[i][k] * (weights[i] / total) for i in members) for k in range(len(payloads[0]))]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_group_gets_identical_weighted_mean(n):
    gen = torch.Generator().manual_seed(n)
    # Pseudo-gradients of one model from one φ: similar in scale. (Independent N(0, 1) values in the
    # 0-d tensor can lie 10x apart, and the owner would clip them to 3x the median: screening.py.)
    payloads = [[1.0 + 0.3 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    weights = [float(100 + 37 * i) for i in range(n)]
    sessions, outcomes = asyncio.run(_run_group(payloads, weights))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    expected = owner_means(payloads, sessions[0].plan.pieces, weights)  # the weighted mean from 4 on trimmed
    for s in sessions:
        for got, want, first in zip(s.tensors, expected, sessions[0].tensors):
            assert torch.allclose(got, want, atol=1e-6)
            assert torch.equal(got, first)  # bit-identical on every peer
    # every byte counted on both ends: what all wrote, all read
    assert sum(o.bytes_sent for o in outcomes) == sum(o.bytes_received for o in outcomes) > 0


@pytest.mark.parametrize("n", [2, 3])
def test_the_stats_run_returns_count_the_means_still_being_written(n, monkeypatch):
    """The round's report reads ``bytes_sent`` as soon as ``run()`` returns; the means this peer owes
    its senders are written by ``serve()``'s own tasks. Here peer 0's writes start late (as they can
    behind a p2p daemon), after its own exchange has ended: the count taken at the return still
    holds them."""
    original = GroupAllreduce._send_means

    async def late(self, writer):
        if self.plan.my_index == 0:
            await asyncio.sleep(0.2)
        await original(self, writer)

    monkeypatch.setattr(GroupAllreduce, "_send_means", late)
    counted = {}
    run = GroupAllreduce.run

    async def counting_run(self):
        stats = await run(self)
        counted[self.plan.my_index] = stats.bytes_sent  # what the transport reads, at this moment
        return stats

    monkeypatch.setattr(GroupAllreduce, "run", counting_run)
    gen = torch.Generator().manual_seed(n)
    payloads = [[1.0 + 0.3 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0] * n, timeout=5.0))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert [counted[i] for i in range(n)] == [o.bytes_sent for o in outcomes]
    assert sum(counted.values()) == sum(o.bytes_received for o in outcomes) > 0


@pytest.mark.parametrize("how", ["long", "short"])
def test_malformed_sender_is_excluded_and_others_agree(how):
    n = 4
    gen = torch.Generator().manual_seed(7)
    payloads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    weights = [1.0] * n
    sessions, outcomes = asyncio.run(_run_group(payloads, weights, corrupt=(2, how)))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    excluded = {i for o in outcomes for i in o.excluded}
    assert excluded == {2}
    for s in sessions:
        for got, first in zip(s.tensors, sessions[0].tensors):
            assert torch.isfinite(got).all() and torch.equal(got, first)
    # pieces reduced by an honest owner average the honest peers only
    honest_mean = _expected(payloads, weights, [0, 1, 3])
    piece = next(p for p in sessions[0].plan.pieces if p.owner == 0)
    got = sessions[0].tensors[piece.tensor][piece.start : piece.stop]
    assert torch.allclose(got, honest_mean[piece.tensor][piece.start : piece.stop], atol=1e-6)


def test_dead_owner_means_nothing_is_applied():
    n = 3
    payloads = [[torch.full(s, float(i)) for s in SHAPES] for i in range(n)]
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0] * n, dead_owner=1, timeout=0.5))
    for s, outcome in zip(sessions, outcomes):
        assert isinstance(outcome, PartialAverage)
        assert all(torch.equal(t, p) for t, p in zip(s.tensors, payloads[s.plan.my_index]))


def test_non_finite_own_piece_is_left_out_of_the_owners_mean():
    n = 3
    payloads = [[torch.ones(s) * (i + 1) for s in SHAPES] for i in range(n)]
    payloads[0][0][0, 0] = float("nan")
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0] * n))
    # the NaN row lies in a piece peer 0 reduces itself: it leaves itself out of that mean
    assert sessions[0].plan.pieces[0].owner == 0
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert 0 in outcomes[0].excluded
    for s in sessions:
        for got, first in zip(s.tensors, sessions[0].tensors):
            assert torch.isfinite(got).all() and torch.equal(got, first)
    assert torch.all(sessions[1].tensors[0][:4] == 2.5)  # mean of peers 1 and 2 (values 2 and 3)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4", "fp4", "topk", "lowrank"])
def test_every_codec_gives_identical_means(codec):
    n = 3
    gen = torch.Generator().manual_seed(3)
    payloads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    spec = CompressionSpec(codec=codec, topk_fraction=0.25, rank=2)
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0, 2.0, 3.0], spec))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    expected = _expected(payloads, [1.0, 2.0, 3.0], range(n))
    for s in sessions:
        for got, first in zip(s.tensors, sessions[0].tensors):
            assert torch.equal(got, first) and torch.isfinite(got).all()
    if codec in ("fp16", "bf16", "int8"):  # dense codecs: close to the exact mean
        for got, want in zip(sessions[0].tensors, expected):
            assert torch.allclose(got, want, atol=0.05, rtol=0.02)


def test_a_peer_sending_with_the_stronger_codec_still_gives_every_peer_the_same_mean():
    """A peer past half its share of --max-gb-per-day sends its contributions and owned means with
    the next stronger codec (int8 run: int4): the encodings describe themselves, the group
    completes, every peer holds the same bits, and that peer sent fewer bytes."""
    n = 3
    gen = torch.Generator().manual_seed(7)
    payloads = [[1.0 + 0.3 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    run = CompressionSpec(codec="int8")
    assert stronger_compression(run).codec == "int4"
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0, 1.0, 1.0], [stronger_compression(run), run, run]))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    expected = _expected(payloads, [1.0, 1.0, 1.0], range(n))
    for s in sessions:
        for got, first, want in zip(s.tensors, sessions[0].tensors, expected):
            assert torch.equal(got, first)
            assert torch.allclose(got, want, atol=0.25)  # int4: a/14 on its contribution and on its means
    # every peer sends the same seals (one per sender of its pieces) and receipts (one per other
    # owner, a signature per owner): the same bytes whatever the codec, left out of the comparison
    seal = framing.LENGTH.size + frames.SEAL_HEADER.size + len(signers(n)[0].public_der) + 256
    receipt = framing.LENGTH.size + frames.RECEIPT_HEADER.size + n * (frames.RECEIPT_ENTRY.size + 256)
    fixed = (n - 1) * (seal + receipt)
    assert outcomes[0].bytes_sent - fixed < 0.8 * (outcomes[1].bytes_sent - fixed)


def test_stronger_compression_steps_one_codec_and_keeps_the_rest():
    assert stronger_compression(CompressionSpec()).codec == "int8"
    assert stronger_compression(CompressionSpec(codec="bf16")).codec == "int8"
    kept = CompressionSpec(codec="fp4", phi_codec="fp16", block_size=32)
    assert stronger_compression(kept) is kept  # no stronger one: the peer sits out instead
    phi = stronger_compression(CompressionSpec(codec="int8", phi_codec="fp16", block_size=32))
    assert (phi.codec, phi.phi_codec, phi.block_size) == ("int4", "fp16", 32)
    adaptive = CompressionSpec(codec="adaptive")
    assert stronger_compression(adaptive) is adaptive


def test_topk_owner_compresses_its_own_rows_so_the_mean_stays_exact():
    n = 3
    gen = torch.Generator().manual_seed(5)
    shapes = [torch.Size([64, 32])]
    payloads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n)]
    spec = CompressionSpec(codec="topk", topk_fraction=0.05)
    sessions, outcomes = asyncio.run(_run_group(payloads, [1.0] * n, spec))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    plan = sessions[0].plan
    for piece in plan.pieces:
        codec, seed = plan.codecs[piece.index], plan.seeds[piece.index]
        decoded = [
            codecs.decode(
                codec.encode(p[piece.tensor][piece.start : piece.stop].contiguous(), seed=seed),
                tuple(p[piece.tensor][piece.start : piece.stop].shape),
                seed=seed,
            )
            for p in payloads
        ]
        want = sum(decoded) / n  # the mean of what every peer's codec kept, the owner's included
        got = sessions[0].tensors[piece.tensor][piece.start : piece.stop]
        assert torch.allclose(got, want, atol=1e-2, rtol=1e-2), piece


LIE_SHAPES = [torch.Size([64, 16]), torch.Size([512])]


@pytest.mark.parametrize("forge", ["flip", "x100", "zeros", "noise"])
def test_a_lying_owners_pieces_are_refused_by_every_honest_receiver(forge):
    n, liar = 4, 1
    gen = torch.Generator().manual_seed(3)
    common = [torch.randn(s, generator=gen) for s in LIE_SHAPES]  # Δs of one model: correlated
    payloads = [[c + 0.5 * torch.randn(c.shape, generator=gen) for c in common] for _ in range(n)]
    forges = {
        "flip": lambda m: -m,
        "x100": lambda m: 100 * m,
        "zeros": torch.zeros_like,
        "noise": lambda m: torch.randn(m.shape, generator=gen) * m.norm() / m.numel() ** 0.5,
    }
    sessions, outcomes = asyncio.run(
        _run_group(payloads, [100.0] * n, piece_elements=256, max_weight=100.0, liar=(liar, forges[forge]))
    )
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    honest = [s for s in sessions if s.plan.my_index != liar]
    expected = owner_means(payloads, sessions[0].plan.pieces)
    for s in honest:
        assert list(s.stats.refused) == [str(liar)] and s.stats.refused_pieces > 0
        # the averager strikes (toward ignoring) only for the norm check: x100 fails it, the others fail the share check
        assert s.stats.struck_owners == ({str(liar)} if forge == "x100" else set())
        for piece in s.plan.pieces:
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            if piece.owner == liar:
                assert torch.equal(got, torch.zeros_like(got))  # refused: zeros, the same on every receiver
            else:
                assert torch.allclose(got, expected[piece.tensor][piece.start : piece.stop], atol=1e-5)
        for got, first in zip(s.tensors, honest[0].tensors):
            assert torch.equal(got, first)  # the honest receivers still agree bit for bit


def test_honest_owners_means_are_never_refused():
    n = 5
    gen = torch.Generator().manual_seed(4)
    common = [torch.randn(s, generator=gen) for s in LIE_SHAPES]
    payloads = [[c + 0.5 * torch.randn(c.shape, generator=gen) for c in common] for _ in range(n)]
    weights = [100.0, 100.0, 60.0, 100.0, 10.0]  # a short round (a joiner) among them
    sessions, outcomes = asyncio.run(_run_group(payloads, weights, piece_elements=256, max_weight=100.0))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert all(not s.stats.refused and s.stats.refused_pieces == 0 for s in sessions)
    for s in sessions:
        for got, first in zip(s.tensors, sessions[0].tensors):
            assert torch.equal(got, first)


def test_a_refused_phi_piece_keeps_the_receivers_own_values():
    n, liar = 3, 2
    gen = torch.Generator().manual_seed(5)
    common = [torch.randn(s, generator=gen) for s in LIE_SHAPES]
    payloads = [[c + 0.1 * torch.randn(c.shape, generator=gen) for c in common] for _ in range(n)]
    sessions, _ = asyncio.run(
        _run_group(
            payloads, [100.0] * n, piece_elements=256, max_weight=100.0, liar=(liar, lambda m: 1e3 * m), phi_from=1
        )
    )  # tensor 1 is φ
    for s in (x for x in sessions if x.plan.my_index != liar):
        for piece in (p for p in s.plan.pieces if p.owner == liar):
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            own = payloads[s.plan.my_index][piece.tensor][piece.start : piece.stop]
            assert torch.equal(got, own if piece.tensor == 1 else torch.zeros_like(got))


def test_a_phi_contribution_far_from_the_owners_is_left_out():
    # NoLoCo: tensor 1 is φ (its pieces owned by peer 2); peer 0 sends φ = 0 (pulling a mean halfway to zero)
    n, attacker = 3, 0
    gen = torch.Generator().manual_seed(6)
    common = [torch.randn(s, generator=gen) for s in LIE_SHAPES]
    payloads = [[c + 0.05 * torch.randn(c.shape, generator=gen) for c in common] for _ in range(n)]
    payloads[attacker][1] = torch.zeros(LIE_SHAPES[1])
    sessions, outcomes = asyncio.run(
        _run_group(payloads, [100.0] * n, piece_elements=256, max_weight=100.0, phi_from=1)
    )
    owners = {p.owner for p in sessions[0].plan.pieces if p.tensor == 1}
    assert owners - {attacker}  # an honest owner holds φ pieces
    for s in sessions:
        if s.plan.my_index in owners - {attacker}:
            assert attacker in s.stats.dropped and attacker in s.stats.excluded
    honest_phi = (payloads[1][1] + payloads[2][1]) / 2
    for s in sessions[1:]:
        for piece in (p for p in s.plan.pieces if p.tensor == 1 and p.owner != attacker):
            assert torch.allclose(
                s.tensors[1][piece.start : piece.stop], honest_phi[piece.start : piece.stop], atol=1e-6
            )


def test_a_finished_session_released_holds_no_tensor_of_the_model():
    """Once a session is over (applied, closed) ``release`` drops its decoded means, its own
    contributions as sent and the contributions to its pieces: the averager keeps the session
    object a while for its group's late streams, not its model-sized tensors. The applied means
    stay in the payload tensors."""
    gen = torch.Generator().manual_seed(3)
    payloads = [[1.0 + 0.3 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
    sessions, outcomes = asyncio.run(_run_group(payloads, [100.0, 137.0], CompressionSpec(codec="int8")))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    applied = [[t.clone() for t in s.tensors] for s in sessions]
    assert all(s.results for s in sessions)  # held until released
    for s, tensors in zip(sessions, applied):
        s.release()
        assert not s.results and not s._sent
        assert all(slots == [] for slots in s._contrib.values())
        assert all(torch.equal(a, b) for a, b in zip(s.tensors, tensors))
