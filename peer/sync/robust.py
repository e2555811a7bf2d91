"""Robust aggregation of one piece's contributions: the owner's mean (:func:`piece_mean`, as
peer/sync/allreduce.py and the in-process hub take it; issue #51, item 4).

An owner of a piece (peer/sync/allreduce.py) averages every groupmate's contribution to it. A
weighted mean lets one contribution move the result anywhere its norm allows; the median-norm clip
(peer/sync/screening.py ``clip_to_median``) bounds that norm, but a clipped contribution still
pulls the mean by ``3 × median norm × its weight share`` in any direction, e.g. straight against the
honest pseudo-gradients, whose norm is of that same size. :func:`centered_clip` bounds the pull by
the *spread* of the honest contributions instead of their size: CenteredClip (Karimireddy, He,
Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021, arXiv 2012.10333,
Eq. 2; the aggregator of BTARD, Gorbunov et al. 2021, arXiv 2106.11257)::

    v ← v + Σ_i w_i (x_i − v) · min(1, τ / ‖x_i − v‖) / Σ_i w_i        (L iterations)

started at the coordinate-wise median of the contributions, with τ a multiple of the median
distance of the contributions to that start. A contribution within τ of the centre counts fully,
one further away counts as if it were at distance τ: a fraction ``f`` of the weight moves the
result by at most about ``τ · f / (1 − f)``.

Determinism: every operation runs on the CPU in a fixed order over the contributions in sender
order (float64 norms, fp32 sums), so an owner gives the same bits for the same inputs; only the
owner computes a piece's mean and every groupmate receives its bytes, so groupmates still hold
bit-identical φ whatever it clips. When no contribution is out of line (every distance within τ),
:func:`centered_clip` returns the plain weighted mean (fp32, sender order); :func:`trimmed_length` then
only rescales it (float64 projections, ranked with ties broken by sender order).

CenteredClip bounds how far a contribution pulls the mean, not how much it *shrinks* it. A
contribution that points against the others at a modest norm (Inner Product Manipulation, Xie,
Koyejo, Gupta, arXiv 1903.03936: −ε × the honest mean) lies *closer* to the centre than the honest
contributions when those agree (their distance is their spread; its own is about (1 + ε) × the
mean's norm), so nothing clips it, and the mean keeps its direction but loses length: 2 of 8 at
ε = 0.5 leave 5/8 of the honest step, which costs more than not averaging at all. Coordinate-wise
trimmed mean and median miss it too (in every single coordinate it lies inside the honest spread,
the paper's point). Along the one direction the outer step moves φ, it is the extreme. So
:func:`piece_mean` keeps CenteredClip's direction ``u`` and sets the length to the **trimmed mean of
the contributions' projections on u** (:func:`trimmed_length`; the trimmed mean of Yin, Chen,
Ramchandran, Bartlett, arXiv 1803.01498, taken along ``u`` instead of per coordinate): the
:data:`TRIM_FRACTION` lowest and highest projections are left out, so up to that share of the
group can neither shorten (zeros, IPM, dilution by near-orthogonal vectors) nor stretch the step
beyond what the honest projections span. Honest contributions of one run agree along ``u`` to a
few per cent (their projections lie within ±9 % of their median in bench/byzantine.py's clean
runs), so the length changes little in a clean round; the bits do change (the trimmed mean is
not the mean).

CenteredClip bounds each contribution's pull, not how many contributions pull the same way: two
colluders that send one vector ("A Little Is Enough", arXiv 1902.06156: μ − z·σ from their own
payloads) pull twice as far as one. :func:`similarity_weighted` weighs down contributions whose
deviations from the centre point the same way (FoolsGold, arXiv 1808.04866), which honest ones,
differing by their data, do not.

A single contribution *flipped* under the clip (−2.5 × its own Δ) is neither duplicated nor far
enough out for τ to clip it all, and turns every step it joins. :func:`direction_screened` leaves
out a contribution whose cosine with the group's coordinate-wise median is negative (FLTrust's
ReLU of the cosine with a reference, arXiv 2012.13995, with the median as the reference).

What it does not bound: the means a lying *owner* sends (the receivers' checks,
peer/sync/screening.py ``owner_mean_problem``, bound their norm only), and groups under
:data:`CENTERED_CLIP_MIN_PARTS` (NoLoCo's pairs), which have no majority to centre on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from peer.sync.screening import _cosine, clip_to_median

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
    centre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip (arXiv 2012.10333, Eq. 2) of weighted contributions, from their coordinate-wise
    median, with ``τ = tau_factor ×`` the lower median distance of the contributions to it.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, one shape, at least one.
        tau_factor: τ over the median distance (> 0).
        iterations: L (≥ 1).
        centre: :func:`coordinate_median` of ``parts`` when the caller has it (the same bits), else None.

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
    centre = coordinate_median(parts) if centre is None else centre
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


TRIM_FRACTION = 0.25
"""Share of a piece's contributions whose projections :func:`trimmed_length` leaves out at each end:
``⌊0.25 n⌋`` (2 of 8, 1 of 4 to 7), so a quarter of a group, the colluders of issue #65's 2 of 8,
cannot move the length of the step outside the honest projections' range."""


