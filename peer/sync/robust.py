"""Robust aggregation of one piece's contributions: the owner's mean (peer/sync/allreduce.py
``piece_mean``; issue #51, item 4).

An owner of a piece (peer/sync/allreduce.py) averages every groupmate's contribution to it. A
weighted mean lets one contribution move the result anywhere its norm allows; the median-norm clip
(peer/sync/screening.py ``clip_to_median``) bounds that norm, but a clipped contribution still
pulls the mean by ``3 × median norm × its weight share`` in any direction, e.g. straight against the
honest pseudo-gradients, whose norm is of that same size. Two aggregators from the literature bound
the pull by the *spread* of the honest contributions instead of their size:

* :func:`centered_clip`: CenteredClip (Karimireddy, He, Jaggi, "Learning from History for Byzantine
  Robust Optimization", ICML 2021, arXiv 2012.10333, Eq. 2; the aggregator of BTARD, Gorbunov et
  al. 2021, arXiv 2106.11257)::

      v ← v + Σ_i w_i (x_i − v) · min(1, τ / ‖x_i − v‖) / Σ_i w_i        (L iterations)

  started at the coordinate-wise median of the contributions, with τ a multiple of the median
  distance of the contributions to that start. A contribution within τ of the centre counts fully,
  one further away counts as if it were at distance τ: a fraction ``f`` of the weight moves the
  result by at most about ``τ · f / (1 − f)``.
* :func:`trimmed_mean`: the coordinate-wise trimmed mean (Yin, Chen, Ramchandran, Bartlett 2018,
  arXiv 1803.01498, Def. 2): per coordinate, the ``b`` smallest and ``b`` largest values are dropped
  and the rest averaged, weighted.

:data:`AGGREGATOR` names the one ``piece_mean`` uses. Determinism: every operation runs on the CPU in
a fixed order over the contributions in sender order (float64 norms, fp32 sums), so an owner gives
the same bits for the same inputs; only the owner computes a piece's mean and every groupmate
receives its bytes, so groupmates still hold bit-identical φ. When no contribution is out of line
(every distance within τ), :func:`centered_clip` returns the plain weighted mean, summed exactly as
``piece_mean`` summed it before (fp32, sender order): a clean round gives the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CENTERED_CLIP_TAU_FACTOR = 2.0
"""τ of :func:`centered_clip` as a multiple of the (lower) median distance of the contributions to
the coordinate-wise median: honest contributions of one run lie at similar distances from the
centre (their spread is sampling noise), so 2× leaves them whole and bounds anything further out."""
CENTERED_CLIP_ITERATIONS = 3
"""L of :func:`centered_clip`: iterations from the coordinate-wise median (Karimireddy et al. use 1
to 3 when the start is already near the honest mean, as the median is)."""
CENTERED_CLIP_MIN_PARTS = 4
"""Fewer contributions get the plain mean from :func:`centered_clip`: of 3, the median distance is
one honest contribution's own, and the next one often lies past 2x it (the tiny preset's 3 peers,
tests/unit/test_engine_sim.py); one bad contribution of 3 is beyond a quarter of the group anyway."""
CENTERED_CLIP_MIN_ELEMENTS = 16
"""Pieces under this many values get the plain mean from :func:`centered_clip`: the distances of a
few values scatter too much for their median to tell an honest contribution from a bad one (the
median-norm clip still bounds each of them); every parameter tensor of the presets is larger."""
TRIM_FRACTION = 0.25
"""The fraction of contributions :func:`trimmed_mean` drops at each end, per coordinate (rounded
down; at least one once there are 4 or more): a quarter, issue #51's goal (2 of 8)."""
OWN_CLIP_FACTOR = 1.5
"""With fewer than 3 contributions (a NoLoCo pair) there is no majority to centre on: the owner
centres on its own contribution x_o and clips each other one's difference from it to this multiple
of ‖x_o‖ (:func:`clip_around_own`). Honest pseudo-gradients of a pair have cosines ≥ 0 and norms
within 1.5x of each other, so their difference stays under about 1.5‖x_o‖; a flipped partner's
(−3x_o after the median clip, 4‖x_o‖ away) is cut to 1.5‖x_o‖ and cannot reverse the step."""
AGGREGATORS = ("centered-clip", "trimmed-mean", "mean")
AGGREGATOR = "centered-clip"
"""What peer/sync/allreduce.py ``piece_mean`` applies after the median-norm clip."""


