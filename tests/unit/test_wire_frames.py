"""protocol.wire: every frame parser rejects malformed input with BadPayload and nothing else."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import wire
from protocol.errors import BadPayload

GOOD_HELLO = wire.encode_hello(group_id=b"\x01" * 16, sender=2, weight=512.0, pieces=3)
GOOD_PIECE = wire.encode_piece(5, b"codec-bytes")
GOOD_MEAN = wire.encode_mean(5, [True, False, True, True, True, False, True, True, True], b"codec-bytes")


def test_round_trips():
    hello = wire.parse_hello(GOOD_HELLO, group_size=4)
    assert (hello.group_id, hello.sender, hello.weight, hello.pieces) == (b"\x01" * 16, 2, 512.0, 3)
    assert bytes(wire.parse_piece(GOOD_PIECE, expected_index=5)) == b"codec-bytes"
    included, data = wire.parse_mean(GOOD_MEAN, expected_index=5, group_size=9)
    assert included == [True, False, True, True, True, False, True, True, True] and bytes(data) == b"codec-bytes"
    assert wire.parse_abort(wire.encode_abort("owner gave up")) == "owner gave up"


@pytest.mark.parametrize("payload, match", [
    (wire.encode_hello(group_id=b"g", sender=4, weight=1.0, pieces=1), "sender index 4"),
    (wire.encode_hello(group_id=b"g", sender=0, weight=float("nan"), pieces=1), "weight"),
    (wire.encode_hello(group_id=b"g", sender=0, weight=-1.0, pieces=1), "weight"),
    (GOOD_PIECE, "expected HELLO"),
    (bytes([wire.HELLO]) + b"\xc1", "msgpack"),
    (bytes([9]) + b"x", "unknown frame kind"),
])
def test_bad_hello_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        wire.parse_hello(payload, group_size=4)


def test_mean_checks_index_group_and_abort():
    with pytest.raises(BadPayload, match="MEAN 5 arrived where piece 6"):
        wire.parse_mean(GOOD_MEAN, expected_index=6, group_size=9)
    with pytest.raises(BadPayload, match="group of 9"):
        wire.parse_mean(GOOD_MEAN, expected_index=5, group_size=8)
    with pytest.raises(BadPayload, match="owner aborted: no"):
        wire.parse_mean(wire.encode_abort("no"), expected_index=5, group_size=9)
    with pytest.raises(BadPayload, match="no sender"):
        wire.parse_mean(wire.encode_mean(0, [False, False], b""), expected_index=0, group_size=2)


def _read(data: bytes, max_bytes: int) -> bytes:
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await wire.read_frame(reader, max_bytes=max_bytes, timeout=1.0)
    return asyncio.run(go())


def test_read_frame_refuses_long_frames_before_reading_them():
    with pytest.raises(BadPayload, match="declares 4294967295 bytes"):
        _read(b"\xff\xff\xff\xff", max_bytes=1024)
    with pytest.raises(asyncio.IncompleteReadError):
        _read(wire.frame(b"abcdef")[:-2], max_bytes=1024)
    assert _read(wire.frame(b"abcdef"), max_bytes=6) == b"abcdef"


def _mutations():
    seeds = st.sampled_from([GOOD_HELLO, GOOD_PIECE, GOOD_MEAN, wire.encode_abort("x")])
    flip = st.tuples(seeds, st.integers(0, 10_000), st.integers(1, 255)).map(
        lambda t: t[0][:t[1] % len(t[0])] + bytes([t[0][t[1] % len(t[0])] ^ t[2]]) + t[0][t[1] % len(t[0]) + 1:])
    cut = st.tuples(seeds, st.integers(0, 10_000)).map(lambda t: t[0][:t[1] % (len(t[0]) + 1)])
    extend = st.tuples(seeds, st.binary(max_size=64)).map(lambda t: t[0] + t[1])
    return st.one_of(st.binary(max_size=256), flip, cut, extend)


@settings(max_examples=400, deadline=None)
@given(payload=_mutations(), group_size=st.integers(1, 64), index=st.integers(0, 10))
def test_parsers_raise_only_bad_payload(payload, group_size, index):
    for parse in (lambda: wire.parse_hello(payload, group_size=group_size),
                  lambda: wire.parse_piece(payload, expected_index=index),
                  lambda: wire.parse_mean(payload, expected_index=index, group_size=group_size),
                  lambda: wire.parse_abort(payload)):
        try:
            parse()
        except BadPayload:
            pass
