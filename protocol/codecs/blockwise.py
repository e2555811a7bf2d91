"""Blockwise absmax formats: integers 'int8' and 'int4', E(b−1)M0 floats 'fp4' and 'fp3'.

Layout: ``id | block u32 | scale f32 × nb | codes × n`` (nb = ceil(n / block)); int8 codes are
signed bytes, narrower codes are packed little-endian (4 bits: two per byte, low nibble first;
3 bits: LSB first).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from protocol.codecs.base import BLOCK_RANGE, FLUSH_BELOW, Format, Params, expect_length
from protocol.errors import BadPayload


class Blockwise(Format):
    """Values scaled per block of ``codec.block_size`` elements; subclasses quantize the scaled values."""

    header = struct.Struct("<BI")
    bits: int

    def describe(self, codec: Params) -> str:
        return f"block={codec.block_size}"

    def _size(self, n: int, block: int) -> int:
        return self.header.size + 4 * (-(-n // block)) + -(-n * self.bits // 8)

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        return self._size(math.prod(shape), codec.block_size)

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        n = x.numel()
        padded, absmax = _blocks(x, codec.block_size)
        scale, data = self._quantize(padded, absmax, n)
        return self.header.pack(self.wire_id, codec.block_size) + scale.numpy().tobytes() + data

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        _, block = self.header.unpack_from(mv)
        if not BLOCK_RANGE[0] <= block <= BLOCK_RANGE[1]:
            raise BadPayload(f"{self.name}: block size {block} outside {list(BLOCK_RANGE)}")
        expect_length(self.name, mv, self._size(n, block))
        nb = -(-n // block)
        scale = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=nb, offset=self.header.size).copy())
        if not (torch.isfinite(scale).all() and (scale >= 0).all()):
            raise BadPayload(f"{self.name}: a block scale is negative, NaN or inf")
        values = self._dequantize(mv, self.header.size + 4 * nb, n)
        return (torch.nn.functional.pad(values, (0, nb * block - n)).view(nb, block) * scale[:, None]).reshape(-1)[:n]

    def _quantize(self, padded: torch.Tensor, absmax: torch.Tensor, n: int) -> tuple[torch.Tensor, bytes]:
        """(fp32 scale per block, packed codes of the first ``n`` elements) of nb × block ``padded``."""
        raise NotImplementedError

    def _dequantize(self, mv: memoryview, offset: int, n: int) -> torch.Tensor:
        """The ``n`` codes at ``offset`` as fp32 multiples of their block's scale; BadPayload if invalid."""
        raise NotImplementedError


class IntBlock(Blockwise):
    """Symmetric integers: levels −L..L with L = 2^(bits−1) − 1, scale absmax / L, round to nearest."""

    def __init__(self, name: str, wire_id: int, bits: int):
        super().__init__(name, wire_id)
        self.bits = bits
        self.levels = (1 << (bits - 1)) - 1

    def _quantize(self, padded: torch.Tensor, absmax: torch.Tensor, n: int) -> tuple[torch.Tensor, bytes]:
        levels = self.levels
        live = absmax > 0
        inv = torch.where(live, levels / torch.where(live, absmax, torch.ones_like(absmax)), torch.zeros_like(absmax))
        q = torch.round(padded * inv[:, None]).clamp_(-levels, levels).reshape(-1)[:n]
        if self.bits == 8:  # signed bytes; narrower codes are offset by L + 1 to be unsigned
            return absmax / levels, q.to(torch.int8).numpy().tobytes()
        return absmax / levels, _pack((q + levels + 1).to(torch.uint8), self.bits)

    def _dequantize(self, mv: memoryview, offset: int, n: int) -> torch.Tensor:
        levels = self.levels
        if self.bits == 8:
            values = torch.from_numpy(np.frombuffer(mv, dtype=np.int8, count=n, offset=offset).astype(np.float32))
            if (values == -levels - 1).any():
                raise BadPayload(f"{self.name}: code {-levels - 1} is never produced (levels are -{levels}..{levels})")
            return values
        codes = _unpack(mv, offset, n, self.bits, self.name)
        if (codes == 0).any():
            raise BadPayload(
                f"{self.name}: code 0 (level {-levels - 1}) is never produced (levels are -{levels}..{levels})"
            )
        return (codes - levels - 1).float()


