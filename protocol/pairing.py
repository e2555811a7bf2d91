"""Random groups for NoLoCo: which peers average together in a round.

Every peer computes the same partition from the same inputs (the live peers at the round, the
run id and the round number), so no coordinator is needed. Groups are redrawn every round.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence


def partition(peer_ids: Sequence[str], *, run_id: str, round_: int, group_size: int) -> list[list[str]]:
    """Split ``peer_ids`` into random groups of ``group_size`` for this round.

    The peers are sorted, shuffled with a generator seeded by (run id, round) and cut into
    consecutive groups. A remainder of two or more peers forms a smaller group; a single leftover
    peer is a group of one (it applies its own step this round). No peer is ever in a group with
    itself, and duplicates in ``peer_ids`` are ignored.

    Returns:
        The groups, each a list of peer ids, in a canonical order.
    """
    if group_size < 2:
        raise ValueError(f"group_size = {group_size}: must be >= 2")
    ids = sorted(set(peer_ids))
    seed = int.from_bytes(hashlib.sha256(f"{run_id}:{round_}".encode()).digest()[:8], "big")
    random.Random(seed).shuffle(ids)
    return [ids[i:i + group_size] for i in range(0, len(ids), group_size)]


def group_of(peer_id: str, groups: Sequence[Sequence[str]]) -> tuple[int, list[str]]:
    """Index and members of the group holding ``peer_id``; (-1, [peer_id]) if it is in none."""
    for index, group in enumerate(groups):
        if peer_id in group:
            return index, list(group)
    return -1, [peer_id]
