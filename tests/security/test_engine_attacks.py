"""Every attack class of lab/adversary.py, driven through the round engine (lab/engine_sim.py: real
``Trainer`` s in threads over the in-process hub, which deals and screens each group's pieces as the
network's all-reduce does): what the defences guarantee today, on the tiny preset, 4 peers, a few
rounds (issue #51 item 7)."""

from __future__ import annotations

import math

import pytest
import torch

from lab.adversary import EQUIVOCATION_STEP, Adversary
from lab.engine_sim import EngineResult, run_engine_simulation
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)

PEERS, ROUNDS = 4, 2


def _run(corpus, attack: str | None, *, malicious: tuple[int, ...] = (3,), algorithm: str = "diloco", **kw):
    manifest = tiny_run().replace(sync={"algorithm": algorithm})
    adversary = None if attack is None else Adversary(attack=attack, peers=malicious, **kw)
    return run_engine_simulation(
        manifest, corpus, peers=PEERS, rounds=ROUNDS, adversary=adversary, matchmaking_s=20.0, timeout_s=240.0
    )


@pytest.fixture(scope="module", autouse=True)
def warm_autograd():
    """One backward pass on this thread first: torch imports its autograd helpers lazily at the
    first backward, which four round loops starting at once would otherwise all wait for."""
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()


def _held(result: EngineResult, honest: int, *, trains: bool = True) -> None:
    """What every attack leaves true: each honest loop finished, no honest φ ever non-finite, every
    honest peer's final φ finite and (``trains``) its loss below φ_0's."""
    assert result.honest_exits == 0 and len(result.honest) == honest
    assert result.non_finite_rounds == 0
    for i in result.honest:
        assert all(bool(torch.isfinite(f).all()) for f in result.final_phis[i])
    if not trains:
        return
    final, first = result.history[-1], result.history[0]
    assert final.per_peer_bpb is not None and len(final.per_peer_bpb) == honest
    assert all(math.isfinite(x) and x < first.loss_bpb for x in final.per_peer_bpb), (final, first)


def test_a_huge_gradient_with_a_huge_token_claim_is_capped_and_clipped(corpus):
    """±3e38 in every value with a claim of 1e30 tokens: the owners cap the weight and clip the norm
    to 3x the piece's median, so the honest peers train on (their loss falls below φ_0's)."""
    _held(_run(corpus, "huge"), PEERS - 1)


def test_an_owners_means_of_1e30_on_small_pieces_are_refused(corpus):
    """As the owner of RMSNorm gains (under 256 values) the attacker sends 1e30: the receivers'
    norm bound refuses every such mean (applied as zeros, the same on every honest peer), so the
    honest peers stay finite and hold one φ."""
    result = _run(corpus, "owner-huge-small", malicious=(1,))
    _held(result, PEERS - 1)
    assert result.screening["forged_means"] > 0
    assert result.screening["rounds_with_refused_means"] > 0  # the forged means reached receivers and were refused
    honest = [result.final_phis[i] for i in result.honest]
    assert all(torch.equal(x, y) for phi in honest[1:] for x, y in zip(phi, honest[0], strict=True))


@pytest.mark.parametrize("attack", ["subclip-flip", "subclip-sideways"])
def test_a_sub_clip_contribution_with_flipped_owner_means_leaves_every_honest_phi_finite(corpus, attack):
    """Contributions at 2.5× the norm (under the 3× clip), flipped (the owners' direction screen,
    peer/sync/robust.py, leaves them out) or at cosine 0.1 with the attacker's own Δ (over that
    screen), and −2.5× owner means (inside the 3× bound; the receivers refuse them). What holds: no
    honest loop fails or turns non-finite, and the honest peers keep one φ."""
    result = _run(corpus, attack)
    _held(result, PEERS - 1, trains=False)
    honest = [result.final_phis[i] for i in result.honest]
    assert all(torch.equal(x, y) for phi in honest[1:] for x, y in zip(phi, honest[0], strict=True))


def test_a_flipping_owner_costs_one_rounds_pieces_then_owns_nothing(corpus):
    """As an owner the attacker sends −(the mean): every honest receiver's direction check refuses
    it, their receipts' votes skip its pieces for every peer in that round, and from the next round
    half the group names it in its gathered distrust list, so it owns no piece: its forged means
    reach receivers in the first round only, and the honest peers train on with one φ."""
    result = _run(corpus, "owner-flip", malicious=(1,))
    _held(result, PEERS - 1)
    assert result.screening["rounds_with_refused_means"] == PEERS - 1  # the first round, each honest peer
    honest = [result.final_phis[i] for i in result.honest]
    assert all(torch.equal(x, y) for phi in honest[1:] for x, y in zip(phi, honest[0], strict=True))


def test_noloco_phi_at_cosine_0_3_and_owner_means_at_0_72_leave_every_honest_phi_finite(corpus):
    """NoLoCo: φ sent at cosine 0.3 (over the owners' 0.2 floor) and φ means at cosine 0.72 (over the
    receivers' 0.7): inside both bounds; no honest loop fails, none turns non-finite."""
    _held(_run(corpus, "cosine", algorithm="noloco"), PEERS - 1)


def test_an_equivocating_owner_is_skipped_and_the_honest_phi_stay_one(corpus):
    """Each receiver gets a mean differing by 1e-5 in one value: every mean passes the receivers'
    checks, but their receipts' digests differ (the hub mirrors peer/sync/receipts.py), so every peer
    skips that owner's pieces and then names it: the honest φ stay bit-identical."""
    result = _run(corpus, "owner-equivocate", malicious=(1,))
    _held(result, PEERS - 1)
    honest = [result.final_phis[i] for i in result.honest]
    assert all(torch.equal(x, y) for phi in honest[1:] for x, y in zip(phi, honest[0], strict=True))
    assert EQUIVOCATION_STEP > 0  # the forged means did differ


@pytest.mark.parametrize("attack, malicious", [("fake-progress", (3,)), ("tie-break", (2, 3))])
def test_forged_states_in_the_records_are_not_adopted(corpus, attack, malicious):
    """fake-progress (records of the next round naming an all-zero state, from the malicious peer and
    4 fresh identities) and the tie-break takeover (equivocating means split the honest peers into
    classes of one; two malicious peers publish −φ ground to a small digest): no honest peer adopts
    a forged state."""
    result = _run(corpus, attack, malicious=malicious, fresh_identities=4 if attack == "fake-progress" else 0)
    _held(result, PEERS - len(malicious))
    assert result.screening["forged_states"] > 0  # the forged records were published
    assert result.takeovers == 0


@pytest.mark.parametrize("attack", ["alie", "ipm"])
def test_alie_and_ipm_from_one_of_four_leave_every_honest_phi_finite_and_training(corpus, attack):
    """One malicious peer of four sends ALIE's μ − z·σ (σ = |μ|, at 2.5x its norm) or IPM's −0.5x its
    Δ, claiming 1e30 tokens: the honest peers finish, stay finite and train. (Two colluders of four
    sending IPM's vector leave every honest φ where it started: every piece's mean is zero, each
    round's Δ carried into the next; bench/byzantine.py's ipm row with 2 of 8: +12.7 %. Issue #65.)"""
    _held(_run(corpus, attack, malicious=(3,)), PEERS - 1)
