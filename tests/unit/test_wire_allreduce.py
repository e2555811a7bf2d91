"""protocol.wire.allreduce: every frame parser rejects malformed input with BadPayload and nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.errors import BadPayload
from protocol.wire import allreduce as frames
from tests.unit.frame_mutations import frame_mutations

GOOD_HELLO = frames.encode_hello(group_id=b"\x01" * 16, sender=2, weight=512.0, pieces=3)
GOOD_PIECE = frames.encode_piece(5, b"codec-bytes")
GOOD_MEAN = frames.encode_mean(5, [True, False, True, True, True, False, True, True, True], b"codec-bytes")


def test_round_trips():
    hello = frames.parse_hello(GOOD_HELLO, group_size=4)
    assert (hello.group_id, hello.sender, hello.weight, hello.pieces) == (b"\x01" * 16, 2, 512.0, 3)
    assert bytes(frames.parse_piece(GOOD_PIECE, expected_index=5)) == b"codec-bytes"
    included, data = frames.parse_mean(GOOD_MEAN, expected_index=5, group_size=9)
    assert included == [True, False, True, True, True, False, True, True, True] and bytes(data) == b"codec-bytes"
    assert frames.parse_abort(frames.encode_abort("owner gave up")) == "owner gave up"


@pytest.mark.parametrize(
    "payload, match",
    [
        (frames.encode_hello(group_id=b"g", sender=4, weight=1.0, pieces=1), "sender index 4"),
        (frames.encode_hello(group_id=b"g", sender=0, weight=float("nan"), pieces=1), "weight"),
        (frames.encode_hello(group_id=b"g", sender=0, weight=-1.0, pieces=1), "weight"),
        (GOOD_PIECE, "expected HELLO"),
        (bytes([frames.HELLO]) + b"\xc1", "msgpack"),
        (bytes([9]) + b"x", "unknown frame kind"),
    ],
)
def test_bad_hello_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        frames.parse_hello(payload, group_size=4)


def test_mean_checks_index_group_and_abort():
    with pytest.raises(BadPayload, match="MEAN 5 arrived where piece 6"):
        frames.parse_mean(GOOD_MEAN, expected_index=6, group_size=9)
    with pytest.raises(BadPayload, match="group of 9"):
        frames.parse_mean(GOOD_MEAN, expected_index=5, group_size=8)
    with pytest.raises(BadPayload, match="owner aborted: no"):
        frames.parse_mean(frames.encode_abort("no"), expected_index=5, group_size=9)
    with pytest.raises(BadPayload, match="no sender"):
        frames.parse_mean(frames.encode_mean(0, [False, False], b""), expected_index=0, group_size=2)


@settings(max_examples=400, deadline=None)
@given(
    payload=frame_mutations([GOOD_HELLO, GOOD_PIECE, GOOD_MEAN, frames.encode_abort("x")]),
    group_size=st.integers(1, 64),
    index=st.integers(0, 10),
)
def test_parsers_raise_only_bad_payload(payload, group_size, index):
    for parse in (
        lambda: frames.parse_hello(payload, group_size=group_size),
        lambda: frames.parse_piece(payload, expected_index=index),
        lambda: frames.parse_mean(payload, expected_index=index, group_size=group_size),
        lambda: frames.parse_abort(payload),
    ):
        try:
            parse()
        except BadPayload:
            pass