def trimmed_length(
    parts: Sequence[tuple[float, torch.Tensor]], centre: torch.Tensor, *, trim_fraction: float = TRIM_FRACTION
) -> torch.Tensor:
    """``centre`` rescaled to the weighted trimmed mean of the contributions' projections on its
    direction (see the module docstring; the trimmed mean of arXiv 1803.01498 along ``centre``).

    Each contribution's projection ``p_i = <x_i, centre> / ‖centre‖`` (float64) is ranked by its
    reference value ``p_i × w_max / w_i`` (a peer that trained fewer tokens has a shorter Δ, as
    screening.py's ``clip_to_median`` scales norms), ties by sender order; the ``⌊trim_fraction ×
    n⌋`` lowest and highest are left out and the length is ``Σ w_i p_i / Σ w_i`` over the rest.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, the shape of ``centre``.
        centre: fp32, the robust centre (:func:`centered_clip`'s mean).
        trim_fraction: in [0, 0.5).

    Returns:
        A new fp32 tensor: ``centre × length / ‖centre‖``; ``centre`` itself (the same object) when
        fewer than :data:`CENTERED_CLIP_MIN_PARTS` parts, a piece under
        :data:`CENTERED_CLIP_MIN_ELEMENTS` values, ``centre = 0``, nothing to trim, or a length that
        is not positive (no agreement along ``centre`` to measure the step by).

    Raises:
        ValueError: ``trim_fraction`` outside [0, 0.5).
    """
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction = {trim_fraction}: expected a share in [0, 0.5)")
    n, cut = len(parts), int(trim_fraction * len(parts))
    if n < CENTERED_CLIP_MIN_PARTS or centre.numel() < CENTERED_CLIP_MIN_ELEMENTS or cut == 0:
        return centre
    direction = centre.flatten().double()
    size = float(torch.linalg.vector_norm(direction))
    if not size > 0 or not math.isfinite(size):
        return centre
    direction = direction / size
    heaviest = max(w for w, _ in parts)
    projections = [float(torch.dot(x.flatten().double(), direction)) for _, x in parts]
    ranked = sorted(range(n), key=lambda i: (projections[i] * heaviest / parts[i][0], i))
    kept = ranked[cut : n - cut]
    length = sum(parts[i][0] * projections[i] for i in kept) / sum(parts[i][0] for i in kept)
    if not length > 0 or not math.isfinite(length):
        return centre
    return (centre.double() * (length / size)).float()


SIMILARITY_COSINE = 1 / 3
"""κ of :func:`similarity_weighted`: a contribution whose deviation from the centre has a cosine
above this with another one's is weighed down. Honest deviations are sampling noise, nearly
orthogonal (bench/byzantine.py's clean runs: median 0.08, 99th percentile 0.40 over pieces of
4,096 values and more); colluders who send one vector have cosine 1."""
SIMILARITY_MIN_ELEMENTS = 256
"""Pieces under this many values (the norm gains) are not weighed by similarity: few values give
honest deviations cosines up to 0.8 by chance."""
_SIMILARITY_CHUNK = 1 << 20


