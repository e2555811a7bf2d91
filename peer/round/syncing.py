"""One sync with the group, as every sync schedule makes it: the group choice, the wait budgets,
the transport call and what its result says about who holds this peer's state afterwards.

:class:`GroupSync` reads no state of the round loop, so a schedule may run it in the background
thread (peer/sync/background.py). :class:`SyncHistory` is what the last landed sync leaves
behind: the peers that hold this peer's state, its vouched groupmates and who averaged with it
from another state (the re-sync rule and the progress records read it).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch

from peer.net.traffic import SatOut
from peer.progress import RoundProgress, SyncReport, Waiting
from peer.reporting import Reporter
from peer.round.timing import Timing
from peer.state.vouching import Vouching
from peer.sync.membership import RoundSwarm
from peer.sync.transport import RoundTransport, SyncRequest
from peer.train.outer import GroupChoice, OuterAlgorithm, check_finite
from protocol.errors import BadPayload, SyncError
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)

SAT_OUT_POLL_S = 0.5
"""How often a peer that sat out a sync reads the records while it waits for the swarm's round (s)."""
SWARM_STALL_S = 10.0
"""A peer that sat out a sync stops waiting for the swarm's round once the other peers made no progress
(no record with a later inner step) for this long, or for the longest sync if that is longer (s)."""


def swarm_round(records: Sequence) -> int | None:
    """The swarm's round: the lower median of the rounds of ``records`` (the other peers' live
    progress records, ``peer.net.dht.PeerProgress``), None without any. A median, so that neither a
    straggler nor one peer ahead moves it."""
    rounds = [r.record.round for r in records]
    return statistics.median_low(rounds) if rounds else None


def wait_budget_s(progress: RoundProgress, steps: int) -> float:
    """How long a sync started now in the background may wait for late groupmates
    (peer/sync/deadlines.py ``wait_budget_s``): the inner-step time of the ``steps`` steps after
    which its mean is needed (delayed and eager: a round; streaming: H/P steps, when the next
    fragment's sync starts), at ``progress``'s seconds per step. A groupmate that comes at the very
    end costs the others the all-reduce's time at the landing; one that misses the group costs
    itself a failed sync and a state download. 0 before any step was timed."""
    return steps * progress.step_s


