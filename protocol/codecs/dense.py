"""Dense formats: exact fp32 ('none') and 16-bit floats with a power-of-two shift ('fp16', 'bf16').

The 16-bit helpers :func:`to_half` and :func:`from_half` also carry the values of topk and
lowrank (:mod:`protocol.codecs.structured`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from protocol.codecs.base import SHIFT_RANGE, Format, Params, expect_length
from protocol.errors import BadPayload

_F16_TARGET_EXP = 15  # scale so the absmax lands in [2^14, 2^15): below fp16's 65504, far above its normals


class Exact(Format):
    """'none': ``id | fp32 × n``."""

    lossy = False

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        return 1 + 4 * math.prod(shape)

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        return bytes([self.wire_id]) + x.numpy().tobytes()

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        expect_length(self.name, mv, 1 + 4 * n)
        return torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=n, offset=1).copy())


class Half(Format):
    """'fp16' or 'bf16': ``id | shift i16 | 16-bit values × n``, the values times 2^shift."""

    header = struct.Struct("<Bh")

    def __init__(self, name: str, wire_id: int, dtype: torch.dtype):
        super().__init__(name, wire_id)
        self.dtype = dtype

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        return self.header.size + 2 * math.prod(shape)

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        shift, data = to_half(x, self.dtype)
        return self.header.pack(self.wire_id, shift) + data

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        expect_length(self.name, mv, self.header.size + 2 * n)
        _, shift = self.header.unpack_from(mv)
        return from_half(mv, self.header.size, n, shift, self.dtype == torch.bfloat16, self.name)


def _shift_for(absmax: float) -> int:
    """The s with absmax / 2^s in [2^14, 2^15); 0 for an all-zero tensor."""
    if absmax == 0.0:
        return 0
    return math.frexp(absmax)[1] - _F16_TARGET_EXP


def _ldexp(x: torch.Tensor, s: int) -> torch.Tensor:
    """x · 2^s, exact while the result is a normal fp32 (the fp32 path needs 2^s normal)."""
    if -126 <= s <= 127:
        return x * (2.0**s)
    return (x.double() * (2.0**s)).float()


def to_half(x: torch.Tensor, dtype: torch.dtype) -> tuple[int, bytes]:
    """(shift, little-endian 16-bit values) of fp32 ``x``: the values are ``x / 2^shift`` as ``dtype``."""
    shift = _shift_for(float(x.abs().max())) if x.numel() else 0
    y = _ldexp(x, -shift).to(dtype)
    return shift, y.view(torch.int16).numpy().tobytes()


def from_half(mv: memoryview, offset: int, count: int, shift: int, bf16: bool, what: str) -> torch.Tensor:
    """``count`` 16-bit values at ``offset`` times 2^shift as fp32; BadPayload on a bad shift or NaN/inf."""
    if not SHIFT_RANGE[0] <= shift <= SHIFT_RANGE[1]:
        raise BadPayload(f"{what}: power-of-two shift {shift} outside {list(SHIFT_RANGE)}")
    raw = np.frombuffer(mv, dtype="<u2", count=count, offset=offset)
    if bf16:
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.view(np.float16).astype(np.float32)
    out = torch.from_numpy(values)
    if not torch.isfinite(out).all():
        raise BadPayload(f"{what}: a 16-bit value is NaN or inf")
    return _ldexp(out, shift)
