"""Adaptive compression: per tensor, the codec that fits a sync into its time budget.

The DiLoCoX idea (arXiv 2506.21263; docs/algorithms.md §3): compress pseudo-gradients more where they
carry less information, as much as the link requires. :func:`plan` turns a byte budget
(``sync_time_budget_s`` × the measured uplink) into one :class:`~protocol.codecs.Codec` per
tensor by a rate-distortion allocation: each tensor's candidates (fp32, fp16, int8, int4, fp4
and fp3 at two block sizes, and for matrices the lowest rank 1, 2, 4, … that is as faithful as
fp4) are priced in bytes sent and in the squared error of their actual round trip, and the
choice that minimises the total squared error within the budget is found by dynamic
programming. A matrix whose Δ has its energy in a few singular directions thus gets a low rank;
a tensor with much energy gets more bits than one with little. The floor is fp3 (3.1 bits per
value, about 10x fewer bytes than fp32) unless low rank is faithful: below it the plan is over
budget and says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.codecs import BLOCK_RANGE, Codec
from protocol.manifest import CompressionSpec

logger = logging.getLogger(__name__)

ELEMENTWISE = ("fp3", "fp4", "int4", "int8", "fp16", "none")
"""Candidates of every tensor; 1-D and 0-D tensors get only these."""
BLOCK_FACTORS = (1, 4)
"""Blockwise candidates use ``block_size`` × each of these: larger blocks spend fewer bytes on
scales (int4 at 64: 4.5 bits per value, at 256: 4.125) for a larger error."""
KNAPSACK_UNITS = 8192
"""Resolution of the byte budget in the allocation: at most one unit per tensor goes unspent."""
PLAN_SEED = 0
"""Seed of the low-rank round trips that price candidates (the real encode uses the round's seed)."""


def sent_bytes(codec: Codec, shape: Sequence[int], group_size: int) -> float:
    """Bytes one peer sends for one tensor in a butterfly all-reduce over ``group_size`` peers.

    Reduce-scatter: (n−1)/n of its own encoding; all-gather: (n−1)/n of the mean's encoding
    (``codec.for_mean(n)``) on average over owners. For elementwise codecs that is
    2·(n−1)/n × the encoded size.
    """
    n = group_size
    if n <= 1:
        return 0.0
    return (n - 1) / n * (codec.encoded_size(shape) + codec.for_mean(n).encoded_size(shape))


class CodecPlan(list):
    """The codecs :func:`plan` chose, one per tensor, with what the plan costs.

    Attributes:
        bytes_per_sync: estimated bytes this peer sends in one all-reduce with these codecs.
        budget_bytes: ``sync_time_budget_s`` × uplink bytes per second.
        over_budget: True when even the cheapest codec of every tensor exceeds the budget.
        note: a sentence for logs: the budget, the bytes, and whether it fits.
    """

    bytes_per_sync: float = 0.0
    budget_bytes: float = 0.0
    over_budget: bool = False
    note: str = ""


@dataclass(frozen=True)
class _Option:
    codec: Codec
    bytes_: float
    error: float  # squared L2 error of the round trip


def _candidates(x: torch.Tensor, spec: CompressionSpec, group_size: int) -> list[_Option]:
    shape = tuple(x.shape)
    x = x.detach().float()
    options = []
    for name in ELEMENTWISE:
        # Codecs are equal when they encode alike: one per block size for blockwise formats, one in all for the rest.
        for codec in dict.fromkeys(
            Codec(name, block_size=min(spec.block_size * f, BLOCK_RANGE[1])) for f in BLOCK_FACTORS
        ):
            err = _round_trip_error(codec, x) if codec.lossy else 0.0
            options.append(_Option(codec, sent_bytes(codec, shape, group_size), err))
    if x.dim() >= 2 and x.numel():
        # Low rank only where it is as faithful as 4-bit floats, i.e. where Δ's effective rank is
        # low: what a codec drops comes back only rounds later through error feedback, and
        # dropping most of a full-rank Δ each round costs far more loss than its squared error
        # suggests (docs/notes/benchmarks-log.md, "Codecs").
        faithful = next(o.error for o in options if o.codec == Codec("fp4", block_size=spec.block_size))
        cheapest_dense = min(o.bytes_ for o in options)
        rank = 1
        while True:
            codec = Codec("lowrank", rank=rank)
            cost = sent_bytes(codec, shape, group_size)
            if (
                codec.resolve(shape) != codec.name
                or codec.for_mean(group_size).resolve(shape) != codec.name
                or cost >= cheapest_dense
            ):
                break
            err = _round_trip_error(codec, x)
            if err <= faithful:
                options.append(_Option(codec, cost, err))
                break  # higher ranks cost more for an error already below 4-bit's
            rank *= 2
    return _pareto(options)


def _round_trip_error(codec: Codec, x: torch.Tensor) -> float:
    _, y = codec.roundtrip(x, seed=PLAN_SEED)
    return float((x - y).pow(2).sum())


def _pareto(options: list[_Option]) -> list[_Option]:
    """Options no other beats on both counts, bytes increasing, error decreasing."""
    options = sorted(options, key=lambda o: (o.bytes_, o.error, o.codec.name))
    front: list[_Option] = []
    for o in options:
        if not front or o.error < front[-1].error:
            if front and o.bytes_ == front[-1].bytes_:
                front.pop()
            front.append(o)
    return front


def plan(
    tensors: Sequence[torch.Tensor], spec: CompressionSpec, *, uplink_bytes_per_s: float, group_size: int
) -> CodecPlan:
    """Pick one codec per tensor so that one sync fits ``spec.sync_time_budget_s`` at the uplink.

    Rate-distortion allocation: minimise Σ_tensors ‖x − x̂‖² subject to Σ bytes sent ≤ budget,
    over each tensor's candidates, a multiple-choice knapsack solved exactly by dynamic
    programming at a resolution of budget/``KNAPSACK_UNITS``. Errors are measured by actual
    round trips, so the allocation sees each tensor's energy and spectrum. Deterministic.
    Cost: a few encodes per tensor plus O(tensors × candidates × units); call it once per round.

    Args:
        tensors: this round's (error-compensated) pseudo-gradients, fp32, one per parameter.
        spec: the run's compression section (``sync_time_budget_s``, ``block_size``).
        uplink_bytes_per_s: measured (or assumed: ``spec.uplink_mbps``) uplink, bytes per second.
        group_size: peers in this round's group, this one included; 1 sends nothing (all 'none').

    Returns:
        A :class:`CodecPlan` (a list of codecs, one per tensor). When even the cheapest choice
        exceeds the budget, it holds the cheapest codecs, ``over_budget`` is True and a warning
        is logged.
    """
    if uplink_bytes_per_s <= 0 or group_size < 1:
        raise ValueError(f"uplink_bytes_per_s = {uplink_bytes_per_s}, group_size = {group_size}: need > 0 and >= 1")
    budget = spec.sync_time_budget_s * uplink_bytes_per_s
    result = CodecPlan()
    result.budget_bytes = budget
    if group_size == 1:
        result.extend(Codec("none") for _ in tensors)
        result.note = "group of one: nothing is sent"
        return result
    fronts = [_candidates(t, spec, group_size) for t in tensors]
    choice = _knapsack(fronts, budget - sum(f[0].bytes_ for f in fronts))
    total = sum(f[c].bytes_ for f, c in zip(fronts, choice))
    result.extend(f[c].codec for f, c in zip(fronts, choice))
    result.bytes_per_sync = total
    result.over_budget = total > budget
    seconds = total / uplink_bytes_per_s
    result.note = (
        f"adaptive plan: {total / 2**20:.2f} MiB per sync, {seconds:.2f} s at "
        f"{uplink_bytes_per_s * 8 / 1e6:.1f} Mbit/s, budget {spec.sync_time_budget_s:.2f} s"
    )
    if result.over_budget:
        result.note += ": OVER BUDGET, even the cheapest codec of every tensor does not fit"
        logger.warning("%s", result.note)
    return result


def _knapsack(fronts: list[list[_Option]], spare: float) -> list[int]:
    """Per tensor the option index minimising the total squared error within ``spare`` extra bytes.

    Multiple-choice knapsack by dynamic programming over the bytes beyond every tensor's cheapest
    option, in ``KNAPSACK_UNITS`` units; costs are rounded up to whole units, so the choice never
    exceeds the budget and wastes at most one unit per tensor. ``spare`` < 0: all cheapest.
    """
    if spare <= 0:
        return [0] * len(fronts)
    unit = spare / KNAPSACK_UNITS
    best = np.zeros(KNAPSACK_UNITS + 1)  # least error of the tensors so far within b units
    picks = np.zeros((len(fronts), KNAPSACK_UNITS + 1), dtype=np.int16)
    for t, front in enumerate(fronts):
        new = np.full(KNAPSACK_UNITS + 1, np.inf)
        for k, o in enumerate(front):
            c = math.ceil((o.bytes_ - front[0].bytes_) / unit - 1e-9)
            if c > KNAPSACK_UNITS:
                break
            cand = np.full(KNAPSACK_UNITS + 1, np.inf)
            cand[c:] = best[: KNAPSACK_UNITS + 1 - c] + o.error
            better = cand < new  # strict: ties keep the cheaper option
            new[better] = cand[better]
            picks[t][better] = k
        best = new
    choice, b = [0] * len(fronts), KNAPSACK_UNITS
    for t in range(len(fronts) - 1, -1, -1):
        k = int(picks[t][b])
        choice[t] = k
        b -= math.ceil((fronts[t][k].bytes_ - fronts[t][0].bytes_) / unit - 1e-9)
    return choice
