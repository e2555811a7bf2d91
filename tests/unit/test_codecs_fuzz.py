"""Fuzzing decode: random bytes and mutated valid encodings give BadPayload or a valid tensor.

Whatever the bytes, ``decode`` must raise only BadPayload, or return a finite fp32 tensor of the
requested shape; it must not crash, hang (hypothesis deadline) or allocate beyond the shape
(a header claiming 2^32 elements must be refused before anything is allocated for it).
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol.codecs import WIRE_IDS, Codec, decode
from protocol.errors import BadPayload

CODECS = sorted(WIRE_IDS)
DEEP = int(os.environ.get("LOCOSWARM_FUZZ_EXAMPLES", "0"))
"""Set to e.g. 5000 for a longer, randomized search; by default 150 fixed examples per test (< 30 s)."""
FUZZ = settings(
    max_examples=DEEP or 150,
    deadline=2000,
    derandomize=not DEEP,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple).filter(lambda s: math.prod(s) <= 600)


def assert_valid_or_bad_payload(data: bytes, shape: tuple[int, ...]) -> None:
    try:
        out = decode(data, shape, seed=0)
    except BadPayload:
        return
    assert out.shape == shape and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())


@st.composite
def encodings(draw):
    """(codec name, shape, a valid encoding of a random tensor of that shape)."""
    name = draw(st.sampled_from(CODECS))
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e20]))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    codec = Codec(name, block_size=draw(st.sampled_from([8, 16, 64])), topk_fraction=0.2, rank=2)
    return name, shape, codec.encode(x, seed=seed)


@FUZZ
@given(encodings(), st.data())
def test_bit_flips(enc, data):
    _, shape, valid = enc
    buf = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    assert_valid_or_bad_payload(bytes(buf), shape)


@FUZZ
@given(encodings(), st.data())
def test_truncation_and_extension(enc, data):
    _, shape, valid = enc
    cut = data.draw(st.integers(0, len(valid)))
    assert_valid_or_bad_payload(valid[:cut], shape)
    extra = data.draw(st.binary(min_size=1, max_size=64))
    with pytest.raises(BadPayload):
        decode(valid + extra, shape, seed=0)


@FUZZ
@given(encodings(), shapes)
def test_wrong_shape(enc, other):
    _, shape, valid = enc
    assert_valid_or_bad_payload(valid, other)


@FUZZ
@given(st.sampled_from(list(WIRE_IDS.values()) + [8, 255]), st.binary(max_size=2048), shapes)
def test_random_bytes_after_a_codec_id(wire_id, body, shape):
    assert_valid_or_bad_payload(bytes([wire_id]) + body, shape)


@FUZZ
@given(encodings(), st.data())
def test_byte_overwrites_in_the_header(enc, data):
    # Parameters live in the first bytes: overwrite them with extreme values.
    _, shape, valid = enc
    buf = bytearray(valid)
    for pos in range(1, min(len(buf), 8)):
        if data.draw(st.booleans()):
            buf[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
    assert_valid_or_bad_payload(bytes(buf), shape)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CODECS)
def test_headers_claiming_huge_sizes_are_refused_without_allocating(name):
    # Every parameter field at its maximum, for a small shape: refused (no MemoryError, no hang).
    valid = Codec(name, topk_fraction=0.2, rank=2).encode(torch.randn(20, 30), seed=0)
    for fill in (0xFF, 0x7F):
        buf = bytearray(valid)
        buf[1:9] = bytes([fill]) * 8
        assert_valid_or_bad_payload(bytes(buf), (20, 30))
