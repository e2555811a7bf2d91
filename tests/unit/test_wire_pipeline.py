"""protocol.wire.pipeline: stage frames round-trip bit for bit, and every parser rejects malformed
input with BadPayload (naming the field, the value and what is allowed) and nothing else."""

from __future__ import annotations

import asyncio
import random
import struct

import pytest
import torch

from protocol.errors import BadPayload
from protocol.version import PROTOCOL_VERSION
from protocol.wire import framing, pipeline as frames
from protocol.wire.pipeline import StageLimits, StageReply, StageRequest

LIMITS = StageLimits(max_batch_sequences=4, max_seq_len_tokens=8, hidden_size=16, vocab_size=50, stages=4)


def _request(dtype=torch.bfloat16, b=2, t=5, request_id=7, seed=0) -> StageRequest:
    g = torch.Generator().manual_seed(seed)
    acts = torch.randn(b, t, LIMITS.hidden_size, generator=g).to(dtype)
    targets = torch.randint(0, LIMITS.vocab_size, (b, t), generator=g, dtype=torch.int32)
    return StageRequest(request_id=request_id, micro_batch=3, stage=2, activations=acts, targets=targets)


def _reply(request: StageRequest, *, loss=2.5, tokens=None) -> StageReply:
    grad = (request.activations.float() * -0.5).to(request.activations.dtype)
    b, t, _ = grad.shape
    return StageReply(request_id=request.request_id, grad=grad, loss=loss, tokens=b * t if tokens is None else tokens)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def _with_header(payload: bytes, header: struct.Struct, **fields) -> bytes:
    """``payload`` with some of its header's fields replaced, by position name."""
    names = {
        frames.REQUEST_HEADER: ("kind", "version", "request_id", "micro_batch", "stage", "dtype", "b", "t", "h"),
        frames.REPLY_HEADER: ("kind", "request_id", "dtype", "b", "t", "h", "loss", "tokens"),
    }[header]
    values = dict(zip(names, header.unpack_from(payload)))
    values.update(fields)
    return header.pack(*values.values()) + payload[header.size :]


GOOD_REQUEST = _request()
GOOD_REQUEST_BYTES = frames.encode_request(GOOD_REQUEST)
GOOD_REPLY_BYTES = frames.encode_reply(_reply(GOOD_REQUEST))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_request_and_reply_round_trip_bit_exact(dtype):
    request = _request(dtype)
    # values that a lossy or endian-confused encoding would change: -0, subnormals, the extremes
    special = torch.tensor(
        [-0.0, torch.finfo(dtype).tiny / 4, torch.finfo(dtype).max, -torch.finfo(dtype).max], dtype=dtype
    )
    request.activations[0, 0, :4] = special
    back = frames.parse_request(frames.encode_request(request), LIMITS, stage=2)
    assert (back.request_id, back.micro_batch, back.stage) == (7, 3, 2)
    assert back.activations.dtype == dtype and back.activations.shape == request.activations.shape
    assert torch.equal(_bits(back.activations), _bits(request.activations))
    assert back.targets.dtype == torch.int32 and torch.equal(back.targets, request.targets)

    reply = _reply(request, loss=3.25, tokens=9)
    answer = frames.parse_answer(frames.encode_reply(reply), LIMITS, request=request)
    assert isinstance(answer, StageReply)
    assert (answer.request_id, answer.loss, answer.tokens) == (7, 3.25, 9)
    assert answer.grad.dtype == dtype and torch.equal(_bits(answer.grad), _bits(reply.grad))


def test_tensors_travel_as_little_endian_raw_values():
    request = StageRequest(
        request_id=1,
        micro_batch=0,
        stage=1,
        activations=torch.full((1, 1, 16), 1.0),
        targets=torch.tensor([[258 % 50]], dtype=torch.int32),
    )
    payload = frames.encode_request(request)
    body = payload[frames.REQUEST_HEADER.size :]
    assert body[:4] == struct.pack("<f", 1.0) and body[-4:] == struct.pack("<i", 8)
    bf16 = frames.encode_request(
        StageRequest(
            request_id=1,
            micro_batch=0,
            stage=1,
            activations=torch.full((1, 1, 16), 1.0, dtype=torch.bfloat16),
            targets=torch.zeros(1, 1, dtype=torch.int32),
        )
    )
    assert bf16[frames.REQUEST_HEADER.size :][:2] == b"\x80\x3f"  # 1.0 = 0x3f80


