"""NoLoCo's loss gate (peer/round/loss_gate.py, issue #65): a group's step that leaves φ clearly worse
on this peer's next batches than its own step alone is replaced by that step."""

from __future__ import annotations

import math

import pytest
import torch

from lab.adversary import Adversary
from lab.engine_sim import run_engine_simulation
from peer.round.loss_gate import GATE_MARGIN, GATE_MAX_BATCHES, LossGate
from peer.train.data import BatchSampler, PeekSampler
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def _gate(losses: dict[str, float], margin: float = GATE_MARGIN) -> tuple[LossGate, list[torch.Tensor]]:
    """A gate whose loss is looked up by the first value of φ's first tensor (a stand-in for the
    model: this tests the rule), and the windows it was asked about."""
    sampler = PeekSampler(BatchSampler(torch.arange(1000), seq_len=4, batch_sequences=32, seed=1))
    seen: list[torch.Tensor] = []

    def loss(phi, windows):
        seen.append(windows)
        return losses[str(int(phi[0].flatten()[0]))]

    return LossGate(sampler=sampler, loss=loss, margin=margin), seen


def _phi(tag: int) -> list[torch.Tensor]:
    return [torch.full((2,), float(tag))]


def test_a_group_step_within_the_margin_is_applied_and_a_worse_one_refused():
    gate, seen = _gate({"1": 2.0, "2": 2.0 * (1 + GATE_MARGIN) - 1e-6, "3": 2.0 * (1 + GATE_MARGIN) + 1e-3})
    assert gate.refusal(_phi(1), _phi(2)) is None
    problem = gate.refusal(_phi(1), _phi(3))
    assert problem is not None and "over its own step's 2.0000" in problem
    # both losses of one judgement on the same windows: the next batches' sequences, read ahead (at
    # most GATE_MAX_BATCHES of them: 4,096 tokens would take 32 of these), then trained on in order
    assert all(torch.equal(w, seen[0]) for w in seen)
    assert seen[0].shape == (GATE_MAX_BATCHES * 32, 5)
    trained = torch.cat([gate.sampler.next_batch() for _ in range(GATE_MAX_BATCHES)])
    assert torch.equal(seen[0], trained)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_group_step_of_non_finite_loss_is_refused(value):
    gate, _ = _gate({"1": 2.0, "2": value})
    assert gate.refusal(_phi(1), _phi(2)) is not None


def test_a_negative_margin_is_refused():
    with pytest.raises(ValueError, match="margin"):
        _gate({}, margin=-0.1)


def _engine(corpus, attack: str | None, *, loss_gate: bool = True, overlap: str = "none", rounds: int = 3):
    manifest = tiny_run().replace(sync={"algorithm": "noloco", "overlap": overlap})
    adversary = None if attack is None else Adversary(attack=attack, peers=(3,))
    return run_engine_simulation(
        manifest,
        corpus,
        peers=4,
        rounds=rounds,
        adversary=adversary,
        matchmaking_s=20.0,
        loss_gate=loss_gate,
        pinned=overlap != "none",
    )


@pytest.fixture(scope="module", autouse=True)
def warm_autograd():
    """One backward pass on this thread first (torch imports its autograd helpers lazily)."""
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()


def test_honest_noloco_pairs_pass_the_gate(corpus):
    """Four honest round loops in NoLoCo pairs on the engine: the gate refuses no group's step."""
    result = _engine(corpus, None)
    assert result.screening["rounds_with_refused_steps"] == 0
    assert result.non_finite_rounds == 0 and result.honest_exits == 0


def test_a_partner_sending_its_first_phi_is_refused_by_the_gate(corpus):
    """One of four peers stopped training and keeps sending its first φ (the start) with a zero Δ:
    it passes every φ and Δ check, and without the gate a partner that averages it goes halfway
    back to the start; the gate refuses those steps, and the honest peers end closer to the clean
    run than without it."""
    clean = _engine(corpus, None).history[-1].loss_bpb
    gated = _engine(corpus, "stale-phi")
    ungated = _engine(corpus, "stale-phi", loss_gate=False)
    assert gated.screening["rounds_with_refused_steps"] > 0
    assert ungated.screening["rounds_with_refused_steps"] == 0
    assert gated.non_finite_rounds == 0 and gated.honest_exits == 0
    worst_gated, worst_ungated = max(gated.history[-1].per_peer_bpb), max(ungated.history[-1].per_peer_bpb)
    assert worst_gated < worst_ungated, (worst_gated, worst_ungated, clean)


def test_a_delayed_landing_is_gated_as_a_blocking_one_is(corpus):
    """sync.overlap = "delayed": the group's step of the sync landing one round late is judged by the
    same gate against this peer's own step alone (its Δ rebuilt as φ − ψ), so the stale-φ partner's
    steps are refused there too, and nothing an honest pair does is."""
    honest = _engine(corpus, None, overlap="delayed", rounds=4)
    assert honest.screening["rounds_with_refused_steps"] == 0
    gated = _engine(corpus, "stale-phi", overlap="delayed", rounds=4)
    ungated = _engine(corpus, "stale-phi", overlap="delayed", rounds=4, loss_gate=False)
    assert gated.screening["rounds_with_refused_steps"] > 0
    assert ungated.screening["rounds_with_refused_steps"] == 0
    assert gated.non_finite_rounds == 0 and gated.honest_exits == 0
    assert max(gated.history[-1].per_peer_bpb) < max(ungated.history[-1].per_peer_bpb)
