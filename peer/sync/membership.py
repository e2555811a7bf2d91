"""This peer's view of the swarm: who is live, from the progress records in the DHT.

Every peer republishes its record (protocol/records.py) four times per round and after every
round; a record not refreshed for two of this peer's recent rounds belongs to a peer that is
gone, hung or cut off. The round loop asks this view whom to expect in a group, which states
the swarm holds (for the re-sync rule) and whether a start barrier is met.

With :meth:`SwarmView.start_background` a daemon thread signs and stores this peer's records and
reads the swarm's ahead of time (:meth:`SwarmView.prefetch`), so neither is the inner loop's
time: an RSA signature per record and a DHT read per round (issue #18).

Identities cost weight (issue #51, item 5): anyone can sign records with fresh identities, and
20,000 of them once made every round's expected group 4,096 peers that never came. A view given a
ledger (:meth:`SwarmView.trust`: the peers this peer completed an all-reduce with,
peer/state/vouching.py) counts as live only its trusted peers (:func:`weigh`: the ledger's peers
and, transitively, the groupmates their signed records name) plus a bounded number of newcomers.
So group sizing, NoLoCo partners and the start barrier come from peers that did the work.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

from hivemind.utils import get_dht_time

from peer.net import dht as swarm_dht
from protocol.records import ProgressRecord
from protocol.signing import PeerSigner

logger = logging.getLogger(__name__)

CLOCK_SLACK_S = 600.0
"""How far ahead of this peer's clock another peer's clock may run before its records, which
expire ``record_ttl_s`` after it published them by its clock, are ignored as implausible."""


MAX_NEWCOMERS = 16
"""The most peers outside this peer's trust (:func:`weigh`) it counts as live at once."""


def _newcomer_rank(run_id: str, peer_id: str) -> bytes:
    """The same order on every reader of ``run_id`` (so joiners that admit newcomers admit the same)."""
    return hashlib.sha256(f"{run_id}/{peer_id}".encode("utf-8", "surrogatepass")).digest()


def trusted_ids(records: Sequence[swarm_dht.PeerProgress], *, me: str, ledger: Collection[str]) -> set[str]:
    """``me``, the ``ledger``'s peers and, transitively, every peer a trusted peer's record in
    ``records`` names among its groupmates (whether or not its own record is in ``records``)."""
    by_id = {r.peer_id: r for r in records}
    trusted = {me, *ledger}
    frontier = list(trusted)
    while frontier:
        record = by_id.get(frontier.pop())
        for mate in () if record is None else record.record.groupmates:
            if mate not in trusted:
                trusted.add(mate)
                frontier.append(mate)
    return trusted


def weigh(
    records: Sequence[swarm_dht.PeerProgress],
    *,
    me: str,
    ledger: Collection[str],
    run_id: str,
    max_newcomers: int = MAX_NEWCOMERS,
) -> list[swarm_dht.PeerProgress]:
    """The records of ``records`` that carry weight, in their order.

    *Trusted*: this peer's own, those of ``ledger`` (peers it completed an all-reduce with), and,
    transitively, of every peer a trusted record names among its ``groupmates`` (a signed statement
    that the named peer completed that peer's last sync with it, bytes both ways; an identity that
    never synced with a trusted peer is named by none). *Newcomers*: the rest. All newcomers count
    while there are at most ``max_newcomers``; more (a flood of fresh identities, or a wave of
    joiners larger than the bound) count none when something is trusted besides this peer, since a
    newcomer that never comes costs its NoLoCo partners their round and DiLoCo's group its early
    start; with nothing trusted (a joiner, a swarm's first round) the ``max_newcomers`` first by a
    hash of (run id, peer id), the same for every reader, count.

    Returns:
        A sublist of ``records``; no errors.
    """
    by_id = {r.peer_id: r for r in records}
    trusted = trusted_ids(records, me=me, ledger=ledger) & ({me} | by_id.keys())
    newcomers = [p for p in by_id if p not in trusted]
    if len(newcomers) > max_newcomers:
        if len(trusted) > 1:
            newcomers = []
        else:
            newcomers = sorted(newcomers, key=lambda p: _newcomer_rank(run_id, p))[:max_newcomers]
    kept = trusted | set(newcomers)
    return [r for r in records if r.peer_id in kept]


def _record_step(r, round_: int, inner_steps: int, now: float, record_ttl_s: float) -> tuple[int, float]:
    """The inner step within ``round_`` that progress record ``r`` states, and the seconds since its
    peer published it (its expiration minus ``record_ttl_s``, at least 0)."""
    return r.record.inner_step - round_ * inner_steps, max(0.0, now - (r.expiration - record_ttl_s))