def test_parsed_tensors_own_their_memory():
    payload = bytearray(GOOD_REQUEST_BYTES)
    request = frames.parse_request(payload, LIMITS)
    before = request.activations.clone()
    payload[frames.REQUEST_HEADER.size :] = bytes(len(payload) - frames.REQUEST_HEADER.size)
    assert torch.equal(_bits(request.activations), _bits(before))


def _nan_request() -> bytes:
    request = _request(torch.float32)
    request.activations[1, 3, 9] = float("nan")
    return frames.encode_request(request)


def _bad_target(value: int) -> bytes:
    request = _request()
    request.targets[1, 2] = value
    return frames.encode_request(request)


@pytest.mark.parametrize(
    "payload, match",
    [
        (GOOD_REQUEST_BYTES[:-1], "needs exactly"),
        (GOOD_REQUEST_BYTES + b"\0", "needs exactly"),
        (GOOD_REQUEST_BYTES[: frames.REQUEST_HEADER.size - 1], "shorter than its 34-byte header"),
        (b"", "unknown frame kind"),
        (bytes([99]) + GOOD_REQUEST_BYTES[1:], "unknown frame kind 63"),
        (GOOD_REPLY_BYTES, "expected STAGE_REQUEST, got STAGE_REPLY"),
        (
            _with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, version=PROTOCOL_VERSION + 1),
            f"protocol version {PROTOCOL_VERSION + 1}, this peer speaks {PROTOCOL_VERSION}",
        ),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, dtype=7), r"dtype code 7; allowed 1 \(fp32\) or 2"),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, dtype=0), "dtype code 0"),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, stage=0), r"targets stage 0; allowed \[1, 4\)"),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, stage=4), r"targets stage 4; allowed \[1, 4\)"),
        # sizes far beyond the limits, declared in a small frame: refused by the limits, before allocation
        (
            _with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, b=0xFFFFFFFF),
            r"batch B = 4294967295; allowed \[1, 4\]",
        ),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, b=0), r"batch B = 0; allowed \[1, 4\]"),
        (
            _with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, t=1 << 30),
            r"sequence length T = 1073741824; allowed",
        ),
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, h=8), "hidden size H = 8; this run's is 16"),
        # a consistent shape within the limits, but not the one the bytes hold
        (_with_header(GOOD_REQUEST_BYTES, frames.REQUEST_HEADER, b=4), "shape \\(4, 5, 16\\) bf16 .* needs exactly"),
        (_nan_request(), r"activations hold nan at \(1, 3, 9\); allowed finite values only"),
        (_bad_target(50), r"targets hold 50 at \(1, 2\); allowed \[0, 50\)"),
        (_bad_target(-1), r"targets hold -1 at \(1, 2\); allowed \[0, 50\)"),
    ],
)
def test_a_bad_request_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        frames.parse_request(payload, LIMITS)


def test_a_request_for_another_stage_is_refused():
    with pytest.raises(BadPayload, match="targets stage 2; this peer serves stage 3"):
        frames.parse_request(GOOD_REQUEST_BYTES, LIMITS, stage=3)


def test_peek_request_id_reads_what_it_can():
    assert frames.peek_request_id(_bad_target(99)) == 7
    assert frames.peek_request_id(GOOD_REQUEST_BYTES[:10]) == 0
    assert frames.peek_request_id(GOOD_REPLY_BYTES) == 0
    assert frames.peek_request_id(b"") == 0


def _inf_reply() -> bytes:
    reply = _reply(GOOD_REQUEST)
    reply.grad[0, 1, 2] = float("-inf")
    # bypass the encoder's own check: a malicious callee sends what it likes
    return (
        frames.REPLY_HEADER.pack(frames.STAGE_REPLY, 7, frames.BF16, 2, 5, 16, 1.0, 10)
        + reply.grad.view(torch.int16).numpy().astype("<i2").tobytes()
    )


