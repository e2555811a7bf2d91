"""peer.sync.screening: the weight cap and the clip to the median norm, rule by rule."""

from __future__ import annotations

import torch

from peer.sync.screening import CLIP_MEDIAN_FACTOR, cap_weight, clip_to_median, median_norm, norm, round_token_cap
from protocol.manifest import RunManifest


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
