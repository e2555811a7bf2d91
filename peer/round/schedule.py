"""The sync-schedule interface: when each part of the model is sent and when its mean lands.

The round loop (peer/round/engine.py) is the same for every sync mode; what differs is only the
schedule it drives:

- :class:`~peer.round.blocking.BlockingSchedule` (``sync.overlap = "none"``): the whole model at
  the round's end, its mean applied before the next round starts (DiLoCo, arXiv 2311.08105,
  Algorithm 1; NoLoCo, arXiv 2506.10911);
- :class:`~peer.round.overlapped.OverlapSchedule` (``"delayed"``, ``"eager"``): the whole model at
  the round's end, its mean landing at the end of the next round (DiLoCoX's one-step delay, arXiv
  2506.21263; eager updates, arXiv 2502.12996), blocking before ``sync.overlap_from_round``;
- :class:`~peer.round.streamed.StreamingSchedule` (``"streaming"``): P fragments at staggered
  offsets inside the round, each mean landing τ inner steps later (Streaming DiLoCo, arXiv
  2501.18512). With P = 1 and τ = 0 it is the blocking schedule's round, told per fragment.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

import torch

from peer.progress import RoundProgress, SyncReport
from peer.reporting import Reporter
from peer.round.records import RecordReads
from peer.round.state import RoundState
from peer.round.syncing import GroupSync, SyncHistory
from peer.round.timing import Timing
from peer.sync.background import BackgroundSync, InlineSync
from peer.train.outer import GroupChoice
from peer.train.step_bound import finite_norm


class OwnDelta:
    """This peer's own Δ of a sync in flight, kept only as far as its landing needs it: the norm that
    bounds the outer step's change of φ (peer/train/step_bound.py ``check_step_bound``) and the cap on a
    weight over this peer's weight in the sync.

    :meth:`settle` takes the norm and lets go of the tensors; the sync's call does it as soon as
    the group's mean is there (a failed sync's mean is the payload itself, which the sync keeps), so
    no landing holds a copy of Δ beside the mean and the outer step's new tensors.

    Args:
        delta: fp32 host tensors, this peer's Δ (its payload's Δ part) of the tensors synced.
        scale: the run's cap on a weight over this peer's weight (≥ 1).
    """

    def __init__(self, delta: list[torch.Tensor], scale: float):
        self._delta: list[torch.Tensor] | None = list(delta)
        self._norm: float | None = None
        self.scale = scale

    def settle(self) -> float:
        """‖Δ‖ (L2 over every tensor, accumulated in float64; inf when a value is not finite),
        computed once; the tensors are dropped here. Safe to call from the sync's thread before the
        landing takes its result (the landing reads it only after that)."""
        if self._norm is None:
            assert self._delta is not None
            self._norm, self._delta = finite_norm(self._delta), None
        return self._norm


@dataclasses.dataclass(frozen=True)
class RoundEnd:
    """What a schedule reports of a round it ended (the engine turns it into the ``round`` event)."""

    done: RoundProgress
    """The finished round's position and counters, taken before the position moved on."""
    live: list
    """The live records the round's group choice came from."""
    start_digest: str
    """Digest of the state the round started from."""
    choice: GroupChoice
    report: SyncReport
    """The sync that landed at this round's end (overlap: the last round's; streaming: the fragment
    syncs that landed during the round)."""


class SyncSchedule(Protocol):
    """When a round's parts are sent and when their means land. Every method runs on the training
    thread; a schedule may run syncs in a background thread (peer/sync/background.py)."""

    def synced_blocking(self, round_: int) -> bool:
        """Whether round ``round_``'s sync held the round loop until its mean was applied."""
        ...

    def after_step(self, tokens: int) -> None:
        """After each inner step that trained ``tokens`` tokens (streaming starts and lands fragments)."""
        ...

    def trains_while_waiting(self) -> bool:
        """Past the round's H steps: whether to take one more inner step instead of waiting."""
        ...

    def records_needed_at(self) -> int:
        """The inner step of this round at which the loop next reads the progress records."""
        ...

    def restart_round(self) -> None:
        """After a non-finite inner step: θ back to where this round started, its progress dropped."""
        ...

    def end_round(self) -> RoundEnd:
        """The round's end: sync (or start syncing), apply what landed, move the position to the
        next round, take its snapshot, and set θ to where the next round starts."""
        ...

    def finish(self) -> None:
        """Training ended: land the sync in flight at ``max_rounds``, drop it on a stop."""
        ...

    def close(self) -> None:
        """Stop any background thread (a sync in flight is abandoned)."""
        ...

    def holds_leaders_back(self) -> bool:
        """Whether the re-sync rule leaves out records one round ahead (a sync in flight brings
        this peer there)."""
        ...

    def before_adopt(self, round_: int) -> None:
        """Before φ is replaced by a downloaded state of ``round_`` (keep or drop a sync in flight)."""
        ...

    def after_adopt(self) -> None:
        """After φ was replaced and θ ← φ."""
        ...

    def after_restore(self, round_step: int, round_tokens: int) -> None:
        """After a checkpoint was restored at ``round_step`` of its round."""
        ...