def weighted_sum(parts: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``Σ_i (w_i / Σ w) x_i`` summed in fp32 in the given order (a new tensor of the parts' shape).

    Args:
        parts: ``(weight > 0, fp32 tensor)``, one shape, at least one.
    """
    total = sum(w for w, _ in parts)
    acc = torch.zeros_like(parts[0][1], dtype=torch.float32)
    for w, x in parts:  # fixed sender order: the sum is the same wherever it is computed
        acc.add_(x, alpha=w / total)
    return acc


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ in float64 (fp32 inputs of any finite size: no overflow)."""
    return float(torch.linalg.vector_norm(a.double() - b.double()))


def coordinate_median(parts: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """The coordinate-wise lower median of the contributions (weights ignored): fp32, their shape."""
    stacked = torch.stack([x.float() for _, x in parts])
    return stacked.median(dim=0).values  # the lower median: one of the inputs' values, deterministic


def centered_clip(
    parts: Sequence[tuple[float, torch.Tensor]],
    *,
    tau_factor: float = CENTERED_CLIP_TAU_FACTOR,
    iterations: int = CENTERED_CLIP_ITERATIONS,
) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip (arXiv 2012.10333, Eq. 2) of weighted contributions, from their coordinate-wise
    median, with ``τ = tau_factor ×`` the lower median distance of the contributions to it.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, one shape, at least one.
        tau_factor: τ over the median distance (> 0).
        iterations: L (≥ 1).

    Returns:
        ``(mean, clipped)``: a new fp32 tensor of the parts' shape and the positions in ``parts``
        whose distance to the centre exceeded τ at some iteration. With none clipped, ``mean`` is
        :func:`weighted_sum` of ``parts`` (the plain mean, the same bits). Fewer than
        :data:`CENTERED_CLIP_MIN_PARTS` parts, a piece under :data:`CENTERED_CLIP_MIN_ELEMENTS` values or a median distance of 0 (most
        contributions equal) give the plain mean: no majority to centre on.

    Raises:
        ValueError: ``tau_factor`` ≤ 0 or ``iterations`` < 1.
    """
    if not tau_factor > 0 or iterations < 1:
        raise ValueError(f"tau_factor = {tau_factor}, iterations = {iterations}: expected > 0 and >= 1")
    plain = weighted_sum(parts)
    if len(parts) < CENTERED_CLIP_MIN_PARTS or parts[0][1].numel() < CENTERED_CLIP_MIN_ELEMENTS:
        return plain, []
    centre = coordinate_median(parts)
    distances = [_distance(x, centre) for _, x in parts]
    tau = tau_factor * sorted(distances)[(len(distances) - 1) // 2]
    if not tau > 0 or not math.isfinite(tau):
        return plain, []
    if all(d <= tau for d in distances):
        return plain, []  # nothing out of line: one iteration from the centre gives the plain mean
    total = sum(w for w, _ in parts)
    clipped: set[int] = set()
    v = centre.double()
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for i, (w, x) in enumerate(parts):
            diff = x.double() - v
            d = float(torch.linalg.vector_norm(diff))
            scale = 1.0 if d <= tau else tau / d
            if scale < 1.0:
                clipped.add(i)
            step.add_(diff, alpha=(w / total) * scale)
        v = v + step
    return v.float(), sorted(clipped)


def trimmed_mean(
    parts: Sequence[tuple[float, torch.Tensor]], *, trim_fraction: float = TRIM_FRACTION
) -> tuple[torch.Tensor, list[int]]:
    """The coordinate-wise trimmed mean (arXiv 1803.01498, Def. 2), weighted: per coordinate the
    ``b = floor(trim_fraction × n)`` smallest and ``b`` largest values are dropped (ties broken by
    sender order: a stable sort) and the rest averaged with their senders' weights.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, one shape, at least one.
        trim_fraction: in [0, 0.5).

    Returns:
        ``(mean, trimmed)``: a new fp32 tensor and the positions whose values were dropped in more
        than half of the coordinates (a contribution mostly out of line). ``b = 0`` (fewer than
        ``1 / trim_fraction`` parts) gives :func:`weighted_sum`.

    Raises:
        ValueError: ``trim_fraction`` outside [0, 0.5).
    """
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction = {trim_fraction}: expected 0 <= trim_fraction < 0.5")
    n = len(parts)
    b = int(trim_fraction * n)
    if b == 0:
        return weighted_sum(parts), []
    shape = parts[0][1].shape
    stacked = torch.stack([x.float().flatten() for _, x in parts]).double()  # (n, d)
    weights = torch.tensor([w for w, _ in parts], dtype=torch.float64)
    order = torch.sort(stacked, dim=0, stable=True).indices
    kept = order[b : n - b]  # (n - 2b, d) sender positions kept per coordinate
    values = torch.gather(stacked, 0, kept)
    w = weights[kept]
    mean = (values * w).sum(dim=0) / w.sum(dim=0)
    dropped = torch.cat([order[:b], order[n - b :]])  # (2b, d)
    counts = torch.bincount(dropped.flatten(), minlength=n)
    trimmed = [i for i in range(n) if int(counts[i]) * 2 > stacked.shape[1]]
    return mean.float().reshape(shape), trimmed


def clip_around_own(
    parts: Sequence[tuple[float, torch.Tensor]], own: int, *, factor: float = OWN_CLIP_FACTOR
) -> tuple[list[tuple[float, torch.Tensor]], list[int]]:
    """Each contribution but ``parts[own]`` (the owner's, x_o) replaced by ``x_o + (x − x_o) ×
    min(1, factor × ‖x_o‖ / ‖x − x_o‖)`` (CenteredClip's step centred on x_o, for groups too small
    to have a majority; arXiv 2012.10333 Eq. 2 with v = x_o).

    Args:
        parts: ``(weight, fp32 tensor)``, all finite, one shape; ``own`` an index into it.

    Returns:
        ``(parts, clipped)``: the parts (clipped ones replaced by new tensors, the others the same
        objects) and the positions clipped. A zero x_o clips nothing (no scale).
    """
    centre = parts[own][1]
    tau = factor * float(torch.linalg.vector_norm(centre, dtype=torch.float64))
    if not tau > 0 or not math.isfinite(tau):
        return list(parts), []
    out, clipped = [], []
    for i, (w, x) in enumerate(parts):
        d = _distance(x, centre) if i != own else 0.0
        if d > tau:
            x = (centre.double() + (x.double() - centre.double()) * (tau / d)).float()
            clipped.append(i)
        out.append((w, x))
    return out, clipped


def robust_mean(
    parts: Sequence[tuple[float, torch.Tensor]], *, aggregator: str = AGGREGATOR
) -> tuple[torch.Tensor, list[int]]:
    """The mean of ``parts`` by ``aggregator`` (one of :data:`AGGREGATORS`; ``"mean"``: the plain
    weighted mean), with the positions it clipped or trimmed. See :func:`centered_clip` and
    :func:`trimmed_mean` for the arguments and results.

    Raises:
        ValueError: an unknown ``aggregator``.
    """
    if aggregator == "centered-clip":
        return centered_clip(parts)
    if aggregator == "trimmed-mean":
        return trimmed_mean(parts)
    if aggregator == "mean":
        return weighted_sum(parts), []
    raise ValueError(f"aggregator = {aggregator!r}: expected one of {AGGREGATORS}")
