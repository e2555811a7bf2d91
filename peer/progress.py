"""The small types a round is told with: where a peer is inside its round, what a round came to,
and the counters over a whole run.

:class:`RoundProgress` is the position the inner lr schedule, checkpoints and progress records
read; :class:`RoundOutcome` is one finished round (the ``round`` event, the progress record's
last-sync fields); :class:`TrainSummary` adds outcomes up for ``peer join``'s ``stopped`` event
and ``peer swarm``'s summary. :class:`TransferProgress` draws a long transfer (a state download)
as it goes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO


@dataclass
class RoundProgress:
    """This peer's position in φ's history and the accumulators of its current round."""

    round: int = 0
    """Outer step t: rounds completed, adopted ones included."""
    step: int = 0
    """Inner steps done in the current round (0 at a round boundary)."""
    tokens: int = 0
    """Tokens behind this round's Δ (its weight in the group mean)."""
    loss_sum: float = 0.0
    """Sum of the training losses of this round's inner steps, nats per token."""
    compute_s: float = 0.0
    """Seconds spent in this round's inner steps."""
    steps_done: int = 0
    """Inner steps of this round that trained (a skipped step advances ``step`` only)."""

    def inner_step(self, inner_steps: int) -> int:
        """Cumulative inner steps of φ's history, ``round·H + step``: indexes the inner lr schedule."""
        return self.round * inner_steps + self.step

    def record(self, *, loss: float, tokens: int, seconds: float) -> None:
        """Account one inner step that trained."""
        self.step += 1
        self.tokens += tokens
        self.loss_sum += loss
        self.steps_done += 1
        self.compute_s += seconds

    def discard_step(self) -> None:
        """A step whose loss or gradient was not finite: θ went back to φ, so Δ covers only the steps
        after it (its weight starts again at 0); the step still counts, so the lr schedule is never
        rewound."""
        self.tokens = 0
        self.step += 1

    def start_round(self, round_: int, step: int = 0) -> None:
        """Be at ``step`` of round ``round_`` with empty accumulators."""
        self.round, self.step = round_, step
        self.tokens, self.loss_sum, self.compute_s, self.steps_done = 0, 0.0, 0.0, 0

    @property
    def train_loss(self) -> float:
        """Mean training loss of this round's inner steps, nats per token (0 before any)."""
        return self.loss_sum / max(1, self.steps_done)

    @property
    def step_s(self) -> float:
        """Mean seconds of this round's inner steps that trained (0 before any)."""
        return self.compute_s / self.steps_done if self.steps_done > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Inner-loop throughput of this round, tokens per second of compute."""
        return self.tokens / max(self.compute_s, 1e-9)


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """How one round's sync went, whatever its result (a peer alone has the defaults)."""

    group_size: int = 1
    """Peers in the group that averaged, this one included."""
    group: tuple[str, ...] = ()
    """Their peer ids (empty: this peer alone)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    sync_s: float = 0.0
    """Wall time of matchmaking plus all-reduce, s."""
    allreduce_s: float = 0.0
    """Of ``sync_s``, the all-reduce's (or pair exchange's) own seconds, from the group's start to
    the last mean read; the rest is the wait for the group and the hand-over between processes."""
    send_s: float = 0.0
    """Of ``allreduce_s``, the seconds from this peer's first byte sent to its last piece written."""
    deadline_s: float = 0.0
    """The bound the sync ran under, retry included, s."""
    attempts: int = 0
    """All-reduces tried: 0 (no sync), 1, or 2 after a retry."""
    note: str = ""
    """Why the round did not average with a full group ('' when it did)."""
    agreeing: tuple[str, ...] = ()
    """Groupmates that started from this peer's state and completed with it: after the round they
    hold the same state as this peer."""
    failed: bool = False
    """The sync was tried and failed (this peer applied its own payload)."""
    completed: tuple[str, ...] = ()
    """Groupmates (not this peer) that completed the sync with it in full: no one excluded, no
    piece averaged without one, so each exchanged its bytes with this peer. Empty otherwise. What
    this peer's ledger and its signed ``groupmates`` statement record (peer/state/vouching.py)."""
    overlap_steps: tuple[int, ...] = ()
    """Streaming: for each fragment sync of the round, the inner steps it overlapped (from its start
    to its mean landing; at least ``sync.fragment_delay_steps``). Empty otherwise."""
    kept_rows: tuple[tuple[int, int, int], ...] = ()
    """A blocking sync: the rows of this peer's Δ (payload tensor, first row, stop row) whose owner the
    group skipped or refused, applied as zeros: the landing keeps θ's progress there
    (peer/train/streaming.py ``land``). Empty otherwise; not combined across syncs."""


