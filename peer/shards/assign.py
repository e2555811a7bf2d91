"""Which shard a peer trains on next: a deterministic function of the run, the peer id and how many
shards the peer has consumed.

The run's training shards are laid on a ring, ordered by SHA-256 of (run key, shard name); a peer
starts at a point of the ring given by the hash of (run key, peer id) and walks it, one shard per
shard consumed, wrapping around for another epoch. Two peers take the same shard only when their
walks meet, which on a ring of n shards starts after n / peers shards on average (consistent
hashing); a restarted peer that knows how many it consumed continues its walk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from peer.shards.index import Shard


def _h(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).digest()


def ring(shards: Sequence[Shard], run_key: str) -> list[Shard]:
    """The training shards in the run's ring order (the same on every peer)."""
    return sorted(shards, key=lambda s: _h(run_key, s.name))


def start_of(peer_id: str, run_key: str, n: int) -> int:
    """Where ``peer_id`` enters a ring of ``n`` shards."""
    return int.from_bytes(_h(run_key, "peer", peer_id)[:8], "big") % n


def shard_at(ordered: Sequence[Shard], peer_id: str, run_key: str, consumed: int) -> Shard:
    """The shard a peer that has consumed ``consumed`` shards reads next.

    Args:
        ordered: :func:`ring` of the run's training shards (at least one).
    """
    n = len(ordered)
    return ordered[(start_of(peer_id, run_key, n) + consumed) % n]


def window_seed(peer_id: str, run_key: str, consumed: int) -> int:
    """63-bit seed of the order in which a peer reads the windows of its ``consumed``-th shard
    (another order on every epoch of the ring)."""
    return int.from_bytes(_h(run_key, "windows", peer_id, str(consumed))[:8], "big") >> 1
