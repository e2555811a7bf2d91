"""Issue #51, item 1: no piece unbounded.

An attacker owning the pieces under 256 values (every RMSNorm gain of the tiny and default presets)
sent means of 1e30: the receivers' check skipped pieces that small, the outer step checked only
finiteness, and from round 4 every honest φ was ~1e30 with a NaN loss, checkpointed. Now:

1. a receiver refuses an owner's mean of any piece whose norm is out of bound
   (peer/sync/screening.py ``owner_mean_problem``, through GroupAllreduce's receiver path);
2. an outer step whose change of φ exceeds what an honest mean can make from this peer's own Δ is
   refused, φ unchanged (peer/train/step_bound.py ``check_step_bound``, in the round engine's landing);
3. a φ that turned non-finite or exploded is rolled back to the last snapshot at the round's end
   (``RoundState.guard_phi``);
4. a checkpoint never holds a non-finite φ (peer/state/checkpoint.py ``encode_checkpoint``).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.reporting import Reporter
from peer.round import Trainer
from peer.state.checkpoint import PeerState, load_checkpoint, save_checkpoint
from peer.sync.screening import OWNER_CHECK_MIN_ELEMENTS, owner_mean_problem, reference_rms
from peer.train.model import build_model
from protocol.errors import CheckpointError
from protocol.presets import tiny_run
from tests.security.group import run_group
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import run_in_threads

pytestmark = pytest.mark.timeout(300)

HUGE = 1e30


# ---- 1. the receiver's check -------------------------------------------------------------------
def test_a_huge_mean_of_a_small_piece_is_refused_by_the_receiver_check():
    gen = torch.Generator().manual_seed(0)
    own = 1e-3 * torch.randn(64, generator=gen)  # an RMSNorm gain's Δ: 64 values
    assert own.numel() < OWNER_CHECK_MIN_ELEMENTS
    honest = own + 1e-3 * torch.randn(64, generator=gen)
    rms = reference_rms([own, 1e-3 * torch.randn(4096, generator=gen)])
    assert owner_mean_problem(honest, own, weight=1.0, included=3, max_weight=1.0, reference_rms=rms) is None
    refused = owner_mean_problem(
        torch.full_like(own, HUGE), own, weight=1.0, included=3, max_weight=1.0, reference_rms=rms
    )
    assert refused is not None and refused.strike
    # a near-zero own piece: its honest mean (the others' values) passes under the floor, 1e30 does not
    zero = torch.zeros(64)
    assert owner_mean_problem(honest / 2, zero, weight=1.0, included=3, max_weight=1.0, reference_rms=rms) is None
    assert owner_mean_problem(
        torch.full_like(zero, HUGE), zero, weight=1.0, included=3, max_weight=1.0, reference_rms=rms
    ).strike


def test_an_owner_of_small_pieces_sending_1e30_is_refused_through_the_allreduce():
    """Three peers, payloads of RMSNorm-gain-sized tensors (64 values each): the liar's pieces are
    refused by both honest receivers (applied as zeros, the liar named), the rest averaged."""
    n, liar = 3, 2
    shapes = [torch.Size([64])] * 6
    gen = torch.Generator().manual_seed(5)
    base = [1e-2 * torch.randn(s, generator=gen) for s in shapes]
    payloads = [[b + 1e-3 * torch.randn(s, generator=gen) for b, s in zip(base, shapes)] for _ in range(n)]
    sessions, outcomes = asyncio.run(
        run_group(
            payloads, [1024] * n, max_weight=1024, piece_elements=64, liars={liar: lambda m: torch.full_like(m, HUGE)}
        )
    )
    assert not any(isinstance(o, BaseException) for o in outcomes[:liar]), outcomes
    assert any(p.owner == liar for p in sessions[0].plan.pieces)
    mean = [sum(p[k] for p in payloads) / n for k in range(len(shapes))]
    for s in sessions[:liar]:
        assert list(s.stats.refused) == [str(liar)] and str(liar) in s.stats.struck_owners
        for piece in s.plan.pieces:
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            if piece.owner == liar:
                assert torch.equal(got, torch.zeros_like(got))
            else:
                assert torch.allclose(got, mean[piece.tensor][piece.start : piece.stop], atol=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(sessions[0].tensors, sessions[1].tensors))


def test_the_step_bound_takes_the_screenings_numbers():
    """peer/train/ does not import peer/sync/: the outer step's bound keeps its own copies."""
    import peer.sync.screening as screening
    import peer.train.step_bound as step_bound

    assert step_bound.HONEST_MEAN_FACTOR == screening.OWNER_NORM_FACTOR
    assert step_bound.HONEST_PHI_RATIO == screening.PHI_MAX_NORM_RATIO


# ---- the round engine, two Trainers over the in-process hub ---------------------------------------
class PoisonedHub(InProcessHub):
    """Every group's mean has one small tensor (``target``) replaced by 1e30: a lying owner whose
    mean the hub (which screens nothing) passes on to every member."""

    def __init__(self, members, *, target: int):
        super().__init__(members)
        self.target = target

    def _close(self, entry):
        super()._close(entry)
        mean = entry["mean"]
        mean[self.target] = torch.full_like(mean[self.target], HUGE)


class Events(Reporter):
    def __init__(self):
        super().__init__()
        self.events = []

    def emit(self, event, **fields):
        self.events.append({"event": event, **fields})

    def of(self, kind):
        return [e for e in self.events if e["event"] == kind]