@runtime_checkable
class RoundSwarm(Protocol):
    """What the round loop (peer.round.Trainer) uses of its view of the swarm. :class:`SwarmView`
    implements it over the DHT, :class:`lab.inprocess.InProcessSwarm` in one process; see
    :class:`SwarmView`'s methods for what each one means."""

    @property
    def peer_id(self) -> str: ...

    @property
    def max_sync_s(self) -> float:
        """The longest one sync may take, s (bounds the loop's waits on records)."""
        ...

    @property
    def record_ttl_s(self) -> float: ...

    def live(self, max_age_s: float = 0.0) -> list[swarm_dht.PeerProgress]: ...

    def others(self, max_age_s: float = 0.0) -> list[swarm_dht.PeerProgress]: ...

    def prefetch(self) -> bool: ...

    def publish(self, record: ProgressRecord, *, wait: bool = False) -> None: ...

    def round_finished(self) -> None: ...

    def wait_for(self, want: int, *, timeout_s: float, stop: threading.Event, heartbeat: Callable[[], None]) -> int: ...

    def step_now(self, round_: int, *, inner_steps: int, batch_size_tokens: int) -> int: ...

    def seconds_to_finish(
        self,
        round_: int,
        records: Sequence[swarm_dht.PeerProgress],
        *,
        inner_steps: int,
        batch_size_tokens: int,
        peers: Collection[str] | None = None,
    ) -> float: ...


