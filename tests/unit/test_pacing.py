"""The upload cap's token bucket and paced writer (peer/net/pacing.py), on a fake clock."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from peer.net import pacing
from peer.net.pacing import CHUNK_BYTES, CountingReader, PacedWriter, Pacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sent_at(pacer: Pacer, clock: FakeClock, sizes: list[int]) -> list[tuple[float, int]]:
    """One sender booking ``sizes`` in turn and sending each when the pacer says: (time, bytes) per send."""
    sends = []
    for n in sizes:
        clock.now += pacer.reserve(n)
        sends.append((clock.now, n))
    return sends


def _max_over_windows(sends: list[tuple[float, int]], window_s: float) -> int:
    return max(sum(n for t, n in sends if start <= t < start + window_s) for start, _ in sends)


@pytest.mark.parametrize("rate", [125_000.0, 625_000.0, 12_500_000.0])  # 1, 5, 100 Mbit/s
def test_bytes_over_any_window_stay_within_rate_plus_burst(rate: float) -> None:
    clock = FakeClock()
    pacer = Pacer(rate, clock=clock)
    sends = _sent_at(pacer, clock, [CHUNK_BYTES] * 2000)
    for window in (1.0, 3.0, 10.0):
        assert _max_over_windows(sends, window) <= rate * window + pacer.burst + CHUNK_BYTES
    # and the pacer is not slower than the rate either: the whole transfer takes its bytes / rate
    total = sum(n for _, n in sends)
    assert sends[-1][0] - 1000.0 == pytest.approx((total - pacer.burst) / rate, rel=1e-6)


def test_senders_share_one_bucket() -> None:
    clock = FakeClock()
    pacer = Pacer(100_000.0, clock=clock)
    # two senders book alternately without time passing: the second waits for the first's bytes
    first = pacer.reserve(50_000)
    second = pacer.reserve(50_000)
    assert second > first
    assert second == pytest.approx((100_000 - pacer.burst) / 100_000.0)


def test_idle_time_refills_at_most_the_burst() -> None:
    clock = FakeClock()
    pacer = Pacer(100_000.0, clock=clock)
    clock.now += 3600.0  # an hour idle
    assert pacer.reserve(int(pacer.burst)) == 0.0
    assert pacer.reserve(100_000) == pytest.approx(1.0)


def test_no_rate_counts_without_waiting() -> None:
    pacer = Pacer(None)
    assert pacer.reserve(10**9) == 0.0
    pacer.received(123)
    assert pacer.totals() == (10**9, 123)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_rate_is_refused_with_its_value(bad: float) -> None:
    with pytest.raises(ValueError, match="rate_bytes_per_s"):
        Pacer(bad)


def _book_in_child(pacer: Pacer) -> None:
    pacer.reserve(4096)
    pacer.received(17)


def test_forked_processes_share_the_bucket_and_counters() -> None:
    pacer = Pacer(1e9)
    child = mp.get_context("fork").Process(target=_book_in_child, args=(pacer,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    pacer.reserve(1)
    assert pacer.totals() == (4097, 17)


def test_install_paces_at_the_cap_less_the_wire_overhead() -> None:
    try:
        pacer = pacing.install(8.0)
        assert pacer.rate == pytest.approx(1e6 * (1 - pacing.WIRE_OVERHEAD))
        assert pacing.current() is pacer
    finally:
        pacing._PACER = None


class FakeWriter:
    def __init__(self, fail_after: int | None = None) -> None:
        self.data = bytearray()
        self.writes: list[int] = []
        self.closed = False
        self.fail_after = fail_after

    def write(self, data: bytes) -> None:
        if self.fail_after is not None and len(self.writes) >= self.fail_after:
            raise ConnectionResetError("the stream broke")
        self.writes.append(len(data))
        self.data += data

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    async def wait_closed(self) -> None:
        return None

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


class BookingPacer(Pacer):
    def __init__(self) -> None:
        super().__init__(None)
        self.booked: list[int] = []

    def reserve(self, n: int) -> float:
        self.booked.append(n)
        return super().reserve(n)


def test_paced_writer_sends_everything_in_order_in_chunks() -> None:
    async def main() -> tuple[FakeWriter, BookingPacer, bytes]:
        raw, pacer = FakeWriter(), BookingPacer()
        w = PacedWriter(raw, pacer)  # type: ignore[arg-type]
        payload = bytes(range(256)) * 1000  # 256,000 bytes
        w.write(payload[:100])
        w.write(payload[100:])
        await w.drain()
        assert w.get_extra_info("peername") == "info:peername"  # other attributes are the writer's
        return raw, pacer, payload

    raw, pacer, payload = asyncio.run(main())
    assert bytes(raw.data) == payload
    assert max(raw.writes) <= CHUNK_BYTES
    assert sum(pacer.booked) == len(payload) and pacer.booked == raw.writes


def test_close_waits_for_the_queued_bytes() -> None:
    async def main() -> FakeWriter:
        raw = FakeWriter()
        w = PacedWriter(raw, BookingPacer())  # type: ignore[arg-type]
        w.write(b"x" * (3 * CHUNK_BYTES))
        w.close()  # no drain: the bytes still go, then the stream closes
        assert w.is_closing() and not raw.closed
        await w.wait_closed()
        return raw

    raw = asyncio.run(main())
    assert len(raw.data) == 3 * CHUNK_BYTES and raw.closed


def test_a_broken_stream_is_raised_by_drain() -> None:
    async def main() -> None:
        w = PacedWriter(FakeWriter(fail_after=1), BookingPacer())  # type: ignore[arg-type]
        w.write(b"y" * (4 * CHUNK_BYTES))
        with pytest.raises(ConnectionResetError):
            await w.drain()

    asyncio.run(main())


def test_counting_reader_counts_what_was_read() -> None:
    async def main() -> tuple[int, int]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"abcdefgh\nrest")
        reader.feed_eof()
        pacer = Pacer(None)
        r = CountingReader(reader, pacer)
        assert await r.readexactly(3) == b"abc"
        assert await r.readline() == b"defgh\n"
        assert await r.read() == b"rest"
        assert r.at_eof()
        return pacer.totals()

    assert asyncio.run(main()) == (0, 13)
