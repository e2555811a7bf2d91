"""Bounds on what a remote peer can make this peer's averager process hold, do or send.

Two kinds of limits, shared by every stream handler of the averager process (hivemind's
``rpc_join_group`` through :mod:`peer.sync.hivemind_limits`, the state transfer through
peer/state/sharing.py):

* :class:`StreamSlots`: how many streams of one handler family are open at once, per remote peer
  and in total. A stream over either cap is closed at once, before anything is read from it.
* :class:`ServeBudget`: how much one remote peer (and everyone together) may download, as a token
  bucket in units of "one full state": a tiny request cannot buy more than its share, so the
  amplification a request buys is bounded by the budget, not by the state's size.

Both are used from one asyncio loop (the averager process's); neither is thread-safe. Pure:
imports neither hivemind nor torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class StreamSlots:
    """Counts open streams per remote peer and in total, and refuses more than the caps.

    Args:
        per_peer: most streams one remote peer may hold open at once (>= 1).
        total: most streams all remote peers together may hold open at once (>= per_peer).

    Raises:
        ValueError: a cap below 1, or ``total`` below ``per_peer``.
    """

    def __init__(self, *, per_peer: int, total: int):
        if per_peer < 1 or total < per_peer:
            raise ValueError(f"stream caps must satisfy 1 <= per_peer <= total, got per_peer={per_peer}, total={total}")
        self.per_peer, self.total = per_peer, total
        self._open: dict[Hashable, int] = {}
        self.refused = 0
        """Streams refused so far (over either cap)."""

    @property
    def open(self) -> int:
        """Streams open now, all peers together."""
        return sum(self._open.values())

    def acquire(self, peer: Hashable) -> bool:
        """Take a slot for a new stream of ``peer``; False (and nothing taken) when a cap is reached."""
        if self._open.get(peer, 0) >= self.per_peer or self.open >= self.total:
            self.refused += 1
            return False
        self._open[peer] = self._open.get(peer, 0) + 1
        return True

    def release(self, peer: Hashable) -> None:
        """Give back a slot that :meth:`acquire` granted for ``peer``."""
        left = self._open.get(peer, 0) - 1
        if left > 0:
            self._open[peer] = left
        else:
            self._open.pop(peer, None)


class ServeBudget:
    """Token buckets of "full states served": one per remote peer, one for everyone together.

    A bucket holds at most its capacity and refills continuously, one capacity per ``period_s``.
    A request costs the fraction of the state it asks for (its bytes over the state's bytes, with
    ``min_state_bytes`` as the floor of the denominator, so that a tiny state does not make every
    request cheap to refuse). A request is granted only if both buckets hold its cost; both are
    then charged.

    Args:
        per_peer_states: capacity of each peer's bucket, in full states (> 0).
        total_states: capacity of the shared bucket, in full states (>= per_peer_states).
        period_s: seconds in which an empty bucket refills to its capacity (> 0).
        min_state_bytes: the smallest state size a cost is computed against, bytes (>= 1).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a capacity, period or floor out of the ranges above.
    """

    def __init__(
        self,
        *,
        per_peer_states: float,
        total_states: float,
        period_s: float,
        min_state_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not (0 < per_peer_states <= total_states) or period_s <= 0 or min_state_bytes < 1:
            raise ValueError(
                f"bad serve budget: per_peer_states={per_peer_states}, total_states={total_states}, "
                f"period_s={period_s}, min_state_bytes={min_state_bytes}"
            )
        self.per_peer_states, self.total_states = per_peer_states, total_states
        self.period_s, self.min_state_bytes, self.clock = period_s, min_state_bytes, clock
        self._levels: dict[Hashable, tuple[float, float]] = {}  # peer → (level, at); None → the shared bucket
        self.refused = 0
        """Requests refused so far."""

    def _level(self, key: Hashable, capacity: float, now: float) -> float:
        level, at = self._levels.get(key, (capacity, now))
        return min(capacity, level + (now - at) * capacity / self.period_s)

    def cost(self, request_bytes: int, state_bytes: int) -> float:
        """What a request for ``request_bytes`` of a state of ``state_bytes`` costs, in full states."""
        return request_bytes / max(state_bytes, self.min_state_bytes)

    def take(self, peer: Hashable, request_bytes: int, state_bytes: int) -> bool:
        """Charge ``peer`` for a request; False (nothing charged) when its bucket or the shared one
        does not hold the cost."""
        now, cost = self.clock(), self.cost(request_bytes, state_bytes)
        mine = self._level(("peer", peer), self.per_peer_states, now)
        shared = self._level("total", self.total_states, now)
        if cost > mine or cost > shared:
            self.refused += 1
            return False
        self._levels[("peer", peer)] = (mine - cost, now)
        self._levels["total"] = (shared - cost, now)
        if len(self._levels) > 4096:  # forget the buckets that are full again (peers long gone)
            self._levels = {
                k: v
                for k, v in self._levels.items()
                if k == "total" or self._level(k, self.per_peer_states, now) < self.per_peer_states
            }
        return True