class SwarmView:
    """Reads and writes the run's progress records for one peer.

    Args:
        dht: a started hivemind.DHT.
        run_id: the run whose records are read and written.
        signer: this peer's record signer (protocol/signing.py); its peer id is this peer's, whose
            own record always counts as live.
        record_ttl_s: lifetime of a published record, s (every peer of the run uses the same).
        max_sync_s: the longest one sync may take, s; bounds the staleness threshold before any
            round was timed.
    """

    def __init__(self, dht, *, run_id: str, signer: PeerSigner, record_ttl_s: float, max_sync_s: float):
        self.dht, self.run_id, self.signer, self.peer_id = dht, run_id, signer, signer.peer_id
        self.record_ttl_s, self.max_sync_s = record_ttl_s, max_sync_s
        self._round_seconds: deque[float] = deque(maxlen=8)
        self._round_started = time.monotonic()
        self._last_records: list[swarm_dht.PeerProgress] = []
        self._read_at = float("-inf")
        """``time.monotonic()`` of the last DHT read that worked."""
        self._cond = threading.Condition()
        """Guards the fields below and the last read; the background thread waits on it."""
        self._store_lock = threading.Lock()
        """Held while a record is signed and stored, so records reach the DHT in the order published
        (a record's expiration is taken when it is signed; the DHT keeps the latest expiration)."""
        self._pending: ProgressRecord | None = None
        """The record the background thread stores next (a newer one replaces it)."""
        self._read_wanted = False
        self._prefetch_since: float | None = None
        """``time.monotonic()`` when the background read in progress was asked for; None: none is."""
        self._worker: threading.Thread | None = None
        self._closing = False
        self._ledger: Callable[[], Iterable[str]] | None = None
        """Peers this peer completed an all-reduce with (:meth:`trust`); None: every record counts."""

    def trust(self, ledger) -> None:
        """Weigh the records read from now on (:func:`weigh`) by ``ledger``
        (``peer.state.vouching.Ledger``: the peers this peer completed an all-reduce with)."""
        self._ledger = lambda: ledger.as_dict().keys()

    def round_finished(self) -> None:
        """Time the round that just ended (the staleness threshold follows the swarm's pace)."""
        now = time.monotonic()
        self._round_seconds.append(now - self._round_started)
        self._round_started = now

    def stale_after_s(self) -> float:
        """A record not refreshed for this long belongs to a peer that is gone, hung or cut off.

        A live peer republishes four times per round and after every round, and its round lasts
        about as long as this peer's (they sync together), so two of this peer's recent rounds
        (at least 10 s) cover the gap between two records of a live peer.
        """
        return max(10.0, 2.0 * max(self._round_seconds, default=self.max_sync_s))

    def live(self, max_age_s: float = 0.0) -> list[swarm_dht.PeerProgress]:
        """The records of the live peers of the run, this peer's own included when published.

        A failed or timed-out DHT read (peer/net/dht.py ``READ_TIMEOUT_S``) returns the records of
        the last read that worked: a read failure must not stop training, nor make this peer think
        it is alone.

        Args:
            max_age_s: reuse the last read that worked when it is at most this old (seconds)
                instead of reading the DHT again (a read is the caller's time; the round loop
                reads several times within a second of a round's end), even
                while a newer one runs in the background; when it is older, a background read
                (:meth:`prefetch`) asked for within that age and still in progress is waited for
                instead of reading twice. Liveness is judged again on every call. 0: always read.
        """
        start = time.monotonic()
        if max_age_s > 0:
            with self._cond:
                if start - self._read_at > max_age_s:
                    self._cond.wait_for(
                        lambda: self._prefetch_since is None or start - self._prefetch_since > max_age_s,
                        timeout=swarm_dht.READ_TIMEOUT_S + 1.0,
                    )
                if start - self._read_at <= max_age_s:
                    return self._alive(self._last_records)
        return self._alive(self._read())

    def _read(self) -> list[swarm_dht.PeerProgress]:
        """Read the run's records from the DHT (from any thread); the last ones that worked on failure."""
        start = time.monotonic()
        try:
            # no honest peer of this run stores a record for longer than record_ttl_s
            # under a flood of records (peer/net/dht.py MAX_RECORDS_READ), keep this peer and the peers last
            # seen; with a ledger, the peers last seen that carried weight (a flood's never do)
            max_ttl_s = self.record_ttl_s + CLOCK_SLACK_S
            if self._ledger is None:
                seen = {self.peer_id, *(r.peer_id for r in self._last_records)}
                records = swarm_dht.read_progress(self.dht, self.run_id, max_ttl_s=max_ttl_s, prefer=seen)
            else:
                ledger = set(self._ledger())
                seen = trusted_ids(self._last_records, me=self.peer_id, ledger=ledger)
                records = swarm_dht.read_progress(self.dht, self.run_id, max_ttl_s=max_ttl_s, prefer=seen)
                named = trusted_ids(records, me=self.peer_id, ledger=ledger)
                if len(records) >= swarm_dht.MAX_RECORDS_READ and not named <= seen | {r.peer_id for r in records}:
                    # a capped read that missed peers trusted ones name: once more, with them first
                    records = swarm_dht.read_progress(self.dht, self.run_id, max_ttl_s=max_ttl_s, prefer=seen | named)
        except Exception as exc:
            logger.debug("reading progress records failed: %r; using the last ones read", exc)
            return self._last_records
        finally:
            logger.debug("read progress records in %.3f s", time.monotonic() - start)
        with self._cond:
            if start >= self._read_at:  # a slower read started earlier must not replace a newer one
                self._last_records, self._read_at = records, start
        return records

    def _alive(self, records: list[swarm_dht.PeerProgress]) -> list[swarm_dht.PeerProgress]:
        # published at expiration - ttl (every peer of the run uses the same ttl)
        oldest = get_dht_time() + self.record_ttl_s - self.stale_after_s()
        alive = [r for r in records if r.peer_id == self.peer_id or r.expiration >= oldest]
        if self._ledger is None:
            return alive
        return weigh(alive, me=self.peer_id, ledger=set(self._ledger()), run_id=self.run_id)

    def others(self, max_age_s: float = 0.0) -> list[swarm_dht.PeerProgress]:
        """:meth:`live` without this peer's own record."""
        return [r for r in self.live(max_age_s) if r.peer_id != self.peer_id]

    def step_now(self, round_: int, *, inner_steps: int, batch_size_tokens: int) -> int:
        """The inner step within ``round_`` that the furthest live peer at that round has reached by
        now (0 when none is at it): its latest record's step, plus the steps its throughput
        (``tokens_per_s`` over ``batch_size_tokens``) did since it published the record (the
        record's expiration minus ``record_ttl_s``). Records come four times a round, so without
        the extrapolation a peer starting from them starts up to a quarter round behind, and then
        reaches the sync after its groupmates' group formed. At most ``inner_steps - 1``."""
        now, steps = get_dht_time(), []
        for r in self.others():
            if r.record.round != round_:
                continue
            step, since = _record_step(r, round_, inner_steps, now, self.record_ttl_s)
            if r.record.tokens_per_s > 0:
                step += int(since * r.record.tokens_per_s / batch_size_tokens)
            steps.append(step)
        return max(0, min(inner_steps - 1, max(steps, default=0)))

    def seconds_to_finish(self, round_: int, records, *, inner_steps: int, batch_size_tokens: int, peers=None) -> float:
        """How long until the slowest of ``records`` (other peers' live records, e.g. from
        :meth:`live`) at ``round_`` finishes that round's inner steps, in seconds: the steps its
        latest record leaves, less those its throughput did since it published the record (as
        :meth:`step_now` extrapolates), at that throughput. 0 when no peer at ``round_`` is
        predictably still computing (a record without throughput predicts nothing; a peer that
        stopped, hung or died extrapolates to finished, so it never extends a wait much).

        Args:
            round_: the round whose sync this peer is about to join.
            records: ``peer.net.dht.PeerProgress`` of the live peers; this peer's own is skipped.
            inner_steps: H.
            batch_size_tokens: tokens per inner step (the manifest's, the same on every peer).
            peers: only these peer ids (a NoLoCo plan's groupmates); None: every peer.
        """
        now, longest = get_dht_time(), 0.0
        for r in records:
            if r.peer_id == self.peer_id or r.record.round != round_ or r.record.tokens_per_s <= 0:
                continue
            if peers is not None and r.peer_id not in peers:
                continue
            steps_per_s = r.record.tokens_per_s / batch_size_tokens
            step, since = _record_step(r, round_, inner_steps, now, self.record_ttl_s)
            left = inner_steps - step - since * steps_per_s
            longest = max(longest, left / steps_per_s)
        return longest

    def publish(self, record: ProgressRecord, *, wait: bool = False) -> None:
        """Store this peer's record; failures are logged, never raised (the next publish retries).

        With the background thread (:meth:`start_background`) and not ``wait``, returns at once:
        the thread signs and stores it, and a newer record published before it got to this one
        replaces it (only the latest says where this peer is). With ``wait`` the record is stored
        before this returns, and a record still queued is dropped (this one supersedes it).
        Records reach the DHT in the order they were published either way.
        """
        if wait or self._worker is None:
            with self._store_lock:
                with self._cond:
                    self._pending = None
                self._store(record, wait=wait)
            return
        with self._cond:
            self._pending = record
            self._cond.notify_all()

    def _store(self, record: ProgressRecord, *, wait: bool = False) -> None:
        try:
            swarm_dht.publish_progress(self.dht, self.run_id, self.signer, record, self.record_ttl_s, wait=wait)
        except Exception as exc:
            logger.debug("publishing progress failed: %r", exc)

    def prefetch(self) -> bool:
        """Read the records on the background thread now, for a :meth:`live` call with ``max_age_s``
        soon after (the round loop asks shortly before a round ends). Returns whether a read was
        asked for or is already in progress; False without the background thread (:meth:`live`
        then reads on the caller's thread, as before)."""
        if self._worker is None or self._closing:
            return False
        with self._cond:
            if self._prefetch_since is None:
                self._prefetch_since, self._read_wanted = time.monotonic(), True
                self._cond.notify_all()
        return True

    def start_background(self) -> SwarmView:
        """Start the daemon thread that stores published records and runs prefetched reads; stop it
        with :meth:`close` before the DHT shuts down. Returns this view."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._background, name="locoswarm-records", daemon=True)
            self._worker.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Store the record still queued, if any, and stop the background thread (waiting up to
        ``timeout_s`` for a store or read in progress). Publishing afterwards stores on the
        caller's thread. Idempotent."""
        worker = self._worker
        if worker is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        worker.join(timeout=timeout_s)
        self._worker = None

    def _background(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._read_wanted or self._closing)
                read, self._read_wanted = self._read_wanted and not self._closing, False
                if self._closing and self._pending is None:
                    self._prefetch_since = None
                    self._cond.notify_all()
                    return
            with self._store_lock:  # taken before the record, so a waited-for publish cannot be overtaken
                with self._cond:
                    record, self._pending = self._pending, None
                if record is not None:
                    self._store(record)
            if read:
                try:
                    self._read()
                finally:
                    with self._cond:
                        self._prefetch_since = None
                        self._cond.notify_all()

    def wait_for(self, want: int, *, timeout_s: float, stop: threading.Event, heartbeat) -> int:
        """Start barrier: wait until ``want`` peers (this one included) are live, calling
        ``heartbeat()`` (which republishes this peer's record) twice a second meanwhile.

        Returns:
            The peers seen last (``want`` or more unless the timeout or ``stop`` came first).
        """
        deadline = time.monotonic() + timeout_s
        seen = 1
        while not stop.is_set() and time.monotonic() < deadline:
            seen = len({r.peer_id for r in self.live()} | {self.peer_id})
            if seen >= want:
                return seen
            heartbeat()
            stop.wait(0.5)
        return seen
