"""Sync deadlines that follow the swarm instead of fixed guesses (hivemind issue 676).

A peer waits for groupmates (matchmaking) and then for the all-reduce. Fixed timeouts are either
too short for a slow swarm (rounds fail) or too long when a peer dies (every survivor waits the
whole timeout). :class:`DeadlinePolicy` derives both from what this peer observed in its recent
rounds, clamped to the bounds of the run manifest:

* matchmaking time = 1.5 × the longest recent wait for the group (from this peer's arrival at
  the sync to the start of the all-reduce: the spread of the groupmates' arrival times) + 0.5 s;
  a sync that found no group although groupmates were expected counts as a wait that filled its
  whole window, so the window grows 1.5× after each miss (up to the manifest's bound) until the
  expected groupmates fit in it again; and at least the time until the last groupmate this peer
  expects arrives, predicted from its progress record (step and throughput) + 1 s, so a window
  learned from fast rounds does not close on a groupmate known to be seconds away; a sync in the
  background (``sync.overlap``) waits at least its *wait budget* (the inner-step time until its
  mean is needed: the round loop's choice) plus the manifest's bound, since its waiting costs the
  inner loop nothing for the budget and then what a blocking sync's would, and peers that
  overlap drift apart by up to a round;
* all-reduce timeout = 3 × the longest recent all-reduce + 2 s, and at least
  2 × ``next_chunk_timeout_s`` + 5 s, so that a groupmate that hangs is detected (and left out,
  or the round reported incomplete and retried) before the deadline ends the round.

Before any round has been observed, or with ``adaptive = false`` in the manifest, the manifest's
values are used. Every value stays within ``[min, max]`` of ``SyncSpec``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from protocol.manifest import SyncSpec

WINDOW = 8
"""Rounds of history the deadlines follow."""

ARRIVAL_MARGIN_S = 1.0
"""Added to the predicted arrival of the last expected groupmate (records are a quarter round old
and throughput varies)."""


@dataclass(frozen=True)
class Deadlines:
    matchmaking_s: float
    """How long the leader of a group waits for more groupmates before it starts with those found."""
    matchmaking_deadline_s: float
    """How long a peer keeps looking for a group at all (three matchmaking windows)."""
    allreduce_s: float
    """Deadline of the all-reduce once the group is formed."""

    @property
    def total_s(self) -> float:
        """Upper bound on one sync: matchmaking deadline + all-reduce deadline + 5 s of slack for the
        processes to hand results over."""
        return self.matchmaking_deadline_s + self.allreduce_s + 5.0


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, value))


class DeadlinePolicy:
    """Deadlines of the next sync from the last :data:`WINDOW` observed ones.

    Args:
        sync: the manifest's sync section (bounds, initial values, ``adaptive_deadlines``).
    """

    def __init__(self, sync: SyncSpec):
        self.sync = sync
        self._waits: deque[float] = deque(maxlen=WINDOW)
        self._allreduces: deque[float] = deque(maxlen=WINDOW)

    def observe(self, *, wait_s: float, allreduce_s: float) -> None:
        """Record one completed sync: seconds from arrival to the all-reduce's start, and its length.

        Raises:
            ValueError: a negative or non-finite duration.
        """
        for name, value in (("wait_s", wait_s), ("allreduce_s", allreduce_s)):
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} = {value!r}: expected a finite duration >= 0 s")
        self._waits.append(wait_s)
        self._allreduces.append(allreduce_s)

    def observe_missed_group(self, matchmaking_s: float) -> None:
        """Record a sync whose window of ``matchmaking_s`` seconds closed without the groupmates this
        peer expected (they arrived later, e.g. after evaluating φ or downloading a state): it counts
        as a wait of the whole window, so the next window is 1.5× it + 0.5 s (clamped).

        Raises:
            ValueError: a negative or non-finite duration.
        """
        if not matchmaking_s >= 0 or matchmaking_s == float("inf"):
            raise ValueError(f"matchmaking_s = {matchmaking_s!r}: expected a finite duration >= 0 s")
        self._waits.append(matchmaking_s)

    def current(self, *, expected_wait_s: float = 0.0, wait_budget_s: float = 0.0) -> Deadlines:
        """The next sync's deadlines.

        Args:
            expected_wait_s: how long until the groupmates this peer expects arrive, by their
                progress records (``SwarmView.seconds_to_finish``); the matchmaking window is at
                least that + :data:`ARRIVAL_MARGIN_S`, within the manifest's bound. Without it the
                window follows the past only, and the first rounds (whose history is a start
                barrier's, when every peer arrived at once) close before a groupmate a second
                slower arrives.
            wait_budget_s: a sync in the background: seconds it may wait for late groupmates
                without the inner loop waiting for its mean; the window is at least this plus the
                manifest's bound (0, a blocking sync: the window stays within the bound). Its
                ``matchmaking_deadline_s`` is three windows, as always.

        Raises:
            ValueError: a negative or non-finite ``expected_wait_s`` or ``wait_budget_s``.
        """
        for name, value in (("expected_wait_s", expected_wait_s), ("wait_budget_s", wait_budget_s)):
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} = {value!r}: expected a finite duration >= 0 s")
        s = self.sync
        if not s.adaptive_deadlines or not self._allreduces:
            mm, ar = s.matchmaking_time_s, s.allreduce_timeout_s
        else:
            mm = _clamp(1.5 * max(self._waits) + 0.5, s.min_matchmaking_time_s, s.matchmaking_time_s)
            if expected_wait_s > 0:
                mm = max(mm, min(s.matchmaking_time_s, expected_wait_s + ARRIVAL_MARGIN_S))
            floor = max(s.min_allreduce_timeout_s, 2 * s.next_chunk_timeout_s + 5.0)
            ar = _clamp(3.0 * max(self._allreduces) + 2.0, min(floor, s.allreduce_timeout_s), s.allreduce_timeout_s)
        # In the background a longer window costs the inner loop nothing until the mean is needed:
        # matchmaking starts the all-reduce as soon as the expected groupmates joined, so the window
        # only matters for a groupmate that is late, and peers drift apart by up to a round with
        # nothing holding them together at a round's end (a blocking sync is that barrier). Past
        # the budget it waits as long as a blocking sync would (the manifest's bound).
        if wait_budget_s > 0:
            mm = max(mm, wait_budget_s + s.matchmaking_time_s)
        return Deadlines(matchmaking_s=mm, matchmaking_deadline_s=3 * mm, allreduce_s=ar)

    def worst_case(self) -> Deadlines:
        """The deadlines at their upper bounds: what any sync can take at most."""
        s = self.sync
        return Deadlines(
            matchmaking_s=s.matchmaking_time_s,
            matchmaking_deadline_s=3 * s.matchmaking_time_s,
            allreduce_s=s.allreduce_timeout_s,
        )