def combine_sync_reports(reports: list[SyncReport]) -> SyncReport:
    """One report for the syncs that landed in one round (Streaming DiLoCo syncs each fragment on
    its own): the smallest group and its members, bytes, seconds and attempts summed, the longest
    bound, the notes joined, and only the groupmates that agreed and completed in every sync.
    No reports: a peer alone (the defaults)."""
    if not reports:
        return SyncReport()
    smallest = min(reports, key=lambda r: r.group_size)
    agreeing = set.intersection(*(set(r.agreeing) for r in reports))
    completed = set.intersection(*(set(r.completed) for r in reports))
    return SyncReport(
        group_size=smallest.group_size,
        group=smallest.group,
        bytes_sent=sum(r.bytes_sent for r in reports),
        bytes_received=sum(r.bytes_received for r in reports),
        sync_s=sum(r.sync_s for r in reports),
        allreduce_s=sum(r.allreduce_s for r in reports),
        send_s=sum(r.send_s for r in reports),
        deadline_s=max(r.deadline_s for r in reports),
        attempts=sum(r.attempts for r in reports),
        note="; ".join(r.note for r in reports if r.note),
        agreeing=tuple(sorted(agreeing)),
        failed=any(r.failed for r in reports),
        completed=tuple(sorted(completed)),
        overlap_steps=tuple(s for r in reports for s in r.overlap_steps),
    )


@dataclass(frozen=True, kw_only=True)
class RoundOutcome:
    """One finished round of one peer: the fields of its ``round`` event."""

    round: int
    """The round this peer is at now (the one after the round that finished)."""
    train_loss: float
    tokens_per_s: float
    tokens: int
    peers: int
    """Live peers this peer knew of at its sync, itself included."""
    start_digest: str
    state_digest: str
    planned_group: tuple[str, ...] | None
    sync: SyncReport
    mfu: float | None = None
    """Model FLOPs utilisation of the inner steps in [0, 1] (peer/train/device.py); None without a peak."""
    micro_batch: int | None = None
    """Sequences per micro-batch at the round's end (None: the whole batch)."""
    compute_s: float = 0.0
    """Seconds this round's inner steps took (what compute utilization divides by wall time)."""
    sync_wait_s: float = 0.0
    """Seconds the training thread waited for a sync's mean since the last ``round`` event
    (blocking: the whole sync; ``sync.overlap``: only what a background sync still had to do)."""
    resync_wait_s: float = 0.0
    """Seconds the training thread spent in the re-sync rule's catch-up since the last ``round``
    event (after the previous round: waiting for finishing groupmates' records, state downloads)."""

    def event_fields(self, peer_id: str) -> dict[str, Any]:
        """The ``round`` event as reporting and the launchers read it."""
        s = self.sync
        return dict(
            round=self.round,
            train_loss=self.train_loss,
            tokens_per_s=self.tokens_per_s,
            group_size=s.group_size,
            sync_s=s.sync_s,
            allreduce_s=s.allreduce_s,
            send_s=s.send_s,
            bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received,
            peers=self.peers,
            peer_id=peer_id,
            group=list(s.group or (peer_id,)),
            note=s.note,
            planned_group=list(self.planned_group) if self.planned_group else None,
            tokens=self.tokens,
            attempts=s.attempts,
            start_digest=self.start_digest,
            agreeing=sorted({*s.agreeing, peer_id}),
            state_digest=self.state_digest,
            deadline_s=s.deadline_s,
            mfu=self.mfu,
            micro_batch=self.micro_batch,
            compute_s=self.compute_s,
            sync_wait_s=self.sync_wait_s,
            resync_wait_s=self.resync_wait_s,
            **({"overlap_steps": list(s.overlap_steps)} if s.overlap_steps else {}),
        )


@dataclass
class TrainSummary:
    """Counters over a whole run of one peer (the ``stopped`` event)."""

    peer_id: str
    rounds_completed: int = 0
    max_group_size: int = 1
    bytes_sent: int = 0
    bytes_received: int = 0
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    final_round: int = 0
    interrupted: bool = False
    failed_syncs: int = 0
    group_sizes: list[int] = field(default_factory=list)
    fatal: Exception | None = field(default=None, repr=False, compare=False)
    """Why the run stopped without a signal (a helper process died, :class:`~protocol.errors.HelperDied`):
    the caller writes the checkpoint, then raises it; None otherwise. Not part of the ``stopped`` event."""

    def record(self, outcome: RoundOutcome) -> None:
        s = outcome.sync
        self.rounds_completed += 1
        self.max_group_size = max(self.max_group_size, s.group_size)
        self.bytes_sent += s.bytes_sent
        self.bytes_received += s.bytes_received
        self.group_sizes.append(s.group_size)
        self.failed_syncs += int(s.failed)

    def event_fields(self) -> dict[str, Any]:
        """The ``stopped`` event's counters."""
        fields = asdict(self)
        fields.pop("peer_id")
        fields.pop("fatal")
        return fields


