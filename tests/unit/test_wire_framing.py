"""protocol.wire.framing: length-prefixed frames, bounded before they are read; disjoint kinds."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import BadPayload
from protocol.wire import allreduce, framing, state


def _read(data: bytes, max_bytes: int) -> bytes:
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await framing.read_frame(reader, max_bytes=max_bytes, timeout=1.0)

    return asyncio.run(go())


def test_read_frame_refuses_long_frames_before_reading_them():
    with pytest.raises(BadPayload, match="declares 4294967295 bytes"):
        _read(b"\xff\xff\xff\xff", max_bytes=1024)
    with pytest.raises(asyncio.IncompleteReadError):
        _read(framing.frame(b"abcdef")[:-2], max_bytes=1024)
    assert _read(framing.frame(b"abcdef"), max_bytes=6) == b"abcdef"


def test_empty_frame_is_refused():
    with pytest.raises(BadPayload, match="declares 0 bytes"):
        _read(framing.LENGTH.pack(0), max_bytes=1024)


def test_a_frame_on_the_wrong_stream_is_rejected_by_its_kind():
    assert not set(allreduce.KIND_NAMES) & set(state.KIND_NAMES)
    for kind in state.KIND_NAMES:
        with pytest.raises(BadPayload, match="unknown frame kind"):
            framing.kind_of(bytes([kind]), allreduce.KIND_NAMES)
    assert framing.kind_of(bytes([allreduce.MEAN]) + b"x", allreduce.KIND_NAMES) == allreduce.MEAN


def test_failures_are_described_in_words():
    assert framing.describe_failure(TimeoutError()) == "timed out"
    assert (
        framing.describe_failure(asyncio.IncompleteReadError(b"ab", 6)) == "stream closed after 2 of 6 bytes of a frame"
    )
    assert framing.describe_failure(BadPayload("CHUNK 3 holds NaN or inf")) == "CHUNK 3 holds NaN or inf"
    assert framing.describe_failure(ConnectionResetError("peer gone")) == "ConnectionResetError: peer gone"
