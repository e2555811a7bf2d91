"""Issue 17, item 4: a groupmate's lies about its weight or its pseudo-gradient cannot steer φ.

Honest owners (0..k-1) reduce every piece; the attacker (the last peer) is in client mode, so what
is checked is what honest owners make of its contribution. Every honest peer must still end with
bit-identical tensors.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.state.snapshot import make_snapshot
from peer.sync.screening import CLIP_MEDIAN_FACTOR, Strikes
from peer.train.outer import DiLoCo
from protocol.manifest import OuterOptimizerSpec
from tests.security.group import run_group

SHAPES = [torch.Size([64, 32]), torch.Size([32])]
ROUND_TOKENS = 1024
"""The run's H × batch_size_tokens in these tests: the most one contribution may weigh."""

pytestmark = pytest.mark.timeout(60)


def _honest(n: int, seed: int) -> list[list[torch.Tensor]]:
    """Pseudo-gradients of ``n`` honest peers: one shared direction plus each peer's own noise."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + 0.3 * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES)] for _ in range(n)]


def _weighted_mean(payloads, weights):
    total = sum(weights)
    return [sum(p[k] * (w / total) for p, w in zip(payloads, weights)) for k in range(len(SHAPES))]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _honest_results(sessions, outcomes, honest: int):
    for outcome in outcomes[:honest]:
        assert not isinstance(outcome, BaseException), outcome
    first = sessions[0].tensors
    for s in sessions[1:honest]:
        for got, want in zip(s.tensors, first):
            assert torch.equal(got, want)  # bit-identical on every honest peer
    return first


def test_a_groupmate_claiming_1e30_tokens_no_longer_sets_phi():
    honest = _honest(3, seed=1)
    weights = [1000.0, 900.0, 1024.0]
    attacker = [torch.zeros(s) for s in SHAPES]  # it wants φ to stand still (or anywhere it likes)
    sessions, outcomes = asyncio.run(
        run_group(honest + [attacker], weights + [1e30], owners=[0, 1, 2], max_weight=ROUND_TOKENS)
    )
    got = _honest_results(sessions, outcomes, 3)
    # the attacker weighs what a full round weighs, no more; CenteredClip (peer/sync/robust.py) then
    # pulls the mean further toward the honest one than that capped weighted mean lies
    capped = _flat(_weighted_mean(honest + [attacker], weights + [float(ROUND_TOKENS)]))
    honest_mean = _flat(_weighted_mean(honest, weights))
    assert (_flat(got) - honest_mean).norm() <= (capped - honest_mean).norm() * (1 + 1e-5)
    assert _flat(got).norm() > 0.5 * honest_mean.norm()
    for outcome in outcomes[:3]:
        assert outcome.capped_weights == {3: 1e30}


def test_a_sign_flipped_x100_pseudo_gradient_is_clipped():
    honest = _honest(4, seed=2)
    weights = [1000.0] * 4
    honest_mean = _weighted_mean(honest, weights)
    attacker = [-100.0 * m for m in honest_mean]
    sessions, outcomes = asyncio.run(
        run_group(honest + [attacker], weights + [1000.0], owners=[0, 1, 2, 3], max_weight=ROUND_TOKENS)
    )
    got = _flat(_honest_results(sessions, outcomes, 4))
    want = _flat(honest_mean)
    # still a step the honest peers' way, and no longer than theirs
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.5
    assert got.norm() <= want.norm()
    pieces = len(sessions[0].plan.pieces)
    assert sum(o.clipped.get(4, 0) for o in outcomes[:4]) == pieces
    assert all(set(o.clipped) <= {4} for o in outcomes[:4])  # no honest contribution was touched


def test_a_partner_of_two_is_bounded_by_the_smaller_norm():
    """NoLoCo's partner average runs through the same all-reduce, in groups of two."""
    [honest] = _honest(1, seed=3)
    attacker = [-100.0 * t for t in honest]
    sessions, outcomes = asyncio.run(
        run_group([honest, attacker], [1000.0, 1000.0], owners=[0], max_weight=ROUND_TOKENS)
    )
    got = _flat(_honest_results(sessions, outcomes, 1))
    # each contribution is at most CLIP_MEDIAN_FACTOR × the smaller norm: the mean at most half of (1 + factor)
    bound = (1 + CLIP_MEDIAN_FACTOR) / 2 * _flat(honest).norm()
    assert got.norm() <= bound * (1 + 1e-5)
    assert outcomes[0].clipped == {1: len(sessions[0].plan.pieces)}