@pytest.mark.parametrize(
    "payload, match",
    [
        (GOOD_REPLY_BYTES[:-1], "needs exactly"),
        (GOOD_REPLY_BYTES[:20], "shorter than its 30-byte header"),
        (GOOD_REQUEST_BYTES, "expected STAGE_REPLY, got STAGE_REQUEST"),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, request_id=8), "answers request 8, expected 7"),
        (
            _with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, dtype=frames.FP32),
            r"gradient is \(2, 5, 16\) fp32; the request sent \(2, 5, 16\) bf16",
        ),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, t=4), r"gradient is \(2, 4, 16\) bf16"),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, b=1 << 31), r"batch B = 2147483648; allowed \[1, 4\]"),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, dtype=3), "dtype code 3"),
        (
            _with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, loss=float("nan")),
            "loss nan; allowed a finite number >= 0",
        ),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, loss=float("inf")), "loss inf"),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, loss=-0.5), "loss -0.5"),
        (_with_header(GOOD_REPLY_BYTES, frames.REPLY_HEADER, tokens=11), "counts 11 tokens; allowed at most B·T = 10"),
        (_inf_reply(), r"gradient hold -inf at \(0, 1, 2\)"),
        (frames.ERROR_HEADER.pack(frames.STAGE_ERROR, 8) + b"x", "STAGE_ERROR answers request 8, expected 7"),
        (frames.ERROR_HEADER.pack(frames.STAGE_ERROR, 7) + b"x" * 513, "reason of 513 bytes; allowed at most 512"),
        (frames.ERROR_HEADER.pack(frames.STAGE_ERROR, 7)[:5], "shorter than its 9-byte header"),
    ],
)
def test_a_bad_answer_is_named(payload, match):
    with pytest.raises(BadPayload, match=match):
        frames.parse_answer(payload, LIMITS, request=GOOD_REQUEST)


def test_error_round_trip_strips_control_characters():
    payload = frames.encode_error(7, "boom\x1b[2J\x07 in stage\n2\u202e")
    answer = frames.parse_answer(payload, LIMITS, request=GOOD_REQUEST)
    assert answer == frames.StageError(request_id=7, reason="boom in stage 2")
    # id 0 answers a request whose id the callee could not read
    assert frames.parse_answer(frames.encode_error(0, "bad"), LIMITS, request=GOOD_REQUEST).reason == "bad"


def test_error_reason_is_cut_at_512_bytes_on_a_character_boundary():
    payload = frames.encode_error(1, "é" * 400)  # 800 bytes of UTF-8
    assert len(payload) == frames.ERROR_HEADER.size + 512
    assert frames.parse_error(payload).reason == "é" * 256


def test_encoders_refuse_what_a_receiver_would_refuse():
    request = _request()
    with pytest.raises(ValueError, match="fp32 or bf16, not torch.float16"):
        frames.encode_request(
            StageRequest(
                request_id=1, micro_batch=0, stage=1, activations=request.activations.half(), targets=request.targets
            )
        )
    with pytest.raises(ValueError, match="integer token ids"):
        frames.encode_request(
            StageRequest(
                request_id=1, micro_batch=0, stage=1, activations=request.activations, targets=request.targets.float()
            )
        )
    with pytest.raises(ValueError, match="request_id -1 is not a u64"):
        frames.encode_request(
            StageRequest(
                request_id=-1, micro_batch=0, stage=1, activations=request.activations, targets=request.targets
            )
        )
    for loss, match in ((float("nan"), "loss nan"), (-1.0, "loss -1.0"), (1e39, "overflows f32")):
        with pytest.raises(ValueError, match=match):
            frames.encode_reply(_reply(request, loss=loss))
    bad = _reply(request)
    bad.grad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        frames.encode_reply(bad)
    with pytest.raises(ValueError, match="token count 11"):
        frames.encode_reply(_reply(request, tokens=11))


def test_limits_are_validated():
    with pytest.raises(ValueError, match="hidden_size must be an integer in"):
        StageLimits(max_batch_sequences=1, max_seq_len_tokens=1, hidden_size=0, vocab_size=2, stages=2)
    with pytest.raises(ValueError, match="stages must be an integer in \\[2, 65535\\], got 1"):
        StageLimits(max_batch_sequences=1, max_seq_len_tokens=1, hidden_size=1, vocab_size=2, stages=1)