class GroupSync:
    """The group choice and the sync of one payload with that group (DiLoCo's all-reduce, or
    NoLoCo's exchange with partners), over ``transport``."""

    def __init__(
        self,
        *,
        manifest: RunManifest,
        outer: OuterAlgorithm,
        swarm: RoundSwarm,
        transport: RoundTransport,
        reporter: Reporter,
        stop_event: threading.Event,
        timing: Timing,
    ):
        self.m, self.outer, self.swarm, self.transport = manifest, outer, swarm, transport
        self.reporter, self.stop_event, self.peer_id = reporter, stop_event, swarm.peer_id
        self.whole_delta = timing.whole_delta
        """Each sync's Δ is one round's training alone (``SyncRequest.whole_delta``)."""
        self.carry_skipped = timing.carries_skipped
        """A skipped Δ piece is carried into the next contribution (``SyncRequest.carry_skipped``); else
        its rows are in the report's ``kept_rows``."""
        self.fragments = 0
        """Streaming: how many fragments the model syncs in (0 otherwise)."""
        self.fragment_payload: list[list[int]] = []
        """Streaming: each fragment's payload tensor indices (its own key and buffers)."""

    def choose(self, round_: int, live: list) -> GroupChoice:
        """Whom this peer syncs with in ``round_``, from the live records (the outer algorithm's rule)."""
        return self.outer.choose_group(
            self.peer_id,
            round_=round_,
            run_id=self.m.run_id,
            live=[(r.peer_id, r.record.round) for r in live if r.peer_id != self.peer_id],
        )

    def groupmates_due_s(self, live: list, round_: int, choice: GroupChoice) -> float:
        """Seconds until the last groupmate expected at ``round_``'s sync gets there, predicted from
        ``live`` (progress records: step and throughput); the matchmaking window covers it."""
        if choice.expected_size <= 1:
            return 0.0
        return self.swarm.seconds_to_finish(
            round_,
            live,
            inner_steps=self.m.sync.inner_steps,
            batch_size_tokens=self.m.inner_optimizer.batch_size_tokens,
            peers=set(choice.members) if choice.members else None,
        )

    def sync(
        self,
        payload: list[torch.Tensor],
        choice: GroupChoice,
        start_digest: str,
        *,
        round_: int,
        weight: float,
        expected_wait_s: float = 0.0,
        wait_budget_s: float = 0.0,
        fragment: int | None = None,
        dropped: Callable[[], bool] = lambda: False,
    ) -> tuple[list[torch.Tensor], SyncReport]:
        """The group's token-weighted mean payload, or this peer's own when there is no group or
        the sync fails (failed rounds are recorded, not fatal: DiLoCo paper Fig. 8).

        Args:
            payload: fp32 host tensors (``OuterAlgorithm.payload``); not modified.
            choice: the round's group choice (:meth:`choose`).
            start_digest: the digest of the state this peer started the round from.
            weight: tokens this payload trained (its weight in the group mean).
            expected_wait_s: until the last expected groupmate arrives (:meth:`groupmates_due_s`).
            wait_budget_s: a background sync's (:func:`wait_budget_s`); 0 for a blocking one.
            fragment: streaming, the fragment whose tensors ``payload`` holds.
            dropped: a background sync's flag (peer/sync/background.py): it gives up, as on a stop.

        Returns:
            (mean, report): the mean is new fp32 tensors shaped like ``payload``, or ``payload``
            itself when the sync failed (``report.failed``) or there was no group.

        Raises:
            HelperDied: this peer's averager process died (nothing is applied).
        """
        if choice.expected_size <= 1:
            return payload, SyncReport(note=choice.note)
        # the ``sync`` event comes from the thread that syncs: a background sync's emit (a write to
        # stdout) is then not the inner loop's time
        self.reporter.emit(
            "sync",
            round=round_,
            expected_group_size=choice.expected_size,
            peer_id=self.peer_id,
            **({} if fragment is None else {"fragment": fragment}),
        )
        start = time.monotonic()

        def should_stop() -> bool:
            return self.stop_event.is_set() or dropped()

        request = SyncRequest(
            weight=weight,
            round_=round_,
            expected_group_size=choice.expected_size,
            group_index=choice.index,
            start_digest=start_digest,
            should_stop=should_stop,
            expected_wait_s=expected_wait_s,
            wait_budget_s=wait_budget_s,
            whole_delta=self.whole_delta,
            carry_skipped=self.carry_skipped,
            # a fragment's tensors, with its own key and buffers
            fragment=fragment,
            fragments=1 if fragment is None else self.fragments,
            tensors=None if fragment is None else self.fragment_payload[fragment],
        )
        try:
            result = self.transport.average(payload, request=request)
            check_finite(result.mean, "the group's mean payload")
        except SyncError as exc:
            if isinstance(exc, SatOut) and fragment is None:  # the day's budget: keep to the swarm's round
                exc = SatOut(f"{exc}; {self.keep_to_swarm(round_, should_stop)}")
            return payload, self._failed(
                exc, round_, time.monotonic() - start, exc.bytes_sent, exc.bytes_received, exc.deadline_s
            )
        except BadPayload as exc:
            return payload, self._failed(exc, round_, time.monotonic() - start, 0, 0, 0.0)
        # groupmates that started from this peer's state hold the same state after the round
        refused = set(result.refused)  # owners whose means it refused vouch for nothing
        agreeing = [p for p, d in (result.start_digests or {}).items() if d == start_digest and p not in refused]
        completed = [p for p in result.group if p != self.peer_id and p not in refused]
        note = ""
        if refused:
            note = (
                f"refused the means of {result.refused_pieces} piece(s) from "
                f"{', '.join(sorted(refused))} (applied as zeros / own values)"
            )
        if result.excluded or result.partial_pieces:
            agreeing = completed = []  # which groupmates completed is not known here
            partial = f"{result.partial_pieces} piece(s) averaged without a failed groupmate ({result.excluded} excluded here)"
            note = "; ".join(filter(None, [note, partial]))
        elif result.unread_receipts:  # groupmates that read them may have skipped other owners
            agreeing = []
            unread = f"the receipts of {result.unread_receipts} groupmate(s) not read: their verdict may differ"
            note = "; ".join(filter(None, [note, unread]))
        return result.mean, SyncReport(
            group_size=result.group_size,
            group=tuple(result.group),
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            sync_s=result.seconds,
            allreduce_s=result.allreduce_s,
            send_s=result.send_s,
            deadline_s=result.deadline_s,
            attempts=result.attempts,
            note=note,
            agreeing=tuple(agreeing),
            completed=tuple(completed),
            kept_rows=result.kept_rows,
        )

    def keep_to_swarm(self, round_: int, should_stop: Callable[[], bool]) -> str:
        """After this peer sat out the sync of ``round_`` (``--max-gb-per-day``, peer/net/traffic.py),
        wait as the sync would have: until the swarm's round (:func:`swarm_round` of the other live
        peers' records) is past ``round_``, so that a peer whose rounds go faster without matchmaking
        and all-reduce does not run ahead of the swarm in round number (and then find no group when
        it syncs again). Nothing is waited for without other peers or when the swarm is past
        ``round_`` already (a peer behind stays behind: it claims only the rounds it trained).
        Whole-model syncs only: a streaming round's end does not wait for its fragments' syncs, so
        sitting them out does not make it shorter.

        The wait ends on ``should_stop``, or once the other peers made no progress (no record with a
        later inner step) for :data:`SWARM_STALL_S` or ``swarm.max_sync_s`` if longer: a hung swarm
        does not hold this peer. A wait over 5 s says what it waits for (``Waiting``).

        Returns:
            What happened, for the round's note: "waited 3.2 s for the swarm to finish round 7", or
            why nothing was waited for.
        """
        start, stall_s = time.monotonic(), max(SWARM_STALL_S, self.swarm.max_sync_s)
        others = self.swarm.others()
        current = swarm_round(others)
        if current is None:
            return "no other peer to keep pace with"
        if current > round_:
            return f"the swarm is at round {current} already"
        steps = {r.peer_id: r.record.inner_step for r in others}
        moved = start
        what = f"waiting for the swarm to finish round {round_} (this peer sat out its sync)"
        with Waiting(what):
            while not should_stop() and time.monotonic() - moved < stall_s:
                self.stop_event.wait(SAT_OUT_POLL_S)
                others = self.swarm.others()
                current = swarm_round(others)
                if current is None or current > round_:
                    break
                for r in others:
                    if r.record.inner_step > steps.get(r.peer_id, -1):
                        steps[r.peer_id], moved = r.record.inner_step, time.monotonic()
        waited = time.monotonic() - start
        if current is not None and current <= round_:
            return f"the swarm stayed at round {current} for {waited:.1f} s; going on"
        return f"waited {waited:.1f} s for the swarm to finish round {round_}"

    @staticmethod
    def _failed(exc: Exception, round_: int, seconds: float, sent: int, received: int, deadline_s: float) -> SyncReport:
        note = f"no group: applied own step ({exc})"
        logger.info("round %d: %s", round_, note)
        return SyncReport(
            bytes_sent=sent, bytes_received=received, sync_s=seconds, deadline_s=deadline_s, note=note, failed=True
        )


