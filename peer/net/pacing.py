"""A volunteer's upload cap (``peer join --max-upload-mbit``): one token bucket that every stream
this peer writes to goes through, shared by its processes, and byte counters of those streams
(what the traffic ledger, peer/net/traffic.py, reads where the kernel's socket counters cannot be read:
peer/net/wiremeter.py).

Where the bytes go through: the peer's processes are forked from the one that runs ``peer join``
(hivemind's DHT and averager processes), so a bucket made there with :func:`install` before they
start lives in shared memory that all of them see: the averager process's libp2p streams (the
group all-reduce, its receipts, state served to joiners, NoLoCo's partner exchange, hivemind's
matchmaking calls) are wrapped where they are opened and accepted (peer/sync/hivemind_limits.py
``BoundedP2P``), shard serving where it writes (peer/shards/serve.py). Not paced: the DHT's own
RPCs (pings, progress and device records, reads of the others'; the group key's lookups while
matching, four a second: peer/sync/group_key.py; in all about 0.3 MB a round on the three-peer chaos
rig, whose rounds last ~5 s, which the traffic ledger counts) and the dial-back check at start
(peer/net/reachability.py, a few hundred bytes), on the DHT process's streams; a pipelined run's
activation streams (peer/pipeline/rpc.py); `peer doctor`'s uplink probe is not `peer join`'s.

Why not a library: aiolimiter and friends meter calls per process; this cap must hold across the
peer's processes and pace bytes inside one long write, so it is a ~100-line bucket on a shared
array.

The cap is on the wire (IP packets); libp2p (yamux, noise) and TCP/IP add their headers to the
stream bytes counted here, and the acknowledgements of what the peer receives leave on the same
link. :data:`WIRE_OVERHEAD` keeps that room: the streams are paced at ``cap × (1 − WIRE_OVERHEAD)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable

WIRE_OVERHEAD = 0.08
"""Share of the cap left for what is added below the streams: TCP/IP headers (52 B per 1,448 B
segment: 3.6 %), yamux and noise frames, and the ACKs of what the peer receives meanwhile (a sync
receives about what it sends: ~2 %); on the rig (tests/chaos/test_upload_cap.py) the wire carried
7.5 % more than the streams during a sync."""
CHUNK_BYTES = 16 * 1024
"""Largest write handed to the stream at once: at 1 Mbit/s, 0.13 s of the cap."""
BURST_S = 0.25
"""The bucket holds at most this many seconds of the cap (and at least one chunk): how far ahead of
the rate a peer idle before may send."""
RATE_WINDOW_S = 2.0
"""Window of the send rate ``peer status`` shows (:meth:`Pacer.recent_rate`), s."""
BUSY_WINDOW_BYTES = 256 * 1024
"""A rate window that booked fewer bytes (receipts, records between syncs) is not a sending one."""
FLUSH_LIMIT_S = 120.0
"""A stream closed with paced bytes still pending is closed for good after this long (s) even if
they did not all go (a receiver that stopped reading)."""


def mbit_to_bytes_per_s(mbit: float) -> float:
    """Mbit/s (10⁶ bits) to bytes/s."""
    return mbit * 1e6 / 8


class Pacer:
    """A token bucket over shared memory: ``reserve(n)`` books ``n`` bytes and says how long to wait
    before sending them, so that the bytes booked by all holders (threads, forked processes) stay
    within ``rate`` bytes/s plus the burst over any window. Also counts the bytes sent and received.

    Args:
        rate_bytes_per_s: the stream bytes per second to pace to, > 0; None: count only, never wait.
        clock: seconds, monotonic and common to the processes (``time.monotonic``: CLOCK_MONOTONIC).

    Raises:
        ValueError: ``rate_bytes_per_s`` not a positive finite number.
    """

    def __init__(self, rate_bytes_per_s: float | None, *, clock: Callable[[], float] = time.monotonic):
        if rate_bytes_per_s is not None and not 0 < rate_bytes_per_s < float("inf"):
            raise ValueError(f"rate_bytes_per_s = {rate_bytes_per_s!r}: expected a finite number > 0 or None")
        self.rate = rate_bytes_per_s
        self.burst = 0.0 if rate_bytes_per_s is None else max(float(CHUNK_BYTES), rate_bytes_per_s * BURST_S)
        self.clock = clock
        # [tokens (bytes, may go negative: booked ahead), time of the last booking, sent, received,
        #  start and bytes of the current rate window, rate of the last busy window (bytes/s),
        #  when the bytes booked so far will have gone]
        self._shared = mp.RawArray("d", 8)
        self._lock = mp.Lock()
        self._shared[0], self._shared[1], self._shared[4] = self.burst, clock(), clock()

    def reserve(self, n: int) -> float:
        """Book ``n`` bytes about to be sent; returns the seconds to wait before sending them (0: now)."""
        with self._lock:
            s = self._shared
            s[2] += n
            now = self.clock()
            if now - s[4] >= RATE_WINDOW_S:  # close the rate window: keep its rate if it was a busy one
                if s[5] >= BUSY_WINDOW_BYTES and s[7] > s[4]:
                    s[6] = s[5] / (s[7] - s[4])  # over the time its bytes took, not the idle time after
                s[4], s[5] = now, 0.0
            s[5] += n
            delay = 0.0
            if self.rate is not None:
                s[0] = min(self.burst, s[0] + (now - s[1]) * self.rate) - n
                s[1] = now
                delay = 0.0 if s[0] >= 0 else -s[0] / self.rate
            s[7] = max(s[7], now + delay)
            return delay

    def received(self, n: int) -> None:
        """Count ``n`` bytes read from a stream."""
        with self._lock:
            self._shared[3] += n

    def recent_rate(self) -> float:
        """Bytes/s booked over the last :data:`RATE_WINDOW_S` window that booked at least
        :data:`BUSY_WINDOW_BYTES` (what the peer sends at while it sends); 0.0 before any."""
        with self._lock:
            return float(self._shared[6])

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received) through this pacer since it was made, by every process."""
        with self._lock:
            return int(self._shared[2]), int(self._shared[3])