class TransferProgress:
    """A transfer's progress on ``stream`` (stderr: stdout carries a peer's events): a rich progress
    bar on a terminal, else a plain line at most every ``every_s`` seconds and one at the end, e.g.
    ``downloading the swarm's state: 12.0 of 48.0 MiB (25 %) from 3 peer(s), 4.1 MiB/s``.

    Args:
        what: what is transferred, for the line (``the swarm's state``).
        total_bytes: the transfer's size (> 0), bytes.
        stream: where to draw; default: ``sys.stderr`` at the time of the call.
        verb: what the line says is done (``reading`` for ``peer data prepare``'s input).
    """

    def __init__(
        self,
        what: str,
        total_bytes: int,
        *,
        stream: TextIO | None = None,
        every_s: float = 2.0,
        verb: str = "downloading",
    ):
        from rich.console import Console

        self.what, self.total, self.every_s, self.verb = what, max(1, int(total_bytes)), every_s, verb
        self.stream = stream or sys.stderr
        self.start = self._last = time.monotonic()
        self.done, self.detail = 0, ""
        console = Console(file=self.stream, stderr=self.stream is sys.stderr)
        self._bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self._bar = Progress(
                TextColumn(f"{verb} {what}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[detail]}"),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task(what, total=self.total, detail="")
            self._bar.start()

    def line(self) -> str:
        """The plain progress line of the transfer so far."""
        mib, seconds = 1 << 20, max(time.monotonic() - self.start, 1e-9)
        text = (
            f"{self.verb} {self.what}: {self.done / mib:.1f} of {self.total / mib:.1f} MiB "
            f"({100 * self.done / self.total:.0f} %)"
        )
        return text + (f" {self.detail}" if self.detail else "") + f", {self.done / mib / seconds:.1f} MiB/s"

    def update(self, done_bytes: int, detail: str = "") -> None:
        """Record that ``done_bytes`` of the transfer arrived (``detail``: e.g. ``from 3 peer(s)``)."""
        self.done, self.detail = min(int(done_bytes), self.total), detail
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, detail=detail)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        """Draw the final state (a plain line, or the bar's last frame) and stop drawing."""
        if self._bar is not None:
            self._bar.stop()
        else:
            print(self.line(), file=self.stream, flush=True)


class Waiting:
    """Says, while a long step runs, that it still runs: a rich spinner with the seconds elapsed on a
    terminal, else a plain line on ``stream`` every ``every_s`` seconds, e.g. ``still reading the
    run's data (10 s)``; nothing when the step ends before the first one is due. A context manager;
    the line that names the step is the caller's (printed before it enters).

    Args:
        what: the step, for the line (``reading the run's data``).
        stream: where to draw (stderr by default: stdout carries a peer's events).
        every_s: seconds between two plain lines (> 0); 4 s by default, so that no wait is silent
            for more than 5 s (issue #68).
        detail: called for each plain line, what to add after ``what`` (``inner step 7 of 20``);
            '' adds nothing.
    """

    def __init__(
        self,
        what: str,
        *,
        stream: TextIO | None = None,
        every_s: float = 4.0,
        detail: Callable[[], str] | None = None,
    ):
        if not every_s > 0:
            raise ValueError(f"every_s = {every_s}: must be > 0")
        self.what, self.every_s, self.detail = what, every_s, detail
        self.stream = stream or sys.stderr
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._status: Any = None
        self.lines = 0
        """Plain lines printed so far."""

    def __enter__(self) -> Waiting:
        from rich.console import Console

        self.start = time.monotonic()
        console = Console(file=self.stream, stderr=self.stream is sys.stderr)
        if console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._status = Progress(
                SpinnerColumn(), TextColumn(self.what), TimeElapsedColumn(), console=console, transient=True
            )
            self._status.add_task(self.what, total=None)
            self._status.start()
        else:
            self._thread = threading.Thread(target=self._tick, name="waiting", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(self.every_s):
            elapsed = time.monotonic() - self.start
            try:
                more = self.detail() if self.detail is not None else ""
                print(f"still {self.what}{': ' + more if more else ''} ({elapsed:.0f} s)", file=self.stream, flush=True)
            except (OSError, ValueError):  # the stream closed under a process on its way out
                return
            self.lines += 1

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop saying it (the step ended); idempotent: a caller may end it before its ``with`` does."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._status is not None:
            self._status.stop()
            self._status = None
