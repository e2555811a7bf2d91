"""peer/sync/robust.py: CenteredClip on synthetic contributions (issue #51, item 4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from peer.sync.robust import (
    CENTERED_CLIP_MIN_ELEMENTS,
    CENTERED_CLIP_MIN_PARTS,
    SIMILARITY_MIN_ELEMENTS,
    centered_clip,
    direction_screened,
    piece_mean,
    similarity_weighted,
    trimmed_length,
    weighted_sum,
)
from peer.sync.screening import clip_to_median


def _honest(n: int, size: int, seed: int, spread: float = 0.3) -> list[torch.Tensor]:
    """Pseudo-gradients of one model from one φ: a common direction plus per-peer noise."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=gen)
    return [common + spread * torch.randn(size, generator=gen) for _ in range(n)]


def test_centered_clip_is_the_plain_weighted_mean_when_nothing_is_out_of_line():
    xs = _honest(8, 4096, seed=0, spread=0.05)
    parts = [(float(100 + i), x) for i, x in enumerate(xs)]
    mean, clipped = centered_clip(parts)
    assert clipped == []
    assert torch.equal(mean, weighted_sum(parts))  # the same bits as the plain mean


def test_centered_clip_clips_only_the_outlier_and_bounds_its_pull():
    xs = _honest(8, 4096, seed=1)
    honest_mean = weighted_sum([(1.0, x) for x in xs[:7]])
    bad = -3.0 * xs[7]  # a flipped contribution at 3x the norm: what the median-norm clip lets through
    mean, clipped = centered_clip([(1.0, x) for x in [*xs[:7], bad]])
    assert 7 in clipped
    plain = weighted_sum([(1.0, x) for x in [*xs[:7], bad]])
    err, plain_err = float((mean - honest_mean).norm()), float((plain - honest_mean).norm())
    assert err < 0.25 * plain_err, (err, plain_err)
    assert err < 0.1 * float(honest_mean.norm())


def test_centered_clip_leaves_tiny_pieces_and_groups_under_4_to_the_plain_mean():
    small = [(1.0, torch.tensor([1.0, 2.0 + k / 10])) for k in range(4)] + [(1.0, torch.tensor([-50.0, 9.0]))]
    assert small[0][1].numel() < CENTERED_CLIP_MIN_ELEMENTS and len(small) >= CENTERED_CLIP_MIN_PARTS
    assert torch.equal(centered_clip(small)[0], weighted_sum(small))
    three = [(1.0, x) for x in _honest(2, 64, seed=2)] + [(1.0, torch.full((64,), 100.0))]
    assert torch.equal(centered_clip(three)[0], weighted_sum(three))


def test_centered_clip_refuses_bad_settings():
    parts = [(1.0, x) for x in _honest(4, 64, seed=3)]
    with pytest.raises(ValueError, match="tau_factor"):
        centered_clip(parts, tau_factor=0.0)
    with pytest.raises(ValueError, match="iterations"):
        centered_clip(parts, iterations=0)


contributions = st.integers(min_value=0, max_value=10_000)


