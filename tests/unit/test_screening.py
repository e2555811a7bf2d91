"""peer.sync.screening: the weight cap and the clip to the median norm, rule by rule."""

from __future__ import annotations

import pickle

import pytest
import torch

import peer.sync.screening as screening_module
from peer.sync.screening import (
    CLIP_MEDIAN_FACTOR,
    OWNER_CHECK_MIN_ELEMENTS,
    cap_weight,
    clip_to_median,
    median_norm,
    norm,
    owner_mean_problem,
    phi_contribution_problem,
    round_token_cap,
    share_floor,
)
from protocol.manifest import RunManifest


@pytest.fixture(autouse=True)
def share_check_on(monkeypatch):
    """The receivers' share check is off by default (peer/sync/screening.py OWNER_SHARE_CHECK):
    these tests test it, so they turn it on."""
    monkeypatch.setattr(screening_module, "OWNER_SHARE_CHECK", True)


def test_weight_cap_is_h_times_batch_tokens():
    manifest = RunManifest().replace(sync={"inner_steps": 7})
    cap = round_token_cap(manifest)
    assert cap == 7 * manifest.inner_optimizer.batch_size_tokens
    assert cap_weight(1e30, cap) == cap and cap_weight(cap - 1.0, cap) == cap - 1.0
    assert cap_weight(1e30, None) == 1e30


def test_lower_median_takes_the_smaller_of_two():
    assert median_norm([5.0, 1.0]) == 1.0
    assert median_norm([3.0, 1.0, 2.0]) == 2.0
    assert median_norm([4.0, 1.0, 3.0, 2.0]) == 2.0


def test_nothing_above_the_threshold_leaves_the_very_same_tensors():
    parts = [(1.0, torch.full((4,), v)) for v in (1.0, 2.0, 2.9)]
    out, clipped = clip_to_median(parts)
    assert clipped == [] and all(a[1] is b[1] for a, b in zip(parts, out))


def test_an_outlier_is_scaled_to_the_threshold_in_its_own_direction():
    x = torch.tensor([3e38, -3e38, 3e38])
    parts = [(1.0, torch.ones(3)), (1.0, 2 * torch.ones(3)), (5.0, x)]
    out, clipped = clip_to_median(parts)
    assert clipped == [2] and out[2][0] == 5.0
    assert torch.isfinite(out[2][1]).all()
    # references scale each norm to the heaviest weight (5): the lower median is 2·√3 × 5 / 1
    assert abs(norm(out[2][1]) - CLIP_MEDIAN_FACTOR * norm(2 * torch.ones(3)) * 5.0) < 1e-3
    assert torch.equal(torch.sign(out[2][1]), torch.sign(x))


def test_a_zero_median_gives_no_scale_to_clip_to():
    parts = [(1.0, torch.zeros(3)), (1.0, torch.zeros(3)), (1.0, torch.ones(3))]
    out, clipped = clip_to_median(parts)
    assert clipped == [] and out[2][1] is parts[2][1]


def test_a_mid_round_joiner_does_not_get_its_full_round_groupmate_clipped():
    # a joiner that trained 2 of 30 steps has a short Δ; its groupmate's full-round Δ is honest
    full, joiner = 30 * 512.0, 2 * 512.0
    parts = [(full, torch.full((8,), 1.0)), (joiner, torch.full((8,), 0.1))]
    out, clipped = clip_to_median(parts)
    assert clipped == [] and all(a[1] is b[1] for a, b in zip(parts, out))
    # ... while a full-weight groupmate ten times longer than its peer still is clipped
    out, clipped = clip_to_median([(full, torch.full((8,), 1.0)), (full, torch.full((8,), 10.0))])
    assert clipped == [1] and abs(norm(out[1][1]) - CLIP_MEDIAN_FACTOR * norm(torch.full((8,), 1.0))) < 1e-4


def _group(n, seed, spread=0.5, size=1024):
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=gen)
    return [common + spread * torch.randn(size, generator=gen) for _ in range(n)]


def test_share_floor_counts_every_other_weight_at_the_cap():
    assert share_floor(100.0, 4, 100.0) == 0.25
    assert share_floor(50.0, 2, 100.0) == 50.0 / 150.0
    assert share_floor(1e30, 2, 100.0) == 0.5  # a claim over the cap counts as the cap
    assert share_floor(100.0, 4, None) is None