_PACER: Pacer | None = None


def install(upload_mbit: float | None) -> Pacer:
    """Make this peer's pacer (``upload_mbit`` Mbit/s on the wire, None: no cap, counting only), in
    the process that runs ``peer join``, before the DHT and averager processes fork: they inherit it.
    """
    global _PACER
    rate = None if upload_mbit is None else mbit_to_bytes_per_s(upload_mbit) * (1.0 - WIRE_OVERHEAD)
    _PACER = Pacer(rate)
    return _PACER


def upload_cap_mbit() -> float | None:
    """The --max-upload-mbit :func:`install` was given in this process tree, or None."""
    return None if _PACER is None or _PACER.rate is None else _PACER.rate * 8 / 1e6 / (1.0 - WIRE_OVERHEAD)


def current() -> Pacer | None:
    """The pacer :func:`install` made in this process or a parent before the fork, or None."""
    return _PACER


def paced(writer, pacer: Pacer | None = None):
    """``writer`` (an ``asyncio.StreamWriter``) paced by ``pacer`` (default: :func:`current`), or
    ``writer`` itself when there is none."""
    pacer = current() if pacer is None else pacer
    return writer if pacer is None or isinstance(writer, PacedWriter) else PacedWriter(writer, pacer)


def counted(reader, pacer: Pacer | None = None):
    """``reader`` (an ``asyncio.StreamReader``) whose reads ``pacer`` counts, or ``reader`` itself."""
    pacer = current() if pacer is None else pacer
    return reader if pacer is None or isinstance(reader, CountingReader) else CountingReader(reader, pacer)


class PacedWriter:
    """An ``asyncio.StreamWriter`` whose bytes go out in chunks of at most :data:`CHUNK_BYTES`, each
    after the pacer allows it. ``write`` never blocks (the bytes queue, a task sends them, as
    asyncio's own buffer does); ``drain`` returns once they went and the stream drained; ``close``
    closes after they went (at most :data:`FLUSH_LIMIT_S` later). Other attributes are the writer's.

    Errors: a failed send is raised by the next ``drain``, and the bytes still queued are dropped.
    """

    def __init__(self, writer: asyncio.StreamWriter, pacer: Pacer):
        self._writer, self._pacer = writer, pacer
        self._pending = bytearray()
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._closing = False

    def __getattr__(self, name: str):
        return getattr(self._writer, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        self._pending += data
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        try:
            while self._pending:
                chunk = bytes(self._pending[:CHUNK_BYTES])
                del self._pending[:CHUNK_BYTES]
                delay = self._pacer.reserve(len(chunk))
                if delay > 0:
                    await asyncio.sleep(delay)
                self._writer.write(chunk)
                await self._writer.drain()
        except Exception as exc:  # the stream broke: the caller's drain raises it
            self._error = exc
            self._pending.clear()
        finally:
            if self._closing:
                self._writer.close()

    async def drain(self) -> None:
        if self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        if self._error is not None:
            raise self._error
        await self._writer.drain()

    def is_closing(self) -> bool:
        return self._closing or self._writer.is_closing()

    def close(self) -> None:
        self._closing = True
        task = self._task
        if task is None or task.done():
            self._writer.close()
            return

        def give_up() -> None:
            if not task.done():
                task.cancel()

        asyncio.get_running_loop().call_later(FLUSH_LIMIT_S, give_up)

    async def wait_closed(self) -> None:
        if self._task is not None and not self._task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(self._task)
        await self._writer.wait_closed()


class CountingReader:
    """An ``asyncio.StreamReader`` whose reads the pacer counts (received bytes, see :meth:`Pacer.totals`)."""

    def __init__(self, reader: asyncio.StreamReader, pacer: Pacer):
        self._reader, self._pacer = reader, pacer

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._pacer.received(len(data))
        return data

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._pacer.received(len(data))
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        data = await self._reader.readuntil(separator)
        self._pacer.received(len(data))
        return data

    async def readline(self) -> bytes:
        data = await self._reader.readline()
        self._pacer.received(len(data))
        return data