@settings(max_examples=25, deadline=None)
@given(seed=contributions, attackers=st.sampled_from([1, 2]), scale=st.sampled_from([-100.0, -3.0, 0.0, 3.0]))
def test_centered_clip_bounds_one_or_two_attackers_of_eight(seed, attackers, scale):
    """Whatever 1 or 2 of 8 send (a multiple of an honest contribution, zeros, or noise of 3x the
    honest norm once ``scale`` is 3), after the median-norm clip the result stays within a fraction of
    the honest spread of the honest mean, where the plain mean moves by up to 3x its norm × their share."""
    xs = _honest(8, 1024, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    bad = [scale * torch.randn(1024, generator=gen) if scale == 3.0 else scale * xs[7 - k] for k in range(attackers)]
    sent = [*xs[: 8 - attackers], *bad]
    clipped_parts, _ = clip_to_median([(1.0, x) for x in sent])
    honest_mean = weighted_sum([(1.0, x) for x in xs[: 8 - attackers]])
    spread = sorted(float((x - honest_mean).norm()) for x in xs[: 8 - attackers])[(8 - attackers) // 2]
    mean, _ = centered_clip(clipped_parts)
    assert torch.isfinite(mean).all()
    # each attacker pulls at most about τ (2x the median distance) times its weight share
    assert float((mean - honest_mean).norm()) <= 2.0 * spread * attackers / (8 - attackers) + 0.25 * spread


@settings(max_examples=15, deadline=None)
@given(seed=contributions)
def test_centered_clip_is_deterministic(seed):
    xs = _honest(8, 300, seed=seed, spread=1.0)
    xs[3] = -10 * xs[3]
    parts = [(float(50 + 7 * i), x) for i, x in enumerate(xs)]
    a, clipped = centered_clip(parts)
    b, _ = centered_clip([(w, x.clone()) for w, x in parts])
    assert torch.equal(a, b) and 3 in clipped


# the step's length (issue #65: Inner Product Manipulation)


def _along(mean: torch.Tensor, honest_mean: torch.Tensor) -> float:
    """The projection of ``mean`` on the honest mean, as a share of the honest mean's length."""
    return float(torch.dot(mean.double(), honest_mean.double()) / honest_mean.double().norm() ** 2)


@settings(max_examples=25, deadline=None)
@given(seed=contributions, attackers=st.sampled_from([1, 2]), epsilon=st.sampled_from([0.0, 0.5, 1.0]))
def test_ipm_and_zeros_no_longer_shorten_the_step(seed, attackers, epsilon):
    """1 or 2 of 8 send −ε × their own honest mean (IPM, arXiv 1903.03936; ε = 0: zeros): close to the
    centre, never clipped, so the plain mean and CenteredClip keep only (8 − (1 + ε) × attackers) / 8
    of the honest step; the trimmed length keeps it to within the honest projections' spread."""
    xs = _honest(8, 1024, seed=seed, spread=0.3)
    own = weighted_sum([(1.0, x) for x in xs[8 - attackers :]])
    sent = [*xs[: 8 - attackers], *[-epsilon * own] * attackers]
    parts = [(1.0, x) for x in sent]
    honest_mean = weighted_sum([(1.0, x) for x in xs[: 8 - attackers]])
    shortened = _along(centered_clip(clip_to_median(parts)[0])[0], honest_mean)
    assert shortened < 0.95  # the attack the check below must catch
    mean, _ = piece_mean(parts)
    assert 0.95 < _along(mean, honest_mean) < 1.05


@settings(max_examples=25, deadline=None)
@given(seed=contributions)
def test_a_clean_group_keeps_its_step(seed):
    """Honest contributions only: the trimmed length is the plain mean's to a few per cent, its
    direction exactly CenteredClip's."""
    parts = [(1.0, x) for x in _honest(8, 1024, seed=seed, spread=0.3)]
    plain = weighted_sum(parts)
    mean, _ = piece_mean(parts)
    ratio = float(mean.double().norm() / plain.double().norm())
    assert 0.97 < ratio < 1.03
    assert float(torch.nn.functional.cosine_similarity(mean.double(), plain.double(), dim=0)) > 1 - 1e-6


def test_stretching_is_trimmed_too_and_late_joiners_rank_by_their_tokens():
    xs = _honest(8, 1024, seed=7, spread=0.3)
    honest_mean = weighted_sum([(1.0, x) for x in xs[:6]])
    stretched = [(1.0, x) for x in [*xs[:6], 2.5 * honest_mean, 2.5 * honest_mean]]
    assert 0.95 < _along(piece_mean(stretched)[0], honest_mean) < 1.05
    # a peer that trained half the tokens sends half a Δ at half the weight: the step stays the plain one's
    late = [(1.0, x) for x in xs[:7]] + [(0.5, 0.5 * xs[7])]
    centre = centered_clip(late)[0]
    plain = weighted_sum(late)
    assert 0.95 < float(trimmed_length(late, centre).double().norm() / plain.double().norm()) < 1.05


def test_trimmed_length_leaves_small_groups_pieces_and_a_zero_centre_alone():
    xs = _honest(8, 1024, seed=3)
    three = [(1.0, x) for x in xs[:3]]
    centre = weighted_sum(three)
    assert trimmed_length(three, centre) is centre  # fewer than 4: nothing to trim
    tiny = [(1.0, x[: CENTERED_CLIP_MIN_ELEMENTS - 1]) for x in xs]
    centre = weighted_sum(tiny)
    assert trimmed_length(tiny, centre) is centre
    zero = torch.zeros(1024)
    assert trimmed_length([(1.0, x) for x in xs], zero) is zero
    with pytest.raises(ValueError, match="trim_fraction = 0.5"):
        trimmed_length([(1.0, x) for x in xs], weighted_sum([(1.0, x) for x in xs]), trim_fraction=0.5)


# colluders that pull the same way (issue #65: "A Little Is Enough" with two colluders)


def test_one_vector_sent_twice_is_left_out_and_honest_weights_stay():
    xs = _honest(8, 4096, seed=11, spread=0.3)
    honest = [(float(100 + i), x) for i, x in enumerate(xs[:6])]
    forged = weighted_sum(honest[:2]) - 2.0 * torch.ones(4096)
    parts = [*honest, (100.0, forged), (100.0, forged.clone())]
    kept = similarity_weighted(parts)
    assert [w for w, _ in kept] == [w for w, _ in honest]  # nearly orthogonal deviations: untouched
    assert all(a is b for (_, a), (_, b) in zip(kept, honest, strict=True))
    # a clean group: the same parts, the same weights
    assert similarity_weighted(honest) == honest


def test_colluders_under_kappa_keep_their_weight_and_above_it_lose_it():
    xs = _honest(8, 4096, seed=12, spread=0.3)
    gen = torch.Generator().manual_seed(0)
    mu = weighted_sum([(1.0, x) for x in xs])
    shift = torch.randn(4096, generator=gen)
    for cosine, weighed_down in ((0.2, False), (0.8, True)):
        a, b = (mu + cosine**0.5 * shift + (1 - cosine) ** 0.5 * torch.randn(4096, generator=gen) for _ in range(2))
        parts = [(1.0, x) for x in xs[:6]] + [(1.0, a), (1.0, b)]
        weights = [w for w, _ in similarity_weighted(parts)]
        assert len(weights) == 8
        assert (weights[-1] < 0.5) == weighed_down and (weights[-2] < 0.5) == weighed_down


def test_similarity_leaves_small_groups_small_pieces_and_all_alike_groups_alone():
    xs = _honest(8, 4096, seed=13)
    three = [(1.0, xs[0]), (1.0, xs[1]), (1.0, xs[0])]
    assert similarity_weighted(three) == three  # under 4: nothing to judge
    small = [(1.0, x[: SIMILARITY_MIN_ELEMENTS - 1]) for x in xs]
    small[1] = small[0]
    assert similarity_weighted(small) == small
    pairs = [(1.0, x) for x in xs[:4]] * 2  # everyone has a twin: no majority to judge by
    assert similarity_weighted(pairs) == pairs
    with pytest.raises(ValueError, match="kappa = 1"):
        similarity_weighted(pairs, kappa=1.0)


@settings(max_examples=15, deadline=None)
@given(seed=contributions)
def test_two_colluders_sending_one_vector_pull_no_more_than_one(seed):
    """ALIE's shape (arXiv 1902.06156): both colluders send one vector far off along the honest
    spread; CenteredClip alone lets the pair pull twice as far as one such vector."""
    xs = _honest(8, 4096, seed=seed, spread=0.3)
    honest_mean = weighted_sum([(1.0, x) for x in xs[:6]])
    forged = honest_mean - 3.0 * (xs[0] - honest_mean)
    one = [(1.0, x) for x in xs[:7]] + [(1.0, forged)]
    two = [(1.0, x) for x in xs[:6]] + [(1.0, forged), (1.0, forged.clone())]
    pull_one = float((piece_mean(one)[0] - honest_mean).norm())
    pull_two_clip = float((centered_clip(clip_to_median(two)[0])[0] - honest_mean).norm())
    pull_two = float((piece_mean(two)[0] - honest_mean).norm())
    assert pull_two_clip > 1.5 * pull_one  # the attack: two clipped at τ pull about twice as far
    assert pull_two <= 1.1 * pull_one


# one contribution flipped under the clip (issue #65's subclip-flip)


def test_a_contribution_pointing_against_the_group_is_left_out():
    xs = _honest(8, 4096, seed=21, spread=0.5)
    honest = [(float(100 + i), x) for i, x in enumerate(xs[:7])]
    flipped = (100.0, -2.5 * xs[7])
    kept = direction_screened([*honest, flipped])
    assert len(kept) == 7 and all(a is b for (_, a), (_, b) in zip(kept, honest, strict=True))
    assert direction_screened(honest) == honest  # a clean group: nothing left out, the same bits after
    honest_mean = weighted_sum(honest)
    cos = torch.nn.functional.cosine_similarity
    screened = piece_mean([*honest, flipped])[0]
    unscreened = trimmed_length([*honest, flipped], centered_clip(clip_to_median([*honest, flipped])[0])[0])
    assert float(cos(screened, honest_mean, dim=0)) > 0.999
    assert float(cos(unscreened, honest_mean, dim=0)) < float(cos(screened, honest_mean, dim=0))
    sideways = (100.0, xs[7] - (xs[7] @ honest_mean) / (honest_mean @ honest_mean) * honest_mean)
    assert len(direction_screened([*honest, sideways])) == 8  # orthogonal passes: CenteredClip bounds it


def test_the_direction_screen_needs_a_majority_and_leaves_small_groups_alone():
    xs = _honest(8, 64, seed=22, spread=0.3)
    three = [(1.0, xs[0]), (1.0, xs[1]), (1.0, -xs[2])]
    assert direction_screened(three) == three  # under 4: no majority to judge a direction by
    tiny = [(1.0, x[: CENTERED_CLIP_MIN_ELEMENTS - 1]) for x in xs[:7]] + [
        (1.0, -xs[7][: CENTERED_CLIP_MIN_ELEMENTS - 1])
    ]
    assert direction_screened(tiny) == tiny
    small = [(1.0, x) for x in xs[:7]] + [(1.0, -2.5 * xs[7])]
    assert len(direction_screened(small)) == 7  # the norm gains' pieces are judged too
    zeros = [(1.0, torch.zeros(64)) for _ in range(5)] + [(1.0, x) for x in xs[:3]]
    assert direction_screened(zeros) == zeros  # a median of norm 0: no direction
    with pytest.raises(ValueError, match="min_cosine = 1"):
        direction_screened(small, min_cosine=1.0)


def test_the_sideways_attack_passes_the_direction_screen_at_the_clips_norm():
    """lab/adversary.py ``subclip-sideways`` is written as the strongest contribution the screen lets
    through: 1.45× its honest payload's norm (under the 1.5× median clip), at cosine 0.1 with it."""
    from lab.adversary import SIDEWAYS_COSINE, SUBCLIP_FACTOR, Adversary

    xs = _honest(8, 4096, seed=23, spread=0.5)
    forged = Adversary(attack="subclip-sideways", peers=(7,)).forge([xs[7]], torch.Generator().manual_seed(0))[0]
    assert float(forged.norm()) == pytest.approx(abs(SUBCLIP_FACTOR) * float(xs[7].norm()), rel=1e-5)
    assert float(torch.nn.functional.cosine_similarity(forged, xs[7], dim=0)) == pytest.approx(
        SIDEWAYS_COSINE, abs=1e-5
    )
    parts = [(1.0, x) for x in xs[:7]] + [(1.0, forged)]
    assert len(direction_screened(parts)) == 8
    flipped = Adversary(attack="subclip-flip", peers=(7,)).forge([xs[7]], torch.Generator().manual_seed(0))[0]
    assert len(direction_screened([*parts[:7], (1.0, flipped)])) == 7


@pytest.mark.parametrize("case", ["clean", "flipped", "twice"])
def test_piece_mean_computes_the_median_once_and_gives_the_same_bits(case):
    """piece_mean hands its one coordinate-wise median to each rule; each rule computing its own
    gives the same bits (the median ignores weights, and is recomputed once a part is left out)."""
    xs = _honest(8, 4096, seed=24, spread=0.5)
    parts = [(float(100 + i), x) for i, x in enumerate(xs[:6])]
    if case == "flipped":
        parts += [(100.0, -2.5 * xs[6]), (100.0, xs[7])]
    elif case == "twice":
        parts += [(100.0, 3.0 * xs[6]), (100.0, 3.0 * xs[6].clone())]
    else:
        parts += [(100.0, xs[6]), (100.0, xs[7])]
    clipped_parts, _ = clip_to_median(parts)
    weighted = similarity_weighted(direction_screened(clipped_parts))
    expected = trimmed_length(weighted, centered_clip(weighted)[0])
    assert torch.equal(piece_mean(parts)[0], expected)
