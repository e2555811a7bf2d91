"""The group plan: which peers average together in a round, and the codec seeds of its pieces.

Every peer computes the same plan from the same inputs (the candidate peers at the round, the
run id, the round number), so no coordinator is needed. The network averager, the trainer and
the in-process hub (lab/inprocess.py) all call these functions: one rule, one place.

- DiLoCo (arXiv 2311.08105): one group of every candidate.
- NoLoCo (arXiv 2506.10911): random groups of ``group_size``, redrawn every round.
- independent: every peer alone (the no-sync floor of comparisons).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

SEED_MODULUS = 1 << 31
"""Codec seeds are below this (stochastic rounding generators take a 31-bit seed)."""


def partition(peer_ids: Sequence[str], *, run_id: str, round_: int, group_size: int) -> list[list[str]]:
    """Split ``peer_ids`` into random groups of ``group_size`` for this round (NoLoCo).

    The peers are sorted, shuffled with a generator seeded by (run id, round) and cut into
    consecutive groups. A remainder of two or more peers forms a smaller group; a single leftover
    peer is a group of one (it applies its own step this round). No peer is ever in a group with
    itself, and duplicates in ``peer_ids`` are ignored.

    Returns:
        The groups, each a list of peer ids, in a canonical order.

    Raises:
        ValueError: ``group_size`` below 2.
    """
    if group_size < 2:
        raise ValueError(f"group_size = {group_size}: must be >= 2")
    ids = sorted(set(peer_ids))
    seed = int.from_bytes(hashlib.sha256(f"{run_id}:{round_}".encode()).digest()[:8], "big")
    random.Random(seed).shuffle(ids)
    return [ids[i : i + group_size] for i in range(0, len(ids), group_size)]


def plan_groups(
    peer_ids: Sequence[str], *, algorithm: str, run_id: str, round_: int, group_size: int
) -> list[list[str]]:
    """The groups that average together in round ``round_``.

    Args:
        peer_ids: the candidates (the outer algorithm decides who is one: every live peer for
            DiLoCo, the peers within one round for NoLoCo); duplicates are ignored.
        algorithm: ``sync.algorithm`` of the run manifest: 'diloco', 'noloco' or 'independent'.
        group_size: NoLoCo's ``noloco.group_size`` (ignored by the others).

    Returns:
        Disjoint groups covering every candidate, each sorted (DiLoCo, independent) or in the
        partition's order (NoLoCo).

    Raises:
        ValueError: an unknown algorithm, or a NoLoCo group size below 2.
    """
    ids = sorted(set(peer_ids))
    if algorithm == "diloco":
        return [ids] if ids else []
    if algorithm == "noloco":
        return partition(ids, run_id=run_id, round_=round_, group_size=group_size)
    if algorithm == "independent":
        return [[peer] for peer in ids]
    raise ValueError(f"sync.algorithm = {algorithm!r}: expected 'diloco', 'noloco' or 'independent'")


def group_of(peer_id: str, groups: Sequence[Sequence[str]]) -> tuple[int, list[str]]:
    """Index and members of the group holding ``peer_id``; (-1, [peer_id]) if it is in none."""
    for index, group in enumerate(groups):
        if peer_id in group:
            return index, list(group)
    return -1, [peer_id]


def codec_seed(round_: int, piece_index: int) -> int:
    """Seed of the codec's random rounding for payload piece ``piece_index`` in round ``round_``.

    Every groupmate (and the simulation) uses the same seed for the same piece, so an owner's
    re-encoding of a mean is reproducible. Below :data:`SEED_MODULUS`.
    """
    return (round_ * 1_000_003 + piece_index) % SEED_MODULUS