def _deviation_gram(parts: Sequence[tuple[float, torch.Tensor]], centre: torch.Tensor | None) -> torch.Tensor:
    """The n × n float64 Gram matrix of the contributions' deviations from their coordinate-wise
    (lower) median (``centre`` when given), accumulated over chunks of :data:`_SIMILARITY_CHUNK` values
    in a fixed order (never more than n chunks in float64 at once, whatever the piece's size)."""
    flats = [x.flatten() for _, x in parts]
    middle = None if centre is None else centre.flatten()
    n, size = len(flats), flats[0].numel()
    gram = torch.zeros(n, n, dtype=torch.float64)
    for start in range(0, size, _SIMILARITY_CHUNK):
        stacked = torch.stack([f[start : start + _SIMILARITY_CHUNK].float() for f in flats])
        median = stacked.median(dim=0).values if middle is None else middle[start : start + _SIMILARITY_CHUNK]
        dev = (stacked - median).double()
        for i in range(n):
            for j in range(i, n):
                gram[i, j] += torch.dot(dev[i], dev[j])
    return torch.triu(gram) + torch.triu(gram, diagonal=1).T


def similarity_weighted(
    parts: Sequence[tuple[float, torch.Tensor]], *, kappa: float = SIMILARITY_COSINE, centre: torch.Tensor | None = None
) -> list[tuple[float, torch.Tensor]]:
    """``parts`` with the weight of each contribution that moves from the centre *along with another
    one* scaled down: FoolsGold's observation (Fung, Yoon, Beschastnikh, arXiv 1808.04866, §4) that
    colluding Sybils share their objective and so their updates, where honest peers' differ by their
    data. With ``c_i`` the largest cosine between contribution i's deviation from the coordinate-wise
    median and any other's, its weight is multiplied by ``min(1, (1 − c_i) / (1 − κ))``; a
    contribution at factor 0 (another one's duplicate) is left out.

    Why it bounds colluders: CenteredClip lets each contribution pull by at most τ; colluders at
    cosine c add up only the ``√c`` share of their pull that they have in common, and above κ their
    weight falls faster than that share grows (``(1 − c) √c`` decreases past c = 1/3 = κ), so the most
    two colluders can pull together is ``√κ ≈ 0.58`` of what one vector sent twice pulls, about what
    one alone does at its full weight. Honest contributions, whose deviations are nearly orthogonal,
    keep their weights: the plain mean of a clean round is unchanged.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, one shape.
        kappa: κ in [0, 1).
        centre: :func:`coordinate_median` of ``parts`` when the caller has it (the same bits), else None.

    Returns:
        A new list: ``(weight × factor, tensor)`` for the contributions kept, in their order (the
        tensors themselves, not copies). ``parts`` unchanged (a list of them) when fewer than
        :data:`CENTERED_CLIP_MIN_PARTS` parts, a piece under :data:`SIMILARITY_MIN_ELEMENTS` values, or
        when fewer than half the contributions would keep any weight (no majority to centre on).

    Raises:
        ValueError: ``kappa`` outside [0, 1).
    """
    if not 0 <= kappa < 1:
        raise ValueError(f"kappa = {kappa}: expected a cosine in [0, 1)")
    n = len(parts)
    if n < CENTERED_CLIP_MIN_PARTS or parts[0][1].numel() < SIMILARITY_MIN_ELEMENTS:
        return list(parts)
    gram = _deviation_gram(parts, centre)
    norms = gram.diagonal().clamp_min(0).sqrt()
    out = []
    for i, (w, x) in enumerate(parts):
        cosines = [
            float(gram[i, j] / (norms[i] * norms[j])) for j in range(n) if j != i and norms[i] > 0 and norms[j] > 0
        ]
        c = max(cosines, default=0.0)
        factor = 1.0 if not c > kappa else max(0.0, (1.0 - c) / (1.0 - kappa))
        if factor > 1e-6:
            out.append((w * factor, x))
    return out if 2 * len(out) >= n else list(parts)


DIRECTION_MIN_COSINE = 0.0
"""A contribution whose cosine with the contributions' coordinate-wise median is under this is left
out of the piece's mean (:func:`direction_screened`): honest pseudo-gradients of one run make an
acute angle with the group's median (docs/architecture.md gives the measured margin), a flipped one
an obtuse angle."""


