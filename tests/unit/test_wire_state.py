"""protocol.wire.state: the state transfer's frames round-trip, and every parser rejects malformed
input with BadPayload and nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.errors import BadPayload
from protocol.version import PROTOCOL_VERSION
from protocol.wire import state as frames
from tests.unit.frame_mutations import frame_mutations

DIGEST = bytes(range(16))
META = {"run_id": "run0", "round": 12, "inner_step": 600}
HASHES = [bytes([i]) * frames.HASH_BYTES for i in range(3)]
GOOD_REQUEST = frames.encode_request(DIGEST, [0, 2, 7])
GOOD_META = frames.encode_meta(META, HASHES)
GOOD_CHUNK = frames.encode_chunk(2, b"\0" * 24)


def test_round_trips():
    assert frames.parse_request(GOOD_REQUEST) == (DIGEST, [0, 2, 7])
    assert frames.parse_meta(GOOD_META, chunks=3) == (META, HASHES)
    assert bytes(frames.parse_chunk(GOOD_CHUNK, expected_index=2, shape=(2, 3))) == b"\0" * 24
    # the meta is canonical: key order does not change the bytes
    assert frames.encode_meta(dict(reversed(list(META.items()))), HASHES) == GOOD_META


@pytest.mark.parametrize(
    "payload, match",
    [
        (frames.REQUEST_HEADER.pack(frames.REQUEST, PROTOCOL_VERSION + 1, DIGEST, 0), "protocol version"),
        (frames.encode_request(DIGEST, [3, 2]), "strictly ascending"),
        (GOOD_REQUEST[:-4], "announces 3 chunk indices"),
        (frames.encode_missing(), "expected REQUEST"),
        (b"", r"expected REQUEST, got kind \(empty\)"),
    ],
)
def test_bad_request_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        frames.parse_request(payload)


@pytest.mark.parametrize(
    "payload, match",
    [
        (frames.encode_missing(), "MISSING: the donor does not hold this state"),
        (GOOD_CHUNK, "expected META, got CHUNK"),
        (GOOD_META + b"x", "bytes of hashes"),
        (frames.encode_meta({**META, "extra": 1}, HASHES), "fields"),
        (frames.encode_meta({**META, "round": -1}, HASHES), "round"),
        (frames.META_HEADER.pack(frames.META, 1) + b"\xc1" + b"".join(HASHES), "not valid msgpack"),
    ],
)
def test_bad_meta_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        frames.parse_meta(payload, chunks=3)


def test_chunk_checks_index_and_length():
    with pytest.raises(BadPayload, match="CHUNK 2 arrived where chunk 3 was due"):
        frames.parse_chunk(GOOD_CHUNK, expected_index=3, shape=(2, 3))
    with pytest.raises(BadPayload, match=r"CHUNK 2 carries 24 bytes, expected 32 \(float32 \(2, 4\)\)"):
        frames.parse_chunk(GOOD_CHUNK, expected_index=2, shape=(2, 4))
    with pytest.raises(BadPayload, match="expected CHUNK 2, got META"):
        frames.parse_chunk(GOOD_META, expected_index=2, shape=(2, 3))


@settings(max_examples=400, deadline=None)
@given(
    payload=frame_mutations([GOOD_REQUEST, GOOD_META, GOOD_CHUNK, frames.encode_missing()]),
    chunks=st.integers(0, 8),
    index=st.integers(0, 10),
)
def test_parsers_raise_only_bad_payload(payload, chunks, index):
    for parse in (
        lambda: frames.parse_request(payload),
        lambda: frames.parse_meta(payload, chunks=chunks),
        lambda: frames.parse_chunk(payload, expected_index=index, shape=(2, 3)),
    ):
        try:
            parse()
        except BadPayload:
            pass
