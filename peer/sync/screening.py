"""Screening of the contributions an owner of pieces sums (peer/sync/allreduce.py).

A groupmate may lie about its weight and send any finite values. Before an owner sums a piece's
contributions it applies, in this order, two deterministic rules:

1. **Token weight cap.** A contribution's weight is the tokens its sender claims in its HELLO.
   No honest peer trains more than ``H × batch_size_tokens`` tokens in a round (the run
   manifest's ``sync.inner_steps × inner_optimizer.batch_size_tokens``), so a larger claim is cut
   to that cap (logged and counted). Without the cap, one groupmate claiming 1e30 tokens makes
   the weighted mean equal its own payload.
2. **Norm clip to the round's median** (Templar: clip each contribution to a multiple of the
   median norm of the round). Each contribution whose L2 norm exceeds
   :data:`CLIP_MEDIAN_FACTOR` × the median of that piece's *reference norms* is scaled down to
   that norm. A contribution's reference norm is its norm scaled up to the largest weight of the
   piece (norm × w_max / w): a peer that joined mid-round trained fewer tokens and has a shorter
   Δ, which must not drag the threshold down and clip its full-round groupmates (Δ grows at most
   linearly in the steps taken, so the scaled norm over-estimates, i.e. errs toward not
   clipping). The median is the *lower* median: with two contributions, the smaller reference,
   since nothing tells which of two is honest and the smaller one bounds the damage.

Only the owner computes a piece's mean, and every groupmate receives the owner's bytes, so the
groupmates that complete a round still hold bit-identical φ. A contribution below the threshold
is summed exactly as before: a round in which nothing is clipped gives the same bits as without
screening.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

CLIP_MEDIAN_FACTOR = 3.0
"""Contributions are clipped to this multiple of the piece's median contribution norm.

Why 3: peers of one run train the same model with the same optimizer for the same number of
steps on shards of one corpus, so their pseudo-gradients differ in direction far more than in
norm; 3× leaves honest spread alone, while one groupmate can move a mean of n contributions by
at most ``3 × median × (its weight share)`` instead of anywhere."""


def round_token_cap(manifest) -> int:
    """The most tokens an honest peer trains in one round of ``manifest``'s run:
    ``sync.inner_steps × inner_optimizer.batch_size_tokens``."""
    return manifest.sync.inner_steps * manifest.inner_optimizer.batch_size_tokens


def cap_weight(weight: float, max_weight: float | None) -> float:
    """``weight`` cut to ``max_weight`` (None: no cap)."""
    return weight if max_weight is None or weight <= max_weight else float(max_weight)


def norm(x: torch.Tensor) -> float:
    """L2 norm of ``x``, computed in float64: fp32 values up to 3.4e38 square without overflow."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def median_norm(norms: Sequence[float]) -> float:
    """The lower median of ``norms`` (non-empty): the smaller one of two."""
    ordered = sorted(norms)
    return ordered[(len(ordered) - 1) // 2]


def clip_to_median(parts: Sequence[tuple[float, torch.Tensor]], *, factor: float = CLIP_MEDIAN_FACTOR,
                   ) -> tuple[list[tuple[float, torch.Tensor]], list[int]]:
    """Clip each contribution's norm to ``factor`` × the lower median of the reference norms of
    ``parts`` (each norm scaled by the heaviest weight over its own: see the module docstring).

    Args:
        parts: ``(weight, fp32 tensor)`` per contribution, all finite, all the same shape.
        factor: the multiple of the median allowed.

    Returns:
        ``(parts, clipped)``: the parts with every contribution above the threshold replaced by a
        scaled copy (the others are the same tensor objects, untouched), and the positions
        clipped. A median of 0 (most contributions are exactly zero) gives no scale: nothing is
        clipped then.
    """
    norms = [norm(x) for _, x in parts]
    heaviest = max((w for w, _ in parts), default=0.0)
    references = [n * (heaviest / w) if w > 0 else n for (w, _), n in zip(parts, norms)]
    threshold = factor * median_norm(references) if parts else 0.0
    if not threshold > 0 or not math.isfinite(threshold):
        return list(parts), []
    out, clipped = [], []
    for i, ((w, x), n) in enumerate(zip(parts, norms)):
        if n > threshold:
            x = x * (threshold / n)  # scale < 1: no overflow
            clipped.append(i)
        out.append((w, x))
    return out, clipped