class ScheduleBase:
    """What every schedule holds: the round's state, the group sync, the sync history, the record
    reads; and the defaults of a schedule that syncs once at the round's end."""

    def __init__(
        self,
        *,
        state: RoundState,
        sync: GroupSync,
        history: SyncHistory,
        records: RecordReads,
        reporter: Reporter,
        stop_event: threading.Event,
        timing: Timing | None = None,
    ):
        self.state, self.sync, self.history, self.records = state, sync, history, records
        self.reporter, self.stop_event, self.timing = reporter, stop_event, timing or Timing()

    def synced_blocking(self, round_: int) -> bool:
        return True

    def after_step(self, tokens: int) -> None:
        pass

    def trains_while_waiting(self) -> bool:
        return False

    def records_needed_at(self) -> int:
        return self.state.H

    def restart_round(self) -> None:
        self.state.set_theta_to_phi()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def holds_leaders_back(self) -> bool:
        return False

    def before_adopt(self, round_: int) -> None:
        pass

    def after_adopt(self) -> None:
        pass

    def after_restore(self, round_step: int, round_tokens: int) -> None:
        pass

    def guard_phi(self) -> None:
        """At a round's end, before its snapshot: roll a non-finite or exploded φ back to the last
        snapshot (``RoundState.guard_phi``) and warn."""
        problem = self.state.guard_phi()
        if problem:
            self.reporter.emit("warning", message=problem)

    def _choose(self) -> tuple[list, GroupChoice]:
        """The live records for this round's group choice and the choice."""
        live = self.records.for_round(self.state.pos.round)
        return live, self.sync.choose(self.state.pos.round, live)


class BackgroundSchedule(ScheduleBase):
    """A schedule whose syncs run in a background thread while the next inner steps train (one sync
    in flight at a time, peer/sync/background.py), or, with :attr:`inline`, on the training thread."""

    inline = False
    """Whether the syncs run on the training thread when their mean is needed (no delay) instead of
    in the background thread (peer/sync/background.py ``InlineSync``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.background: BackgroundSync | InlineSync = InlineSync() if self.inline else BackgroundSync()
        self.adopted_in_flight = False
        """This peer adopted a state while the sync in flight ran, and kept that sync (its mean
        belongs to the adopted φ: :meth:`before_adopt`)."""

    def take_background(self) -> tuple[list[torch.Tensor] | None, SyncReport, Any]:
        """The sync in flight's mean, report and what its thread prepared from the mean (waiting for
        it if needed); no mean when it failed after this peer adopted another state (its own payload
        belongs to the φ it left)."""
        start = time.monotonic()
        landed = self.background.take()
        self.state.waited["sync"] += time.monotonic() - start
        self.history.last_failed = landed.report.failed
        adopted, self.adopted_in_flight = self.adopted_in_flight, False
        return (None if adopted and landed.report.failed else landed.mean), landed.report, landed.prepared

    def extra_steps_left(self) -> bool:
        """Whether the round may still take a step past H while a sync is out (``Timing.extra_steps_fraction``)."""
        return self.state.pos.step < self.state.H + int(self.timing.extra_steps_fraction * self.state.H)

    def close(self) -> None:
        self.background.shutdown(wait=False)

    def holds_leaders_back(self) -> bool:
        """With a sync in flight (and the last landed one not failed), records one round ahead are
        left out of the re-sync rule: nothing holds peers together at a round's end, so a faster
        groupmate leads by up to a round, and its state is this peer's own next one once that sync
        lands."""
        return self.background.in_flight and not self.history.last_failed