def test_huge_finite_values_neither_crash_nor_poison():
    honest = _honest(3, seed=4)
    weights = [1000.0] * 3
    attacker = [torch.full(s, 3e38) for s in SHAPES]
    sessions, outcomes = asyncio.run(
        run_group(honest + [attacker], weights + [1e30], owners=[0, 1, 2], max_weight=ROUND_TOKENS)
    )
    mean = _honest_results(sessions, outcomes, 3)
    assert all(torch.isfinite(t).all() for t in mean)
    biggest = max(float(t.abs().max()) for p in honest for t in p)
    assert max(float(t.abs().max()) for t in mean) <= CLIP_MEDIAN_FACTOR * biggest * _flat(mean).numel() ** 0.5
    # the outer step applies the mean, and the state it leaves can be served to joiners
    phi = [torch.zeros(s) for s in SHAPES]
    outer = DiLoCo(SHAPES, OuterOptimizerSpec())
    outer.apply(phi, mean)
    make_snapshot({"run_id": "r", "round": 1, "inner_step": 4}, phi + outer.state_tensors())


def _offenders(outcome) -> set[int]:
    return set(outcome.clipped) | outcome.dropped


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attack", ["sign-flipped x100", "huge values"])
def test_a_groupmate_clipped_or_dropped_repeatedly_is_ignored_for_a_while(attack):
    """Issue 17, item 4: what each honest owner does with peer/sync/screening.py ``Strikes`` (as the
    averager does after every session): after 3 rounds of strikes the attacker is left out."""
    honest = _honest(3, seed=5)
    weights = [1000.0] * 3
    honest_mean = _weighted_mean(honest, weights)
    attacker = (
        [-100.0 * m for m in honest_mean] if attack == "sign-flipped x100" else [torch.full(s, 3e38) for s in SHAPES]
    )
    strikes = [Strikes(strikes=3, window_rounds=10, ignore_rounds=2) for _ in range(3)]  # one per honest peer
    ignored_at = []
    for round_ in range(6):
        ignored = [s.ignored(round_) for s in strikes]
        assert ignored[0] == ignored[1] == ignored[2]  # the same rule on the same evidence
        ignored_at.append(sorted(ignored[0]))
        sessions, outcomes = asyncio.run(
            run_group(
                honest + [attacker],
                weights + [1000.0],
                owners=[0, 1, 2],
                max_weight=ROUND_TOKENS,
                ignored=frozenset(ignored[0]),
                timeout=10.0,
            )
        )  # a loaded machine is no groupmate failure
        got = _honest_results(sessions, outcomes, 3)
        if ignored[0]:  # left out by every owner: the honest mean, exactly
            for g, w in zip(got, honest_mean):
                torch.testing.assert_close(g, w)
            assert all(not _offenders(o) for o in outcomes[:3])  # an ignored peer earns no new strike
        else:
            assert all(_offenders(o) == {3} for o in outcomes[:3])
        for s, outcome in zip(strikes, outcomes[:3]):
            s.record(round_, _offenders(outcome))
    # struck at rounds 0, 1, 2; ignored at 3 and 4; back at 5 (and struck again)
    assert ignored_at == [[], [], [], [3], [3], []]


def test_strikes_count_rounds_in_a_window_and_expire():
    strikes = Strikes(strikes=3, window_rounds=4, ignore_rounds=10)
    assert strikes.record(0, ["p"]) == [] and strikes.record(0, ["p"]) == []  # a retry of the round: one strike
    assert strikes.record(3, ["p"]) == []
    assert strikes.record(4, ["p"]) == []  # round 0 has left the window of rounds 1..4
    assert strikes.record(5, ["p"]) == ["p"] and strikes.is_ignored("p", 15) and not strikes.is_ignored("p", 16)
    assert strikes.ignored(15) == {"p"} and strikes.ignored(16) == set()
    with pytest.raises(ValueError, match="strikes"):
        Strikes(strikes=5, window_rounds=4)


def test_a_sub_clip_sign_flip_is_taken_out_by_the_owners_centered_clip():
    """−2.5× the honest mean passes the median-norm clip (3×); CenteredClip (peer/sync/robust.py)
    bounds its pull by the honest spread: the group's step stays near the honest mean, where the
    plain mean of 4 honest and 1 flipped contribution would shrink it to about a quarter."""
    honest = _honest(4, seed=3)
    weights = [1000.0] * 4
    honest_mean = _weighted_mean(honest, weights)
    attacker = [-2.5 * m for m in honest_mean]
    sessions, outcomes = asyncio.run(
        run_group(honest + [attacker], weights + [1000.0], owners=[0, 1, 2, 3], max_weight=ROUND_TOKENS)
    )
    got, want = _flat(_honest_results(sessions, outcomes, 4)), _flat(honest_mean)
    plain = _flat(_weighted_mean(honest + [attacker], weights + [1000.0]))
    assert (got - want).norm() < 0.5 * (plain - want).norm()
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9