def direction_screened(
    parts: Sequence[tuple[float, torch.Tensor]],
    *,
    min_cosine: float = DIRECTION_MIN_COSINE,
    centre: torch.Tensor | None = None,
) -> list[tuple[float, torch.Tensor]]:
    """``parts`` without the contributions that point *against* the group: cosine with the
    coordinate-wise (lower) median of all of them under ``min_cosine``. FLTrust's rule (Cao, Fang,
    Liu, Gong, arXiv 2012.13995, Eq. 2: a contribution's weight is ReLU of its cosine with a
    reference) with the median as the reference, since no peer holds trusted data, and cut to a
    keep-or-leave-out at ``min_cosine`` so a clean round keeps the plain mean's bits. A flipped
    pseudo-gradient under the median-norm clip (−2.5 × its own) lies within CenteredClip's reach of
    the centre at a norm its τ does not fully clip, and would pull the direction of every outer step
    it joins; here it counts for nothing. One that passes (cosine ≥ 0) adds at most a sideways pull,
    which CenteredClip bounds by τ and :func:`trimmed_length` keeps from shortening the step.

    Args:
        parts: ``(weight > 0, fp32 tensor)`` per contribution, all finite, one shape.
        min_cosine: in [-1, 1).
        centre: :func:`coordinate_median` of ``parts`` when the caller has it, else None.

    Returns:
        A new list of the contributions kept, in their order (the tensors themselves). ``parts``
        unchanged (a list of them) when fewer than :data:`CENTERED_CLIP_MIN_PARTS` parts, a piece under
        :data:`CENTERED_CLIP_MIN_ELEMENTS` values, a median of norm 0, or when fewer than half the
        contributions would be kept (no majority to judge a direction by).

    Raises:
        ValueError: ``min_cosine`` outside [-1, 1).
    """
    if not -1 <= min_cosine < 1:
        raise ValueError(f"min_cosine = {min_cosine}: expected a cosine in [-1, 1)")
    n = len(parts)
    if n < CENTERED_CLIP_MIN_PARTS or parts[0][1].numel() < CENTERED_CLIP_MIN_ELEMENTS:
        return list(parts)
    middle = coordinate_median(parts) if centre is None else centre
    if not bool(middle.any()):
        return list(parts)
    kept = [(w, x) for w, x in parts if _cosine(x, middle) >= min_cosine]
    return kept if 2 * len(kept) >= n else list(parts)


def piece_mean(parts: Sequence[tuple[float, torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """An owner's mean of one piece (peer/sync/allreduce.py, step 3, before the codec): the contributions clipped to
    the median rule (peer/sync/screening.py ``clip_to_median``), then CenteredClip
    (:func:`centered_clip`, arXiv 2012.10333 Eq. 2: the plain token-weighted mean,
    summed in fp32 in sender order, when no contribution is out of line or fewer than 4 are
    included), its length then set to the trimmed mean of the contributions' projections on it
    (:func:`trimmed_length`, from 4 contributions). Before CenteredClip, contributions that point
    against the group's median are left out (:func:`direction_screened`) and those that deviate
    from the others' centre in the same direction as another one are weighed down
    (:func:`similarity_weighted`). Only the owner computes it and every receiver
    gets its bytes, so receivers stay bit-identical whatever it clips or trims. The in-process hub
    (lab/inprocess_means.py) calls it too, in every sync schedule.

    Args:
        parts: ``(capped token weight > 0, fp32 tensor)`` per included contribution, all finite, one
            shape, at least one.

    Returns:
        ``(mean, clipped)``: a new fp32 tensor of the piece's shape (finite unless the weighted sum
        overflows) and the positions in ``parts`` the median rule struck (over
        ``STRIKE_MEDIAN_FACTOR`` × the median: a strike each; what it only clips, and what
        CenteredClip clips, is not struck: it may be an honest outlier, e.g. a fresh joiner's Δ).
    """
    parts, struck = clip_to_median(parts)
    judged = len(parts) >= CENTERED_CLIP_MIN_PARTS and parts[0][1].numel() >= CENTERED_CLIP_MIN_ELEMENTS
    centre = coordinate_median(parts) if judged else None  # computed once: each rule below starts from it
    kept = direction_screened(parts, centre=centre)
    centre = centre if len(kept) == len(parts) else None  # the median ignores weights, not who is left out
    weighted = similarity_weighted(kept, centre=centre)
    mean, _ = centered_clip(weighted, centre=centre if len(weighted) == len(kept) else None)
    return trimmed_length(weighted, mean), struck