def test_max_request_bytes_is_exactly_the_largest_request_and_caps_the_reader():
    b, t, h = LIMITS.max_batch_sequences, LIMITS.max_seq_len_tokens, LIMITS.hidden_size
    largest = StageRequest(
        request_id=1,
        micro_batch=1,
        stage=1,
        activations=torch.ones(b, t, h),
        targets=torch.zeros(b, t, dtype=torch.int32),
    )
    payload = frames.encode_request(largest)
    assert len(payload) == frames.max_request_bytes(LIMITS)
    assert len(
        frames.encode_reply(StageReply(request_id=1, grad=torch.ones(b, t, h), loss=1.0, tokens=1))
    ) == frames.max_answer_bytes(LIMITS)

    async def read(data: bytes) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await framing.read_frame(reader, max_bytes=frames.max_request_bytes(LIMITS), timeout=1.0)

    assert asyncio.run(read(framing.frame(payload))) == payload
    with pytest.raises(BadPayload, match="at most"):
        asyncio.run(read(framing.frame(payload + b"\0")))


def _mutations(rng: random.Random, good: list[bytes]):
    """Good frames flipped, cut, extended, with header fields set to edge values, and plain noise."""
    edges = [0, 1, 2, 3, 4, 5, 7, 8, 16, 50, 255, 0xFFFF, 0xFFFFFFFF]
    for _ in range(4000):
        seed = rng.choice(good)
        how = rng.randrange(6)
        if how == 0:
            i = rng.randrange(len(seed))
            yield seed[:i] + bytes([seed[i] ^ rng.randrange(1, 256)]) + seed[i + 1 :]
        elif how == 1:
            yield seed[: rng.randrange(len(seed) + 1)]
        elif how == 2:
            yield seed + rng.randbytes(rng.randrange(1, 64))
        elif how == 3:
            yield rng.randbytes(rng.randrange(0, 300))
        elif how == 4 and seed[0] == frames.STAGE_REQUEST:
            field = rng.choice(["version", "stage", "dtype", "b", "t", "h"])
            limit = {"version": 0xFFFF, "stage": 0xFFFF, "dtype": 255}.get(field, 0xFFFFFFFF)
            yield _with_header(seed, frames.REQUEST_HEADER, **{field: min(rng.choice(edges), limit)})
        elif how == 4 and seed[0] == frames.STAGE_REPLY:
            field = rng.choice(["dtype", "b", "t", "h", "tokens", "loss"])
            value = rng.choice([-1.0, float("nan"), 1e30, 0.0]) if field == "loss" else rng.choice(edges)
            yield _with_header(seed, frames.REPLY_HEADER, **{field: min(value, 255) if field == "dtype" else value})
        else:  # a value in the tensor section set to a NaN or infinity pattern, or a random word
            body_start = frames.REQUEST_HEADER.size if seed[0] == frames.STAGE_REQUEST else frames.REPLY_HEADER.size
            if len(seed) <= body_start + 4:
                yield seed
                continue
            i = rng.randrange(body_start, len(seed) - 4)
            yield seed[:i] + rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x80\x7f", rng.randbytes(4)]) + seed[i + 4 :]


def test_fuzz_only_bad_payload_comes_out():
    rng = random.Random(19)
    good = [
        GOOD_REQUEST_BYTES,
        GOOD_REPLY_BYTES,
        frames.encode_request(_request(torch.float32, b=1, t=1)),
        frames.encode_reply(_reply(_request(torch.float32, b=1, t=1))),
        frames.encode_error(7, "no"),
        frames.encode_request(_request(torch.float32)),
        frames.encode_reply(_reply(_request(torch.float32))),
    ]
    fp32_request = _request(torch.float32)
    outcomes = {"ok": 0, "bad": 0}
    for payload in _mutations(rng, good):
        for parse in (
            lambda p: frames.parse_request(p, LIMITS),
            lambda p: frames.parse_answer(p, LIMITS, request=GOOD_REQUEST),
            lambda p: frames.parse_answer(p, LIMITS, request=fp32_request),
        ):
            try:
                parse(payload)
                outcomes["ok"] += 1
            except BadPayload:
                outcomes["bad"] += 1
    # the mutations reach both outcomes: the loop is not just feeding noise to the kind check
    assert outcomes["ok"] > 100 and outcomes["bad"] > 5000


def test_stage_kinds_are_disjoint_from_the_other_stream_protocols():
    from protocol.wire import allreduce, state

    assert not set(frames.KIND_NAMES) & (set(allreduce.KIND_NAMES) | set(state.KIND_NAMES))
    with pytest.raises(BadPayload, match="unknown frame kind"):
        frames.parse_request(bytes([allreduce.HELLO]) + GOOD_REQUEST_BYTES[1:], LIMITS)