def test_an_honest_mean_passes_for_every_member_even_a_short_round():
    xs = _group(6, 0)
    weights = [100.0] * 5 + [5.0]  # the last joined late: a short Δ
    xs[5] = xs[5] * 0.05
    total = sum(weights)
    mean = sum(x * (w / total) for x, w in zip(xs, weights))
    for x, w in zip(xs, weights):
        assert owner_mean_problem(mean, x, weight=w, included=6, max_weight=100.0) is None


def test_forged_means_are_refused_with_a_reason():
    xs = _group(4, 1)
    mean = sum(xs) / 4
    x = xs[0]
    gen = torch.Generator().manual_seed(9)
    for forged, words in (
        (-mean, "does not hold"),
        (100 * mean, "exceeds"),
        (torch.zeros_like(mean), "does not hold"),
        (torch.randn(mean.shape, generator=gen) * norm(mean) / mean.numel() ** 0.5, "does not hold"),
    ):
        problem = owner_mean_problem(forged, x, weight=100.0, included=4, max_weight=100.0)
        assert problem is not None and words in problem
        # only the norm check counts a strike: an honest owner can fail the share check under attack
        assert problem.strike == (words == "exceeds")
        again = pickle.loads(pickle.dumps(problem))  # all-reduce stats cross process pipes
        assert again == problem and again.strike == problem.strike
    # a mean that leaves this receiver out need not hold its contribution: norm check only
    assert owner_mean_problem(-mean, x, weight=100.0, included=4, max_weight=100.0, included_self=False) is None
    assert owner_mean_problem(100 * mean, x, weight=100.0, included=4, max_weight=100.0, included_self=False)


def test_phi_pieces_may_drift_apart_but_not_toward_zero():
    gen = torch.Generator().manual_seed(2)
    phi = torch.randn(1024, generator=gen)
    # honest partners that had not met for rounds: as far apart as ‖φ‖ (cosine 0.5), same norm
    partner = 0.5 * phi + 0.75**0.5 * phi.norm() * torch.nn.functional.normalize(
        torch.randn(1024, generator=gen), dim=0
    )
    assert phi_contribution_problem(partner, phi) is None
    assert owner_mean_problem((phi + partner) / 2, phi, weight=1.0, included=2, max_weight=1.0, phi=True) is None
    pulled = (phi + torch.zeros_like(phi)) / 2  # a partner that sends φ = 0
    drifted = owner_mean_problem(pulled, phi, weight=1.0, included=2, max_weight=1.0, phi=True)
    assert "its norm is 0.5x this peer's φ's" in drifted and drifted.strike
    assert owner_mean_problem(-phi, phi, weight=1.0, included=2, max_weight=1.0, phi=True)
    assert "outside [0.5, 2]" in phi_contribution_problem(3 * phi, phi)
    assert "outside [0.5, 2]" in phi_contribution_problem(0.3 * phi, phi)


def test_a_phi_of_zero_or_of_another_model_is_refused():
    """φ = 0, another model's φ and a flipped φ are left out by the owner, and a mean pulled halfway
    toward them is refused by the receiver."""
    gen = torch.Generator().manual_seed(4)
    phi = torch.randn(1024, generator=gen)
    for forged in (torch.zeros_like(phi), torch.randn(1024, generator=gen), -phi):
        assert "cosine" in phi_contribution_problem(forged, phi)
        refused = owner_mean_problem((phi + forged) / 2, phi, weight=1.0, included=2, max_weight=1.0, phi=True)
        assert refused is not None and refused.strike and "below 0.7" in refused


def test_small_pieces_and_zero_contributions_get_only_the_norm_bound():
    """Under OWNER_CHECK_MIN_ELEMENTS values only a (looser) norm bound applies: a flipped mean of
    honest size passes, a huge one does not (issue #51). A zero contribution is judged only against
    the floor from the receiver's payload RMS; without one (no reference) it is not judged."""
    small = torch.ones(OWNER_CHECK_MIN_ELEMENTS - 1)
    assert owner_mean_problem(-10 * small, small, weight=1.0, included=2, max_weight=1.0) is None
    assert owner_mean_problem(-1e6 * small, small, weight=1.0, included=2, max_weight=1.0).strike
    zero = torch.zeros(OWNER_CHECK_MIN_ELEMENTS)
    assert owner_mean_problem(torch.ones_like(zero), zero, weight=1.0, included=2, max_weight=1.0) is None
    assert (
        owner_mean_problem(torch.ones_like(zero), zero, weight=1.0, included=2, max_weight=1.0, reference_rms=1.0)
        is None
    )
    assert owner_mean_problem(
        1e3 * torch.ones_like(zero), zero, weight=1.0, included=2, max_weight=1.0, reference_rms=1.0
    ).strike
