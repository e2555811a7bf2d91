"""Structured formats of matrices: 'topk' (largest magnitudes) and 'lowrank' (PowerSGD-style).

Their values are 16-bit floats with a power-of-two shift (:func:`~protocol.codecs.dense.to_half`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from protocol.codecs.base import TOPK_CHUNK, Format, Params, expect_length
from protocol.codecs.dense import from_half, to_half
from protocol.errors import BadPayload


class TopK(Format):
    """``id | shift i16 | k u32 | count u32 × ceil(n / 65536) | offset u16 × k | f16s × k``.

    Keeps the k = ``multiplier`` · ceil(``topk_fraction`` · n) largest |x| (sorted indices, as
    offsets within chunks of ``TOPK_CHUNK``), the others decode as 0.
    """

    structured = True
    header = struct.Struct("<BhI")

    def describe(self, codec: Params) -> str:
        return f"fraction={codec.topk_fraction}×{codec.multiplier}"

    @staticmethod
    def _k(codec: Params, n: int) -> int:
        return min(n, codec.multiplier * math.ceil(codec.topk_fraction * n)) if n else 0

    def _size(self, n: int, k: int) -> int:
        return self.header.size + 4 * (-(-n // TOPK_CHUNK)) + 4 * k

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        n = math.prod(shape)
        return self._size(n, self._k(codec, n))

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        flat = x.reshape(-1)
        n = flat.numel()
        k = self._k(codec, n)
        idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values if k else torch.zeros(0, dtype=torch.long)
        counts = torch.bincount(idx // TOPK_CHUNK, minlength=-(-n // TOPK_CHUNK))
        shift, values = to_half(flat[idx], torch.float16)
        offsets = (idx % TOPK_CHUNK).numpy().astype("<u2")
        return (
            self.header.pack(self.wire_id, shift, k)
            + counts.numpy().astype("<u4").tobytes()
            + offsets.tobytes()
            + values
        )

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        _, shift, k = self.header.unpack_from(mv)
        if k > n:
            raise BadPayload(f"{self.name}: k = {k} exceeds the tensor's {n} elements")
        expect_length(self.name, mv, self._size(n, k))
        chunks = -(-n // TOPK_CHUNK)
        counts = torch.from_numpy(
            np.frombuffer(mv, dtype="<u4", count=chunks, offset=self.header.size).astype(np.int64)
        )
        if int(counts.sum()) != k:
            raise BadPayload(f"{self.name}: per-chunk counts sum to {int(counts.sum())}, header says k = {k}")
        offset = self.header.size + 4 * chunks
        offsets = torch.from_numpy(np.frombuffer(mv, dtype="<u2", count=k, offset=offset).astype(np.int64))
        starts = torch.arange(chunks, dtype=torch.int64) * TOPK_CHUNK
        idx = starts.repeat_interleave(counts) + offsets
        if k and (idx[-1] >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
            raise BadPayload(f"{self.name}: indices are out of range, unsorted or repeated")
        values = from_half(mv, offset + 2 * k, k, shift, False, self.name)
        out = torch.zeros(n)
        out[idx] = values
        return out


class LowRank(Format):
    """``id | rank u16 | shift_p i16 | shift_q i16 | P f16s (rows × r) | Q f16s (cols × r)``.

    The tensor as a rows × cols matrix M (rows = its first dimension) ≈ P Qᵀ, of rank
    r = min(``multiplier`` · ``rank``, rows, cols); one power iteration from a Q0 drawn from the seed.
    """

    structured = True
    header = struct.Struct("<BHhh")

    def describe(self, codec: Params) -> str:
        return f"rank={codec.rank}×{codec.multiplier}"

    @staticmethod
    def _dims(shape: Sequence[int]) -> tuple[int, int]:
        rows = shape[0]
        return rows, (math.prod(shape) // rows if rows else 0)

    def _size(self, rows: int, cols: int, r: int) -> int:
        return self.header.size + 2 * r * (rows + cols)

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        rows, cols = self._dims(shape)
        return self._size(rows, cols, min(codec.rank * codec.multiplier, rows, cols))

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        rows, cols = self._dims(x.shape)
        r = min(codec.rank * codec.multiplier, rows, cols)
        m = x.reshape(rows, cols)
        g = torch.Generator().manual_seed(seed % (1 << 63))
        q0 = torch.randn(cols, r, generator=g)
        p, _ = torch.linalg.qr(m @ q0)  # orthonormal basis of M's range sampled by Q0 (PowerSGD Alg. 1)
        q = m.T @ p  # M ≈ P Qᵀ = P Pᵀ M, a projection: ‖M̂‖ ≤ ‖M‖
        shift_p, p_bytes = to_half(p.contiguous(), torch.float16)
        shift_q, q_bytes = to_half(q.contiguous(), torch.float16)
        return self.header.pack(self.wire_id, r, shift_p, shift_q) + p_bytes + q_bytes

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        _, r, shift_p, shift_q = self.header.unpack_from(mv)
        if len(shape) < 2 or n == 0:
            raise BadPayload(f"{self.name}: shape {shape} is not a non-empty tensor of 2 or more dimensions")
        rows, cols = self._dims(shape)
        if not 1 <= r <= min(rows, cols):
            raise BadPayload(f"{self.name}: rank {r} outside [1, {min(rows, cols)}] for a {rows} × {cols} matrix")
        expect_length(self.name, mv, self._size(rows, cols, r))
        p = from_half(mv, self.header.size, rows * r, shift_p, False, f"{self.name} P").view(rows, r)
        q = from_half(mv, self.header.size + 2 * rows * r, cols * r, shift_q, False, f"{self.name} Q").view(cols, r)
        return (p @ q.T).reshape(-1)
