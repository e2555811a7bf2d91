"""One sync at a time in a background thread, so the inner loop never waits on the network.

With ``sync.overlap`` (peer/train/overlap.py) the round loop hands round t's payload to
:class:`BackgroundSync` and trains round t+1 while it averages; at the end of round t+1 it takes
the result with :meth:`BackgroundSync.result` (waiting only if the sync is slower than a round).
The transport's averager serves one all-reduce at a time; the single worker thread keeps it so.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peer.net import lifetime
from peer.progress import SyncReport

logger = logging.getLogger(__name__)

SyncCall = Callable[[Callable[[], bool]], "tuple[Any, ...]"]
"""Runs one sync and returns (mean payload, or the peer's own payload when it failed; its report),
optionally followed by what the call prepared from the mean in its thread (an outer step computed
off the training thread: :meth:`BackgroundSync.take` hands it back); it must not raise for a failed
sync (failed rounds are recorded, not fatal). Its argument tells whether the sync was dropped: the
call polls it while it waits and gives up (as on a stop)."""


@dataclass(frozen=True)
class Landed:
    """A sync's result as the round loop takes it."""

    mean: list[torch.Tensor]
    """The group's mean payload, or this peer's own when the sync failed."""
    report: SyncReport
    round: int
    """The round whose payload was averaged."""
    prepared: Any = None
    """What the call prepared from the mean in the sync's thread (None: nothing)."""


@dataclass
class _InFlight:
    round: int
    """The round whose payload is being averaged."""
    start_digest: str
    """Digest of the state this peer held when the sync started (peer/state/snapshot.py)."""
    future: concurrent.futures.Future
    dropped: threading.Event
    """Set by :meth:`BackgroundSync.drop`: the call gives up at its next poll."""


class BackgroundSync:
    """Runs sync calls in one worker thread, one at a time, and hands their results back in order.

    Not thread-safe itself: one thread (the round loop) calls every method.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="locoswarm-sync", initializer=lifetime.yield_to_training
        )
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a sync was started and its result not yet taken (or dropped)."""
        return self._in_flight is not None

    @property
    def done(self) -> bool:
        """Whether the sync in flight finished (its result can be taken without waiting); False
        when nothing is in flight."""
        return self._in_flight is not None and self._in_flight.future.done()

    @property
    def round(self) -> int | None:
        """The round of the sync in flight, or None."""
        return None if self._in_flight is None else self._in_flight.round

    def start(self, call: SyncCall, *, round_: int, start_digest: str) -> None:
        """Start ``call`` in the worker thread; returns at once.

        Raises:
            RuntimeError: a sync is already in flight (take or drop its result first).
        """
        if self._in_flight is not None:
            raise RuntimeError(f"round {round_}: the sync of round {self._in_flight.round} is still in flight")
        dropped = threading.Event()
        self._in_flight = _InFlight(round_, start_digest, self._pool.submit(call, dropped.is_set), dropped)

    def result(self, timeout_s: float | None = None) -> tuple[list[torch.Tensor], SyncReport, int]:
        """Wait for the sync in flight and return (mean payload, report, its round); nothing is then in flight.

        Raises:
            RuntimeError: nothing in flight.
            TimeoutError: not done within ``timeout_s``; it stays in flight.
        """
        landed = self.take(timeout_s)
        return landed.mean, landed.report, landed.round

    def take(self, timeout_s: float | None = None) -> Landed:
        """Wait for the sync in flight and return all it returned; nothing is then in flight.

        Raises:
            RuntimeError: nothing in flight.
            TimeoutError: not done within ``timeout_s``; it stays in flight.
        """
        if self._in_flight is None:
            raise RuntimeError("no sync in flight")
        mean, report, *prepared = self._in_flight.future.result(timeout=timeout_s)
        done, self._in_flight = self._in_flight, None
        return Landed(mean, report, done.round, prepared[0] if prepared else None)

    def drop(self, why: str) -> None:
        """Forget the sync in flight (its result will never be applied): this peer adopted another
        state, or is stopping. The call is told to give up (the flag it polls), so the next
        :meth:`start`, which queues behind it, is not held up to the dropped sync's deadline: a
        peer that adopted a state would otherwise reach its next group late and miss it."""
        if self._in_flight is not None:
            logger.info("round %d: in-flight sync dropped (%s)", self._in_flight.round, why)
            self._in_flight.dropped.set()
            self._in_flight = None

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker thread (after the running call, with ``wait``)."""
        if self._in_flight is not None:
            self._in_flight.dropped.set()
        self._in_flight = None
        self._pool.shutdown(wait=wait, cancel_futures=True)


class InlineSync:
    """:class:`BackgroundSync`'s interface for a sync with no delay: :meth:`start` only takes the call,
    and :meth:`result` runs it on the calling thread, when its mean is needed, which for a schedule
    with no delay is at once (the blocking schedule, peer/round/blocking.py). Nothing runs in the
    background, so nothing is ever dropped half-way."""

    def __init__(self) -> None:
        self._call: tuple[SyncCall, int] | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a call was started and its result not yet taken."""
        return self._call is not None

    @property
    def done(self) -> bool:
        """False: the call runs only when its result is asked for."""
        return False

    @property
    def round(self) -> int | None:
        return None if self._call is None else self._call[1]

    def start(self, call: SyncCall, *, round_: int, start_digest: str) -> None:
        """Take ``call`` to run at :meth:`result`.

        Raises:
            RuntimeError: a call is already waiting for its result to be taken.
        """
        if self._call is not None:
            raise RuntimeError(f"round {round_}: the sync of round {self._call[1]} was not taken")
        self._call = (call, round_)

    def result(self, timeout_s: float | None = None) -> tuple[list[torch.Tensor], SyncReport, int]:
        """Run the call now, on this thread, and return (mean payload, report, its round).

        Raises:
            RuntimeError: nothing started.
            HelperDied: what the call raises (nothing of it applied).
        """
        landed = self.take(timeout_s)
        return landed.mean, landed.report, landed.round

    def take(self, timeout_s: float | None = None) -> Landed:
        """Run the call now, on this thread, and return all it returned.

        Raises:
            RuntimeError: nothing started.
            HelperDied: what the call raises (nothing of it applied).
        """
        if self._call is None:
            raise RuntimeError("no sync started")
        (call, round_), self._call = self._call, None
        mean, report, *prepared = call(lambda: False)
        return Landed(mean, report, round_, prepared[0] if prepared else None)

    def drop(self, why: str) -> None:
        """Forget a call not run yet."""
        self._call = None

    def shutdown(self, wait: bool = True) -> None:
        self._call = None