class SyncHistory:
    """What this peer's last landed sync says about the swarm around it."""

    def __init__(self, peer_id: str, vouching: Vouching):
        self.peer_id, self.vouching = peer_id, vouching
        self.completed_with: tuple[str, ...] = (peer_id,)
        """Who holds this peer's state after its last sync (its own class in the re-sync rule)."""
        self.groupmates: tuple[str, ...] = ()
        """Who completed this peer's last sync with it: its signed statement in every record."""
        self.disagreed: set[str] = set()
        """Groupmates of the last sync that landed who had started it from another state."""
        self.last_failed = False
        """With overlap: the last sync that landed failed (this peer applied its own payload)."""

    def note_group(self, round_: int, report: SyncReport) -> None:
        """Remember, of the sync of ``round_`` that just landed, who holds this peer's state after it,
        who completed it with this peer in full (its ledger of vouchers, and the statement its next
        records sign), and who averaged with it from another state (catch-up waits for their next
        records)."""
        self.completed_with = tuple(sorted({*report.agreeing, self.peer_id}))
        self.vouching.ledger.record_group(round_, report.completed)
        self.groupmates = tuple(sorted(report.completed))
        self.disagreed = set(report.group) - set(report.agreeing) - {self.peer_id}

    def forget(self) -> None:
        """After adopting another state: none of its last groupmates hold it."""
        self.completed_with, self.groupmates = (self.peer_id,), ()
        self.disagreed, self.last_failed = set(), False