class FloatBlock(Blockwise):
    """E(b−1)M0 floats: code e in 1..E is 2^(e−E) of the block's absmax, code 0 is zero, the top bit
    the sign. fp4 (E = 7): 2^-6 … 1; fp3 (E = 3): 1/4, 1/2, 1."""

    def __init__(self, name: str, wire_id: int, bits: int, exponents: int):
        super().__init__(name, wire_id)
        self.bits, self.exponents = bits, exponents
        mags = [0.0] + [2.0 ** (e - exponents) for e in range(1, exponents + 1)]
        self.lut = torch.tensor(mags + [-m for m in mags])

    def _quantize(self, padded: torch.Tensor, absmax: torch.Tensor, n: int) -> tuple[torch.Tensor, bytes]:
        E, bits = self.exponents, self.bits
        live = absmax > 0
        u = padded.abs() / torch.where(live, absmax, torch.ones_like(absmax))[:, None]
        # Nearest power of two, ties up: adding half a mantissa to the fp32 bits carries into the
        # exponent exactly when the mantissa is ≥ 1.5. Biased exponent 127 + k is level 2^k, code k + E.
        e = (((u.view(torch.int32) + (1 << 22)) >> 23) - (127 - E)).clamp_(1, E)
        e = torch.where(u >= 2.0**-E, e, 0).to(torch.uint8)  # below half the lowest level 2^(1−E): 0
        sign = ((padded < 0) & (e > 0)).to(torch.uint8) << (bits - 1)
        return absmax, _pack((e | sign).reshape(-1)[:n], bits)

    def _dequantize(self, mv: memoryview, offset: int, n: int) -> torch.Tensor:
        codes = _unpack(mv, offset, n, self.bits, self.name)
        if (codes == 1 << (self.bits - 1)).any():
            raise BadPayload(f"{self.name}: code {1 << (self.bits - 1)} (negative zero) is never produced")
        return self.lut[codes]


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_blocks × block view of x zero-padded, absmax per block with tiny blocks flushed to 0)."""
    flat = x.reshape(-1)
    pad = -flat.numel() % block
    padded = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    absmax = padded.abs().amax(dim=1) if padded.numel() else torch.zeros(0)
    return padded, torch.where(absmax < FLUSH_BELOW, torch.zeros_like(absmax), absmax)


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """uint8 codes < 2^bits, packed little-endian: nibbles low first (4 bits), else LSB-first bits."""
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        return (codes[0::2] | (codes[1::2] << 4)).numpy().tobytes()
    planes = np.unpackbits(codes.numpy()[:, None], axis=1, count=bits, bitorder="little")
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _unpack(mv: memoryview, offset: int, n: int, bits: int, what: str) -> torch.Tensor:
    """Codes as int64; BadPayload unless the padding bits after the last code are zero."""
    raw = np.frombuffer(mv, dtype=np.uint8, count=-(-n * bits // 8), offset=offset)
    if bits == 4:
        codes = np.stack([raw & 15, raw >> 4], axis=1).reshape(-1)
    else:
        flat = np.unpackbits(raw, bitorder="little")
        if flat[n * bits :].any():
            raise BadPayload(f"{what}: padding bits after the last element are not 0")
        codes = np.packbits(flat[: n * bits].reshape(n, bits), axis=1, bitorder="little").reshape(-1)
    if bits == 4 and n % 2 and codes[n] != 0:
        raise BadPayload(f"{what}: the padding nibble after the last element is {int(codes[n])}, not 0")
    return torch.from_numpy(codes[:n].astype(np.int64))