def _trainers(corpus, manifest, hub, *, rounds, checkpoints=None):
    return [
        Trainer(
            manifest=manifest,
            model=build_model(manifest.model, corpus.tokenizer),
            corpus=corpus,
            swarm=InProcessSwarm(p, hub),
            transport=InProcessTransport(p, hub),
            config=TrainerConfig(
                max_rounds=rounds, checkpoint_path=None if checkpoints is None else checkpoints / p / "c.st"
            ),
            reporter=Events(),
            stop_event=threading.Event(),
        )
        for p in ("a", "b")
    ]


_run = run_in_threads  # tests/unit/test_round_overlap.py: run the Trainers to their end, none raising


def _small_tensor(trainer) -> int:
    return next(
        i
        for i, (name, f) in enumerate(zip(trainer.names, trainer.phi))
        if f.numel() < OWNER_CHECK_MIN_ELEMENTS and "norm" in name
    )


@pytest.mark.parametrize("overlap", ["none", "delayed", "streaming"])
def test_an_outer_step_with_a_huge_mean_is_refused_and_phi_is_unchanged(corpus, overlap, tmp_path):
    """Every sync's mean carries 1e30 in an RMSNorm gain: each landing's step is refused (its report
    failed, a warning naming the bound), so φ ends where it started on both peers, finite, and the
    checkpoint holds it."""
    manifest = tiny_run()
    if overlap == "streaming":  # the tiny preset's single block: one fragment, landing a step late
        manifest = manifest.replace(sync={"overlap": overlap, "fragments": 1, "fragment_delay_steps": 1})
    elif overlap != "none":
        manifest = manifest.replace(sync={"overlap": overlap})
    probe = _trainers(corpus, manifest, InProcessHub(2), rounds=1)[0]
    hub = PoisonedHub(2, target=_small_tensor(probe))
    trainers = _trainers(corpus, manifest, hub, rounds=2, checkpoints=tmp_path)
    phi0 = [f.clone() for f in trainers[0].phi]
    _run(trainers)
    for t in trainers:
        assert all(torch.equal(x, y) for x, y in zip(t.phi, phi0)), "a refused step must leave φ unchanged"
        warnings = [e["message"] for e in t.reporter.of("warning")]
        assert any("over its bound" in w for w in warnings), warnings
        landed = [e for e in t.reporter.of("round") if e.get("group_size", 0) > 1 or e.get("failed")]
        assert landed, t.reporter.of("round")
        t.save()
        saved = load_checkpoint(tmp_path / t.peer_id / "c.st", run_id=manifest.run_id, names=t.names, shapes=t.shapes)
        assert all(torch.equal(x, y) for x, y in zip(saved.phi, phi0))


def test_an_exploded_phi_is_rolled_back_at_the_rounds_end(corpus, monkeypatch):
    """With the step bound switched off, the poisoned mean explodes φ; the round's end finds ‖φ‖ far
    over the last snapshot's and restores it (φ, outer state, θ), with a warning: φ never leaves
    the last good state and the snapshots joiners download never hold it."""
    import peer.round.streamed as streamed

    monkeypatch.setattr(streamed, "check_step_bound", lambda *a, **k: None, raising=False)
    manifest = tiny_run()
    probe = _trainers(corpus, manifest, InProcessHub(2), rounds=1)[0]
    hub = PoisonedHub(2, target=_small_tensor(probe))
    trainers = _trainers(corpus, manifest, hub, rounds=2)
    phi0 = [f.clone() for f in trainers[0].phi]
    _run(trainers)
    for t in trainers:
        assert all(torch.equal(x, y) for x, y in zip(t.phi, phi0))
        assert all(torch.equal(p.detach(), f) for p, f in zip(t.params, t.phi))
        for snapshot in t.state.snapshots:
            assert all(torch.equal(x, y) for x, y in zip(snapshot.tensors[: len(phi0)], phi0))
        assert any("rolled back" in e["message"] for e in t.reporter.of("warning"))


def test_a_non_finite_phi_is_rolled_back_to_the_last_snapshot(corpus):
    t = _trainers(corpus, tiny_run(), InProcessHub(2), rounds=1)[0]
    phi0 = [f.clone() for f in t.phi]
    bad_phi = t.phi[0].clone()
    bad_phi.view(-1)[0] = float("nan")
    n = len(t.phi)
    t.state.install([0, n + 1], [bad_phi, torch.full_like(t.outer.state_tensors()[1], float("inf"))])
    t.schedule.guard_phi()
    assert all(torch.equal(x, y) for x, y in zip(t.phi, phi0))
    assert all(bool(torch.isfinite(m).all()) for m in t.outer.state_tensors())
    assert any("non-finite" in e["message"] for e in t.reporter.of("warning"))


# ---- 4. the checkpoint -------------------------------------------------------------------------
def test_a_checkpoint_refuses_a_non_finite_phi_and_keeps_the_previous_file(tmp_path):
    names, shapes = ["w", "g"], [torch.Size([4, 4]), torch.Size([4])]

    def state(phi):
        return PeerState(
            run_id="r",
            round=1,
            inner_step=8,
            round_step=0,
            round_tokens=0,
            names=names,
            phi=phi,
            momentum=[torch.zeros(s) for s in shapes],
            theta=[torch.zeros(s) for s in shapes],
        )

    path = tmp_path / "c.safetensors"
    good = [torch.ones(s) for s in shapes]
    save_checkpoint(path, state(good))
    for poison in (float("nan"), float("inf")):
        bad = [t.clone() for t in good]
        bad[1][2] = poison
        with pytest.raises(CheckpointError, match="NaN or inf"):
            save_checkpoint(path, state(bad))
        loaded = load_checkpoint(path, run_id="r", names=names, shapes=shapes)
        assert all(torch.equal(x, y) for x, y in zip(loaded.phi, good))
