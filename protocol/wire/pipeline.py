# Three frames with their limits, encoders and parsers; every check a parser makes
# sits beside the layout it checks, and split apart the layout would be written twice.
"""Pipeline stages' frames: one micro-batch's forward and backward per call (framing: framing.py).

A peer serving stage k calls a replica of stage k+1 (peer/pipeline/rpc.py) on a stream of its
own. One call carries a micro-batch's forward and its backward (SWARM parallelism, arXiv
2301.11913): the request holds the stage's input, so any replica of the stage can serve it, and a
caller that gets no answer retries the same request elsewhere::

    caller → callee:  STAGE_REQUEST
    callee → caller:  STAGE_REPLY, or STAGE_ERROR
    (then the caller may send its next STAGE_REQUEST on the same stream, or close it)

Every frame is ``u32 big-endian length`` + ``payload``; the payload's first byte is the kind,
distinct from the all-reduce's (1-4) and the state transfer's (16-19). Header fields are
big-endian; tensors are raw little-endian values, row-major.

============= ===================================================================================
STAGE_REQUEST kind 32, u16 protocol version, u64 request id, u64 micro-batch id, u16 target
              stage, u8 dtype code, u32 B, u32 T, u32 H; then the activations, B·T·H values of
              the dtype; then the targets, B·T int32 token ids in [0, vocab)
STAGE_REPLY   kind 33, u64 request id, u8 dtype code, u32 B, u32 T, u32 H, f32 loss (nats per
              token, finite, >= 0), u32 tokens (<= B·T); then ∂loss/∂activations, B·T·H values
              of the dtype (the request's shape and dtype)
STAGE_ERROR   kind 34, u64 request id (0: the request's id could not be read), then a UTF-8
              reason of at most 512 bytes (read stripped of control characters)
============= ===================================================================================

Dtype codes: 1 fp32 (IEEE binary32), 2 bf16 (the top 16 bits of a binary32).

The parsers check kind, version, stage, dtype and every size against :class:`StageLimits` before
anything is allocated, then that the byte length matches the declared shape exactly, then the
values (finite activations and gradients, target ids in range, loss finite and >= 0). They raise
only :class:`BadPayload`, naming the field, the bad value and what is allowed. Nothing is ever
unpickled; tensors are never passed through ``torch.load``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from protocol.errors import BadPayload
from protocol.text import sanitize
from protocol.version import PROTOCOL_VERSION
from protocol.wire.framing import kind_of

STAGE_REQUEST, STAGE_REPLY, STAGE_ERROR = 32, 33, 34
KIND_NAMES = {STAGE_REQUEST: "STAGE_REQUEST", STAGE_REPLY: "STAGE_REPLY", STAGE_ERROR: "STAGE_ERROR"}
REQUEST_HEADER = struct.Struct(">BHQQHBIII")
REPLY_HEADER = struct.Struct(">BQBIIIfI")
ERROR_HEADER = struct.Struct(">BQ")
MAX_REASON_BYTES = 512
MAX_U64 = (1 << 64) - 1

FP32, BF16 = 1, 2
DTYPES = {FP32: torch.float32, BF16: torch.bfloat16}
"""Dtype code → the torch dtype activations and gradients travel in."""
DTYPE_NAMES = {FP32: "fp32", BF16: "bf16"}
"""Dtype code → its name in a run manifest (``pipeline.activation_dtype``)."""
DTYPE_BY_NAME = {DTYPE_NAMES[code]: dtype for code, dtype in DTYPES.items()}
"""``pipeline.activation_dtype`` → the torch dtype activations and gradients travel in."""
_WIRE: dict[int, tuple[np.dtype[Any], npt.DTypeLike, int]] = {
    FP32: (np.dtype("<f4"), np.float32, 4),
    BF16: (np.dtype("<i2"), np.int16, 2),
}
"""Dtype code → (little-endian numpy dtype of the raw values, native numpy dtype, bytes per value)."""
_TARGETS = np.dtype("<i4")


@dataclass(frozen=True, kw_only=True)
class StageLimits:
    """What a stage call may carry; the run manifest fixes every field.

    A frame beyond these limits is refused before its tensors are allocated.
    """

    max_batch_sequences: int
    """B: most sequences in one micro-batch (manifest: ``batch_sequences`` at most)."""
    max_seq_len_tokens: int
    """T: most tokens per sequence (manifest: ``data.seq_len_tokens``)."""
    hidden_size: int
    """H: width of the activations; a frame must carry exactly this (manifest: ``model.hidden_size``)."""
    vocab_size: int
    """Target token ids lie in ``[0, vocab_size)``."""
    stages: int
    """S: pipeline stages; a request targets a stage in ``[1, S)`` (stage 0 reads the data and is
    never called)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_sequences", "max_seq_len_tokens", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 0xFFFFFFFF:
                raise ValueError(f"StageLimits.{name} must be an integer in [1, 2**32), got {value!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 0xFFFF:
            raise ValueError(f"StageLimits.stages must be an integer in [2, 65535], got {self.stages!r}")


@dataclass(frozen=True, eq=False)
class StageRequest:
    """A micro-batch's input to stage ``stage``.

    Attributes:
        request_id: the call's id, u64; a retry on another replica keeps it.
        micro_batch: the micro-batch's id, u64.
        stage: the target stage's index.
        activations: (B, T, H), fp32 or bf16: the output of stage ``stage - 1``.
        targets: (B, T) int32 token ids, for the last stage's loss.
    """

    request_id: int
    micro_batch: int
    stage: int
    activations: torch.Tensor
    targets: torch.Tensor


@dataclass(frozen=True, eq=False)
class StageReply:
    """The answer to a request: ``grad`` is ∂loss/∂activations, shaped and typed like the request's
    activations; ``loss`` the micro-batch's mean loss in nats per token over ``tokens`` tokens."""

    request_id: int
    grad: torch.Tensor
    loss: float
    tokens: int


@dataclass(frozen=True)
class StageError:
    """A callee's refusal or failure: ``reason`` is printable (control characters stripped)."""

    request_id: int
    reason: str


def max_request_bytes(limits: StageLimits) -> int:
    """Largest STAGE_REQUEST payload ``limits`` allow (fp32 activations at the largest shape)."""
    cells = limits.max_batch_sequences * limits.max_seq_len_tokens
    return REQUEST_HEADER.size + cells * (4 * limits.hidden_size + _TARGETS.itemsize)


def max_answer_bytes(limits: StageLimits) -> int:
    """Largest STAGE_REPLY or STAGE_ERROR payload ``limits`` allow."""
    cells = limits.max_batch_sequences * limits.max_seq_len_tokens
    return max(REPLY_HEADER.size + cells * 4 * limits.hidden_size, ERROR_HEADER.size + MAX_REASON_BYTES)


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``.

    Raises:
        ValueError: ``dtype`` is neither torch.float32 nor torch.bfloat16.
    """
    for code, known in DTYPES.items():
        if dtype == known:
            return code
    raise ValueError(f"activations travel as fp32 or bf16, not {dtype}")


def encode_request(request: StageRequest) -> bytes:
    """The STAGE_REQUEST payload of ``request`` (frame it with ``framing.frame``).

    Raises:
        ValueError: ids out of u64, a stage out of u16, activations not 3-D fp32/bf16, or targets
            not integer and shaped (B, T). Limits are the receiver's to check.
    """
    acts, targets = request.activations, request.targets
    code = dtype_code(acts.dtype)
    if acts.dim() != 3:
        raise ValueError(f"activations must be (B, T, H), got shape {tuple(acts.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got {targets.dtype}")
    if tuple(targets.shape) != tuple(acts.shape[:2]):
        raise ValueError(f"targets shaped {tuple(targets.shape)} do not match activations {tuple(acts.shape)}")
    _check_id("request_id", request.request_id)
    _check_id("micro_batch", request.micro_batch)
    if not 0 <= request.stage <= 0xFFFF:
        raise ValueError(f"stage {request.stage} is outside [0, 65535]")
    b, t, h = acts.shape
    header = REQUEST_HEADER.pack(
        STAGE_REQUEST, PROTOCOL_VERSION, request.request_id, request.micro_batch, request.stage, code, b, t, h
    )
    ids = targets.detach().cpu().to(torch.int32).contiguous().numpy().astype(_TARGETS, copy=False)
    return header + _tensor_bytes(acts, code) + ids.tobytes()


def encode_reply(reply: StageReply) -> bytes:
    """The STAGE_REPLY payload of ``reply``.

    Raises:
        ValueError: an id out of u64, a gradient not 3-D fp32/bf16 or not finite, a loss not
            finite and >= 0, or a token count outside [0, B·T]: what a receiver would refuse.
    """
    grad = reply.grad
    code = dtype_code(grad.dtype)
    if grad.dim() != 3:
        raise ValueError(f"gradient must be (B, T, H), got shape {tuple(grad.shape)}")
    _check_id("request_id", reply.request_id)
    if not math.isfinite(reply.loss) or reply.loss < 0:
        raise ValueError(f"loss {reply.loss!r} must be finite and >= 0")
    b, t, h = grad.shape
    if not 0 <= reply.tokens <= b * t:
        raise ValueError(f"token count {reply.tokens} is outside [0, B·T = {b * t}]")
    if not bool(torch.isfinite(grad).all()):
        raise ValueError("gradient holds non-finite values")
    try:
        header = REPLY_HEADER.pack(STAGE_REPLY, reply.request_id, code, b, t, h, reply.loss, reply.tokens)
    except OverflowError as exc:
        raise ValueError(f"loss {reply.loss!r} overflows f32") from exc
    return header + _tensor_bytes(grad, code)


def encode_error(request_id: int, reason: str) -> bytes:
    """The STAGE_ERROR payload: ``reason`` cut to 512 bytes of UTF-8 (at a character boundary)."""
    _check_id("request_id", request_id)
    body = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return ERROR_HEADER.pack(STAGE_ERROR, request_id) + body


def peek_request_id(payload: bytes) -> int:
    """The request id of a STAGE_REQUEST that may fail to parse, to address the STAGE_ERROR; 0
    when the payload is too short or not a request. Never raises."""
    if len(payload) < REQUEST_HEADER.size or payload[0] != STAGE_REQUEST:
        return 0
    return int(REQUEST_HEADER.unpack_from(payload)[2])


def parse_request(payload: bytes, limits: StageLimits, *, stage: int | None = None) -> StageRequest:
    """Decode and check a STAGE_REQUEST.

    Args:
        limits: the run's limits on shapes, vocabulary and stages.
        stage: the stage this peer serves; a request for another is refused. None: any in range.

    Returns:
        StageRequest whose tensors own their memory (copies of the payload's bytes).

    Raises:
        BadPayload: not a STAGE_REQUEST, shorter than its header, another protocol version, a stage
            outside ``[1, limits.stages)`` or not ``stage``, an unknown dtype code, B, T or H out
            of ``limits`` (checked before anything is allocated), a length that does not match
            the shape, a non-finite activation, or a target id outside ``[0, vocab_size)``.
    """
    _expect(payload, STAGE_REQUEST, REQUEST_HEADER.size)
    _, version, request_id, micro_batch, target, code, b, t, h = REQUEST_HEADER.unpack_from(payload)
    if version != PROTOCOL_VERSION:
        raise BadPayload(f"STAGE_REQUEST speaks protocol version {version}, this peer speaks {PROTOCOL_VERSION}")
    if not 1 <= target < limits.stages:
        raise BadPayload(f"STAGE_REQUEST targets stage {target}; allowed [1, {limits.stages})")
    if stage is not None and target != stage:
        raise BadPayload(f"STAGE_REQUEST targets stage {target}; this peer serves stage {stage}")
    _check_shape("STAGE_REQUEST", code, b, t, h, limits)
    values_end = REQUEST_HEADER.size + b * t * h * _WIRE[code][2]
    expected = values_end + b * t * _TARGETS.itemsize
    if len(payload) != expected:
        raise BadPayload(
            f"STAGE_REQUEST of {len(payload)} bytes; shape ({b}, {t}, {h}) {DTYPE_NAMES[code]} "
            f"with int32 targets needs exactly {expected}"
        )
    activations = _tensor_at(payload, REQUEST_HEADER.size, code, (b, t, h), "STAGE_REQUEST activations")
    ids = np.frombuffer(payload, dtype=_TARGETS, count=b * t, offset=values_end).astype(np.int32)
    bad = np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))
    if bad.size:
        first = int(bad[0])
        raise BadPayload(
            f"STAGE_REQUEST targets hold {int(ids[first])} at ({first // t}, {first % t}); "
            f"allowed [0, {limits.vocab_size})"
        )
    return StageRequest(
        request_id=request_id,
        micro_batch=micro_batch,
        stage=target,
        activations=activations,
        targets=torch.from_numpy(ids).reshape(b, t),
    )


def parse_answer(payload: bytes, limits: StageLimits, *, request: StageRequest) -> StageReply | StageError:
    """Decode and check the callee's answer to ``request``.

    Returns:
        StageReply whose gradient has the request's shape and dtype, or the StageError the callee
        sent (for this request, or with id 0: a request it could not read).

    Raises:
        BadPayload: neither STAGE_REPLY nor STAGE_ERROR, shorter than its header, for another
            request id, a dtype or shape other than the request's or out of ``limits`` (checked
            before anything is allocated), a length that does not match the shape, a non-finite
            gradient value, a loss not finite and >= 0, tokens above B·T, or a reason over 512 bytes.
    """
    kind = kind_of(payload, KIND_NAMES)
    if kind == STAGE_ERROR:
        error = parse_error(payload)
        if error.request_id not in (0, request.request_id):
            raise BadPayload(f"STAGE_ERROR answers request {error.request_id}, expected {request.request_id}")
        return error
    _expect(payload, STAGE_REPLY, REPLY_HEADER.size)
    _, request_id, code, b, t, h, loss, tokens = REPLY_HEADER.unpack_from(payload)
    if request_id != request.request_id:
        raise BadPayload(f"STAGE_REPLY answers request {request_id}, expected {request.request_id}")
    _check_shape("STAGE_REPLY", code, b, t, h, limits)
    sent = (dtype_code(request.activations.dtype), *request.activations.shape)
    if (code, b, t, h) != sent:
        raise BadPayload(
            f"STAGE_REPLY gradient is ({b}, {t}, {h}) {DTYPE_NAMES[code]}; the request sent "
            f"({sent[1]}, {sent[2]}, {sent[3]}) {DTYPE_NAMES[sent[0]]}"
        )
    expected = REPLY_HEADER.size + b * t * h * _WIRE[code][2]
    if len(payload) != expected:
        raise BadPayload(
            f"STAGE_REPLY of {len(payload)} bytes; shape ({b}, {t}, {h}) {DTYPE_NAMES[code]} needs exactly {expected}"
        )
    if not math.isfinite(loss) or loss < 0:
        raise BadPayload(f"STAGE_REPLY loss {loss!r}; allowed a finite number >= 0")
    if tokens > b * t:
        raise BadPayload(f"STAGE_REPLY counts {tokens} tokens; allowed at most B·T = {b * t}")
    grad = _tensor_at(payload, REPLY_HEADER.size, code, (b, t, h), "STAGE_REPLY gradient")
    return StageReply(request_id=request_id, grad=grad, loss=loss, tokens=tokens)


def parse_error(payload: bytes) -> StageError:
    """Decode a STAGE_ERROR; its reason is stripped of control characters (protocol/text.py).

    Raises:
        BadPayload: not a STAGE_ERROR, shorter than its header, or a reason over 512 bytes.
    """
    _expect(payload, STAGE_ERROR, ERROR_HEADER.size)
    if len(payload) > ERROR_HEADER.size + MAX_REASON_BYTES:
        raise BadPayload(
            f"STAGE_ERROR reason of {len(payload) - ERROR_HEADER.size} bytes; allowed at most {MAX_REASON_BYTES}"
        )
    _, request_id = ERROR_HEADER.unpack_from(payload)
    reason = sanitize(bytes(payload[ERROR_HEADER.size :]).decode("utf-8", "replace"))
    return StageError(request_id=request_id, reason=reason)


def _check_id(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= MAX_U64:
        raise ValueError(f"{name} {value!r} is not a u64")


def _expect(payload: bytes, kind: int, header_bytes: int) -> None:
    got = kind_of(payload, KIND_NAMES)
    if got != kind:
        raise BadPayload(f"expected {KIND_NAMES[kind]}, got {KIND_NAMES[got]}")
    if len(payload) < header_bytes:
        raise BadPayload(f"{KIND_NAMES[kind]} of {len(payload)} bytes is shorter than its {header_bytes}-byte header")


def _check_shape(frame_name: str, code: int, b: int, t: int, h: int, limits: StageLimits) -> None:
    if code not in DTYPES:
        raise BadPayload(f"{frame_name} dtype code {code}; allowed {FP32} (fp32) or {BF16} (bf16)")
    if not 1 <= b <= limits.max_batch_sequences:
        raise BadPayload(f"{frame_name} batch B = {b}; allowed [1, {limits.max_batch_sequences}]")
    if not 1 <= t <= limits.max_seq_len_tokens:
        raise BadPayload(f"{frame_name} sequence length T = {t}; allowed [1, {limits.max_seq_len_tokens}]")
    if h != limits.hidden_size:
        raise BadPayload(f"{frame_name} hidden size H = {h}; this run's is {limits.hidden_size}")


def _tensor_bytes(tensor: torch.Tensor, code: int) -> bytes:
    wire = _WIRE[code][0]
    flat = tensor.detach().cpu().contiguous()
    if code == BF16:
        flat = flat.view(torch.int16)  # numpy has no bf16: carry its bits
    return flat.numpy().astype(wire, copy=False).tobytes()


def _tensor_at(payload: bytes, offset: int, code: int, shape: tuple[int, int, int], field: str) -> torch.Tensor:
    """The values at ``offset`` (the caller checked the length), copied, checked finite."""
    wire, native, _ = _WIRE[code]
    count = shape[0] * shape[1] * shape[2]
    values = torch.from_numpy(np.frombuffer(payload, dtype=wire, count=count, offset=offset).astype(native))
    if code == BF16:
        values = values.view(torch.bfloat16)
    values = values.reshape(shape)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise BadPayload(f"{field} hold {float(values[where])} at {where}; allowed finite values only")
    return values
