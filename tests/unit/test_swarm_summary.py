"""`peer swarm`'s summary tells whether the peers ended on one φ (issue #53 item 8): the final
validation loss it prints is the peers' mean, labelled so, with each peer's own loss and, when they
ended on different states (compared by state digest), how many and how far apart."""

import io
import json
from types import SimpleNamespace

from rich.console import Console

from peer.events import Event
from peer.swarm import SwarmConfig, _print_summary, build_summary, final_state

A, B = "3f2a9c1e" + "0" * 24, "7b1d0e55" + "1" * 24


class _Peer:
    """A finished peer's events, read as peer.launch.Child reads them."""

    def __init__(self, *fields: dict, returncode: int = 0):
        self.events = [Event(dict(f)) for f in fields]
        self.returncode = returncode

    def of(self, kind):
        return [e for e in self.events if e.kind == kind]

    def last(self, kind, **match):
        return next(
            (e for e in reversed(self.events) if e.kind == kind and all(e.get(k) == v for k, v in match.items())), None
        )


def _round(n: int, digest: str) -> dict:
    return {
        "event": "round",
        "round": n,
        "state_digest": digest,
        "group_size": 2,
        "bytes_sent": 10,
        "bytes_received": 10,
        "tokens_per_s": 100.0,
    }


def _peer(final_digest: str, final_loss: float | None, *, adopted: str | None = None) -> _Peer:
    events = [
        {"event": "started", "peer_id": "12D3KooW" + "x" * 20},
        {"event": "eval", "when": "initial", "round": 0, "loss": 5.7025},
        _round(1, A),
        _round(2, final_digest),
    ]
    if adopted is not None:
        events.append({"event": "adopted_state", "round": 2, "state_digest": adopted})
    if final_loss is not None:
        events.append({"event": "eval", "when": "final", "round": 2, "loss": final_loss})
    events.append(
        {"event": "stopped", "rounds_completed": 2, "max_group_size": 2, "bytes_sent": 20, "bytes_received": 20}
    )
    return _Peer(*events)


def _summary(*peers: _Peer, algorithm: str = "diloco") -> tuple[dict, str]:
    from protocol.presets import tiny_run

    manifest = tiny_run().replace(sync={"algorithm": algorithm}) if algorithm != "diloco" else tiny_run()
    children = {"bootstrap": _Peer()} | {f"peer-{i}": p for i, p in enumerate(peers)}
    swarm = SimpleNamespace(children=children, workdir="/tmp/w")
    summary = build_summary(swarm, SwarmConfig(manifest=manifest, rounds=2), 70.0)
    out = io.StringIO()
    _print_summary(Console(file=out, width=400), summary)
    json.dumps(summary)  # --summary writes it
    return summary, out.getvalue()


def test_the_final_state_is_the_last_digest_before_the_final_evaluation():
    peer = _peer(B, 2.1, adopted=A)
    assert final_state(peer.events) == (A, 2)  # the adopted state came after round 2's
    assert final_state(_peer(B, None).events) == (B, 2)
    assert final_state([]) == (None, None)


def test_peers_on_one_phi_say_so_and_the_loss_is_labelled_a_mean():
    summary, out = _summary(_peer(B, 2.0962), _peer(B, 2.0962), _peer(B, 2.0962))
    assert summary["final_states"] == 1 and summary["final_eval_loss_spread"] == 0.0
    assert summary["final_eval_loss_peers"] == 3
    assert [p["final_state_digest"] for p in summary["peers"]] == [B] * 3
    assert "validation loss: 5.7025 → 2.0962 nats/token (mean of 3 peers) | wall 70 s" in out
    assert (
        "final φ: all 3 peers on the same state (7b1d0e55…, round 2): "
        "peer-0 2.0962, peer-1 2.0962, peer-2 2.0962" in out
    )
    assert "different" not in out


def test_peers_on_different_phi_are_counted_with_the_spread_of_their_losses():
    summary, out = _summary(_peer(A, 2.1547), _peer(B, 2.0725), _peer(B, 2.0725))
    assert summary["final_states"] == 2
    assert abs(summary["final_eval_loss_spread"] - 0.0822) < 1e-9
    assert abs(summary["final_eval_loss"] - (2.1547 + 2 * 2.0725) / 3) < 1e-9
    assert "2.0999 nats/token (mean of 3 peers)" in out
    assert (
        "final φ: the peers ended on 2 different states, validation loss 2.0725 to 2.1547 "
        "(spread 0.0822 nats/token; the loss above is their mean): peer-0 2.1547 (state 3f2a9c1e…, round 2), "
        "peer-1 2.0725 (state 7b1d0e55…, round 2), peer-2 2.0725 (state 7b1d0e55…, round 2)"
    ) in out
    assert "NoLoCo" not in out


def test_noloco_says_different_phi_are_expected():
    _, out = _summary(_peer(A, 2.1547), _peer(B, 2.0725), algorithm="noloco")
    assert "2 different states" in out and "expected with NoLoCo" in out


def test_a_peer_without_a_final_evaluation_is_named_and_left_out_of_the_comparison():
    summary, out = _summary(_peer(B, 2.0962), _peer(B, 2.0962), _peer(A, None))
    assert summary["final_states"] == 1 and summary["final_eval_loss_peers"] == 2
    assert "(mean of 2 peers)" in out
    assert "the 2 peers that evaluated it on the same state" in out and "peer-2 no final evaluation" in out


def test_two_peers_on_one_phi_read_as_both():
    _, out = _summary(_peer(B, 2.0962), _peer(B, 2.0962))
    assert "final φ: both peers on the same state (7b1d0e55…, round 2): peer-0 2.0962, peer-1 2.0962" in out


def test_one_peer_prints_the_line_as_before():
    summary, out = _summary(_peer(B, 2.0962))
    assert summary["final_states"] == 1
    assert "validation loss: 5.7025 → 2.0962 nats/token | wall 70 s" in out
    assert "mean" not in out and "final φ" not in out
