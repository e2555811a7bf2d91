"""Codecs for pseudo-gradients: fp32 tensors to self-describing bytes and back (no networking).

ALGORITHMS.md §5 lists what the field uses; this module implements each as a :class:`Codec`
made by :func:`make_codec` from the run's ``[compression]`` section. An encoding starts with a
one-byte wire id, then the codec's parameters, then the data, so :func:`decode` needs only the
bytes and the tensor's shape. Decoding validates everything before it allocates (exact length
for the shape, parameters in bounds, indices in range, scales and values finite) and raises only
:class:`~protocol.errors.BadPayload`. Sums of decoded tensors are the caller's job, in fp32.

Wire layouts (little-endian; n = numel; "f16s" = fp16 values times 2^shift, see ``_to_half``)::

    none     id | fp32 × n
    fp16     id | shift i16 | fp16 × n           bf16: the same with bf16 values
    int8     id | block u32 | scale f32 × nb | int8 × n              (nb = ceil(n / block))
    int4     id | block u32 | scale f32 × nb | 4-bit codes × n, two per byte, low nibble first
    fp4      id | block u32 | scale f32 × nb | 4-bit codes × n (E3M0: sign + 3 exponent bits)
    fp3      id | block u32 | scale f32 × nb | 3-bit codes × n, LSB first (E2M0; adaptive only)
    topk     id | shift i16 | k u32 | count u32 × ceil(n / 65536) | offset u16 × k | f16s × k
    lowrank  id | rank u16 | shift_p i16 | shift_q i16 | P f16s (rows × r) | Q f16s (cols × r)

Stated round-trip bounds (checked by tests/unit/test_codecs.py), per element, where ``a`` is
the absolute maximum of the element's block (int8, int4, fp4, fp3) or of the whole tensor::

    none     exact
    fp16     |x − x̂| ≤ 2^-11·|x| + 2^-39·a      (power-of-two shift: no overflow, no underflow)
    bf16     |x − x̂| ≤ 2^-8·|x|  + 2^-140·a
    int8     |x − x̂| ≤ a/254                   (round to nearest, no clipping)
    int4     |x − x̂| ≤ a/14
    fp4      |x − x̂| ≤ max(|x|/3, a/128)
    fp3      |x − x̂| ≤ max(|x|/3, a/8)
    topk     kept elements as fp16, the others exactly 0: |x − x̂| ≤ |x| and ≤ the k-th largest |x|
    lowrank  ‖M − M̂‖_F ≤ ‖M‖_F·(1 + 2^-9); exact (to fp16 precision) when rank(M) ≤ r

Each bound holds up to fp32 rounding (a few ulp of ``a``). Blocks whose absmax is below
``FLUSH_BELOW`` (2^-110) decode as zeros. Lossy codecs encode a tensor holding a value of
magnitude ≥ ``LOSSY_MAX`` (2^100 ≈ 1.3e30: a diverged run) as ``none`` (exact fp32) rather than overflow.
"""

from __future__ import annotations

import logging
import math
import struct
import sys
from typing import Sequence

import numpy as np
import torch

from protocol.errors import BadPayload
from protocol.manifest import CompressionSpec

if sys.byteorder != "little":  # the wire is little-endian and the arrays below are native views
    raise ImportError("protocol.codecs supports little-endian hosts only")

logger = logging.getLogger(__name__)

WIRE_IDS = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "int4": 4, "fp4": 5, "topk": 6, "lowrank": 7, "fp3": 8}
"""First byte of every encoding."""
NAMES = {v: k for k, v in WIRE_IDS.items()}
HEADER_MAX_BYTES = 16
"""Every encoding is at most 4·numel + this many bytes (:func:`max_encoded_bytes`)."""
LOSSY_MAX = 2.0**100
"""Lossy codecs send a tensor holding |x| ≥ this as exact fp32 (no codec overflows below it)."""
FLUSH_BELOW = 2.0**-110
"""Blocks (int8, int4, fp4, fp3) whose absmax is below this decode as zeros: their scales stay normal fp32."""
BLOCK_RANGE = (8, 1 << 20)
"""Block sizes a decoder accepts (the manifest's range for ``compression.block_size``)."""
TOPK_CHUNK = 1 << 16
"""top-k indices are sent as u16 offsets within chunks of this many elements, plus a count per chunk."""
SHIFT_RANGE = (-200, 200)
"""Power-of-two shifts a decoder accepts; fp32 needs [-165, 113]."""
ELEMENTWISE_FALLBACK = "none"
"""What topk and lowrank send for 0-D and 1-D tensors (norm gains, biases): exact fp32, as DiLoCoX
leaves 1-D tensors uncompressed. They are a small share of any model's bytes."""
DENSE_FALLBACK = "fp16"
"""What topk and lowrank send when their encoding of a tensor would be at least as large as this."""

_HDR_SHIFT = struct.Struct("<Bh")  # fp16, bf16
_HDR_BLOCK = struct.Struct("<BI")  # int8, int4, fp4, fp3
_HDR_TOPK = struct.Struct("<BhI")
_HDR_LOWRANK = struct.Struct("<BHhh")
_F16_TARGET_EXP = 15  # scale so the absmax lands in [2^14, 2^15): below fp16's 65504, far above its normals


def _shape_numel(shape: Sequence[int]) -> int:
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadPayload(f"shape {tuple(shape)!r} must be a tuple of non-negative integers")
    return math.prod(shape)


def max_encoded_bytes(shape: Sequence[int]) -> int:
    """Upper bound of any codec's encoding of a tensor of ``shape``: ``4·numel + HEADER_MAX_BYTES``."""
    return 4 * _shape_numel(tuple(shape)) + HEADER_MAX_BYTES


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 with a power-of-two shift


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


def _to_half(x: torch.Tensor, dtype: torch.dtype) -> tuple[int, bytes]:
    """(shift, little-endian 16-bit values) of fp32 ``x``."""
    shift = _shift_for(float(x.abs().max())) if x.numel() else 0
    y = _ldexp(x, -shift).to(dtype)
    return shift, y.view(torch.int16).numpy().tobytes()


def _from_half(mv: memoryview, offset: int, count: int, shift: int, bf16: bool, what: str) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------
# Blockwise absmax quantizers: int8, int4, fp4 (E3M0), fp3 (E2M0)

_INT_LEVELS = {"int8": 127, "int4": 7}
_BITS = {"int8": 8, "int4": 4, "fp4": 4, "fp3": 3}
_FP_EXPONENTS = {"fp4": 7, "fp3": 3}
"""E(b−1)M0 floats: code e in 1..E is 2^(e−E) of the block's absmax, code 0 is zero, the top bit
the sign. fp4: 2^-6 … 1; fp3: 1/4, 1/2, 1."""
_FP_LUT = {
    name: torch.tensor(mags + [-m for m in mags])
    for name, E in _FP_EXPONENTS.items()
    for mags in [[0.0] + [2.0 ** (e - E) for e in range(1, E + 1)]]
}


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_blocks × block view of x zero-padded, absmax per block with tiny blocks flushed to 0)."""
    flat = x.reshape(-1)
    pad = -flat.numel() % block
    padded = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    absmax = padded.abs().amax(dim=1) if padded.numel() else torch.zeros(0)
    return padded, torch.where(absmax < FLUSH_BELOW, torch.zeros_like(absmax), absmax)


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """uint8 codes < 2^bits, packed little-endian: nibbles low first (4 bits), else LSB-first bits."""
    if bits == 8:
        return codes.numpy().tobytes()
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
        if flat[n * bits:].any():
            raise BadPayload(f"{what}: padding bits after the last element are not 0")
        codes = np.packbits(flat[: n * bits].reshape(n, bits), axis=1, bitorder="little").reshape(-1)
    if bits == 4 and n % 2 and codes[n] != 0:
        raise BadPayload(f"{what}: the padding nibble after the last element is {int(codes[n])}, not 0")
    return torch.from_numpy(codes[:n].astype(np.int64))


def _encode_block(name: str, x: torch.Tensor, block: int) -> bytes:
    n = x.numel()
    padded, absmax = _blocks(x, block)
    live = absmax > 0
    if name in _FP_EXPONENTS:
        E, bits = _FP_EXPONENTS[name], _BITS[name]
        scale = absmax
        u = padded.abs() / torch.where(live, absmax, torch.ones_like(absmax))[:, None]
        # Nearest power of two, ties up: adding half a mantissa to the fp32 bits carries into the
        # exponent exactly when the mantissa is ≥ 1.5. Biased exponent 127 + k is level 2^k, code k + E.
        e = (((u.view(torch.int32) + (1 << 22)) >> 23) - (127 - E)).clamp_(1, E)
        e = torch.where(u >= 2.0**-E, e, 0).to(torch.uint8)  # below half the lowest level 2^(1−E): 0
        sign = ((padded < 0) & (e > 0)).to(torch.uint8) << (bits - 1)
        data = _pack((e | sign).reshape(-1)[:n], bits)
    else:
        levels = _INT_LEVELS[name]
        scale = absmax / levels
        inv = torch.where(live, levels / torch.where(live, absmax, torch.ones_like(absmax)), torch.zeros_like(absmax))
        q = torch.round(padded * inv[:, None]).clamp_(-levels, levels).reshape(-1)[:n]
        data = q.to(torch.int8).numpy().tobytes() if name == "int8" else _pack((q + 8).to(torch.uint8), 4)
    return _HDR_BLOCK.pack(WIRE_IDS[name], block) + scale.numpy().tobytes() + data


def _block_size_bytes(name: str, n: int, block: int) -> int:
    return _HDR_BLOCK.size + 4 * (-(-n // block)) + -(-n * _BITS[name] // 8)


def _decode_block(name: str, mv: memoryview, n: int) -> torch.Tensor:
    _, block = _HDR_BLOCK.unpack_from(mv)
    if not BLOCK_RANGE[0] <= block <= BLOCK_RANGE[1]:
        raise BadPayload(f"{name}: block size {block} outside {list(BLOCK_RANGE)}")
    _expect_length(name, mv, _block_size_bytes(name, n, block))
    nb = -(-n // block)
    scale = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=nb, offset=_HDR_BLOCK.size).copy())
    if not (torch.isfinite(scale).all() and (scale >= 0).all()):
        raise BadPayload(f"{name}: a block scale is negative, NaN or inf")
    offset = _HDR_BLOCK.size + 4 * nb
    if name == "int8":
        values = torch.from_numpy(np.frombuffer(mv, dtype=np.int8, count=n, offset=offset).astype(np.float32))
        if (values == -128).any():
            raise BadPayload("int8: code -128 is never produced (levels are -127..127)")
    elif name == "int4":
        codes = _unpack(mv, offset, n, 4, name)
        if (codes == 0).any():
            raise BadPayload("int4: code 0 (level -8) is never produced (levels are -7..7)")
        values = (codes - 8).float()
    else:
        codes = _unpack(mv, offset, n, _BITS[name], name)
        if (codes == 1 << (_BITS[name] - 1)).any():
            raise BadPayload(f"{name}: code {1 << (_BITS[name] - 1)} (negative zero) is never produced")
        values = _FP_LUT[name][codes]
    return (torch.nn.functional.pad(values, (0, nb * block - n)).view(nb, block) * scale[:, None]).reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------
# top-k and low-rank


def _topk_k(n: int, fraction: float, multiplier: int) -> int:
    return min(n, multiplier * math.ceil(fraction * n)) if n else 0


def _topk_size(n: int, k: int) -> int:
    return _HDR_TOPK.size + 4 * (-(-n // TOPK_CHUNK)) + 4 * k


def _encode_topk(x: torch.Tensor, k: int) -> bytes:
    flat = x.reshape(-1)
    n = flat.numel()
    idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values if k else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(idx // TOPK_CHUNK, minlength=-(-n // TOPK_CHUNK))
    shift, values = _to_half(flat[idx], torch.float16)
    offsets = (idx % TOPK_CHUNK).numpy().astype("<u2")
    return (_HDR_TOPK.pack(WIRE_IDS["topk"], shift, k) + counts.numpy().astype("<u4").tobytes()
            + offsets.tobytes() + values)


def _decode_topk(mv: memoryview, n: int) -> torch.Tensor:
    _, shift, k = _HDR_TOPK.unpack_from(mv)
    if k > n:
        raise BadPayload(f"topk: k = {k} exceeds the tensor's {n} elements")
    _expect_length("topk", mv, _topk_size(n, k))
    chunks = -(-n // TOPK_CHUNK)
    counts = torch.from_numpy(np.frombuffer(mv, dtype="<u4", count=chunks, offset=_HDR_TOPK.size).astype(np.int64))
    if int(counts.sum()) != k:
        raise BadPayload(f"topk: per-chunk counts sum to {int(counts.sum())}, header says k = {k}")
    offset = _HDR_TOPK.size + 4 * chunks
    offsets = torch.from_numpy(np.frombuffer(mv, dtype="<u2", count=k, offset=offset).astype(np.int64))
    starts = torch.arange(chunks, dtype=torch.int64) * TOPK_CHUNK
    idx = starts.repeat_interleave(counts) + offsets
    if k and (idx[-1] >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
        raise BadPayload("topk: indices are out of range, unsorted or repeated")
    values = _from_half(mv, offset + 2 * k, k, shift, False, "topk")
    out = torch.zeros(n)
    out[idx] = values
    return out


def _lowrank_dims(shape: Sequence[int]) -> tuple[int, int]:
    rows = shape[0]
    return rows, (math.prod(shape) // rows if rows else 0)


def _lowrank_size(rows: int, cols: int, r: int) -> int:
    return _HDR_LOWRANK.size + 2 * r * (rows + cols)


def _encode_lowrank(x: torch.Tensor, r: int, seed: int) -> bytes:
    rows, cols = _lowrank_dims(x.shape)
    m = x.reshape(rows, cols)
    g = torch.Generator().manual_seed(seed % (1 << 63))
    q0 = torch.randn(cols, r, generator=g)
    p, _ = torch.linalg.qr(m @ q0)  # orthonormal basis of M's range sampled by Q0 (PowerSGD Alg. 1)
    q = m.T @ p  # M ≈ P Qᵀ = P Pᵀ M, a projection: ‖M̂‖ ≤ ‖M‖
    shift_p, p_bytes = _to_half(p.contiguous(), torch.float16)
    shift_q, q_bytes = _to_half(q.contiguous(), torch.float16)
    return _HDR_LOWRANK.pack(WIRE_IDS["lowrank"], r, shift_p, shift_q) + p_bytes + q_bytes


def _decode_lowrank(mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
    _, r, shift_p, shift_q = _HDR_LOWRANK.unpack_from(mv)
    if len(shape) < 2 or n == 0:
        raise BadPayload(f"lowrank: shape {shape} is not a non-empty tensor of 2 or more dimensions")
    rows, cols = _lowrank_dims(shape)
    if not 1 <= r <= min(rows, cols):
        raise BadPayload(f"lowrank: rank {r} outside [1, {min(rows, cols)}] for a {rows} × {cols} matrix")
    _expect_length("lowrank", mv, _lowrank_size(rows, cols, r))
    p = _from_half(mv, _HDR_LOWRANK.size, rows * r, shift_p, False, "lowrank P").view(rows, r)
    q = _from_half(mv, _HDR_LOWRANK.size + 2 * rows * r, cols * r, shift_q, False, "lowrank Q").view(cols, r)
    return (p @ q.T).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Public API


class Codec:
    """One configured codec. ``encode`` output is self-describing; decode it with :func:`decode`.

    Attributes:
        name: 'none', 'fp16', 'bf16', 'int8', 'int4', 'fp4', 'topk' or 'lowrank'; also 'fp3',
            which no manifest names but :func:`peer.sync.adaptive.plan` may choose.
        lossy: False only for 'none'.
        block_size: elements per absmax block (int8, int4, fp4, fp3).
        topk_fraction: share of elements top-k keeps, times ``multiplier``.
        rank: rank of lowrank, times ``multiplier``.
        multiplier: 1 for a peer's own Δ; the group size for the codec of a group mean.
    """

    def __init__(self, name: str, *, block_size: int = 64, topk_fraction: float = 0.01, rank: int = 4,
                 multiplier: int = 1):
        if name not in WIRE_IDS:
            raise ValueError(f"codec {name!r} unknown: choose one of {sorted(WIRE_IDS)}")
        if not BLOCK_RANGE[0] <= block_size <= BLOCK_RANGE[1]:
            raise ValueError(f"block_size = {block_size} outside {list(BLOCK_RANGE)}")
        if not 0.0 < topk_fraction <= 1.0 or rank < 1 or multiplier < 1:
            raise ValueError(f"topk_fraction = {topk_fraction}, rank = {rank}, multiplier = {multiplier}: "
                             "need a fraction in (0, 1] and positive integers")
        self.name, self.lossy = name, name != "none"
        self.block_size, self.topk_fraction, self.rank, self.multiplier = block_size, topk_fraction, rank, multiplier

    def __repr__(self) -> str:
        if self.name in _BITS:
            extra = f"block={self.block_size}"
        elif self.name == "topk":
            extra = f"fraction={self.topk_fraction}×{self.multiplier}"
        elif self.name == "lowrank":
            extra = f"rank={self.rank}×{self.multiplier}"
        else:
            extra = ""
        return f"Codec({self.name}{', ' + extra if extra else ''})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    @property
    def structured(self) -> bool:
        """True for topk and lowrank: the group mean is exact under :meth:`for_mean` only if every
        contribution, the owner's own rows included, went through this codec (with its error
        feedback). Elementwise codecs may leave the owner's own rows exact."""
        return self.name in ("topk", "lowrank")

    def for_mean(self, group_size: int) -> Codec:
        """The codec an owner uses to send the group's mean back (no error feedback there).

        Elementwise codecs: this one. topk: k × ``group_size`` (the mean of n top-k tensors has
        at most n·k nonzeros, so it is sent exactly up to fp16 value precision). lowrank: rank ×
        ``group_size`` (one power iteration recovers a matrix of rank ≤ r exactly). Both claims
        need every contribution to be a decoded encoding (see :attr:`structured`).
        """
        if group_size < 1:
            raise ValueError(f"group_size = {group_size}: need at least 1")
        if self.name not in ("topk", "lowrank"):
            return self
        return Codec(self.name, block_size=self.block_size, topk_fraction=self.topk_fraction, rank=self.rank,
                     multiplier=self.multiplier * group_size)

    def resolve(self, shape: Sequence[int]) -> str:
        """The wire format this codec uses for a tensor of ``shape`` (its fallbacks applied)."""
        n = math.prod(shape)
        if self.name == "topk":
            if len(shape) < 2:
                return ELEMENTWISE_FALLBACK
            return "topk" if _topk_size(n, _topk_k(n, self.topk_fraction, self.multiplier)) < 3 + 2 * n \
                else DENSE_FALLBACK
        if self.name == "lowrank":
            if len(shape) < 2:
                return ELEMENTWISE_FALLBACK
            rows, cols = _lowrank_dims(shape)
            r = min(self.rank * self.multiplier, rows, cols)
            return "lowrank" if n and _lowrank_size(rows, cols, r) < 3 + 2 * n else DENSE_FALLBACK
        return self.name

    def encoded_size(self, shape: Sequence[int]) -> int:
        """Bytes of ``encode`` of a finite tensor of ``shape`` (all of whose |x| < 2^100)."""
        n = math.prod(shape)
        fmt = self.resolve(shape)
        if fmt == "none":
            return 1 + 4 * n
        if fmt in ("fp16", "bf16"):
            return _HDR_SHIFT.size + 2 * n
        if fmt == "topk":
            return _topk_size(n, _topk_k(n, self.topk_fraction, self.multiplier))
        if fmt == "lowrank":
            rows, cols = _lowrank_dims(shape)
            return _lowrank_size(rows, cols, min(self.rank * self.multiplier, rows, cols))
        return _block_size_bytes(fmt, n, self.block_size)

    def encode(self, x: torch.Tensor, *, seed: int) -> bytes:
        """Encode ``x`` (any shape, may be empty) to self-describing bytes.

        Args:
            x: a floating tensor; it is read as fp32 and left unchanged.
            seed: the round's shared seed; lowrank draws its Q0 from ``torch.Generator`` seeded
                with it, the other codecs ignore it. Encoding is deterministic given (x, seed).

        Returns:
            At most :func:`max_encoded_bytes` bytes; :meth:`encoded_size` gives the exact count.

        Raises:
            BadPayload: ``x`` holds NaN or inf.
        """
        x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if not bool(torch.isfinite(x).all()):
            raise BadPayload(f"cannot encode a tensor of shape {tuple(x.shape)} that holds NaN or inf")
        fmt = self.resolve(tuple(x.shape))
        if fmt != "none" and x.numel() and float(x.abs().max()) >= LOSSY_MAX:
            logger.warning("a tensor of shape %s has |x| >= 2^100: sending it as exact fp32, not %s",
                           tuple(x.shape), fmt)
            fmt = "none"
        if fmt == "none":
            return bytes([WIRE_IDS["none"]]) + x.numpy().tobytes()
        if fmt in ("fp16", "bf16"):
            shift, data = _to_half(x, torch.float16 if fmt == "fp16" else torch.bfloat16)
            return _HDR_SHIFT.pack(WIRE_IDS[fmt], shift) + data
        if fmt == "topk":
            return _encode_topk(x, _topk_k(x.numel(), self.topk_fraction, self.multiplier))
        if fmt == "lowrank":
            rows, cols = _lowrank_dims(x.shape)
            return _encode_lowrank(x, min(self.rank * self.multiplier, rows, cols), seed)
        return _encode_block(fmt, x, self.block_size)

    def roundtrip(self, x: torch.Tensor, *, seed: int) -> tuple[bytes, torch.Tensor]:
        """(encode(x), decode of that encoding): what goes on the wire and what every receiver gets.

        Raises:
            BadPayload: ``x`` holds NaN or inf.
        """
        data = self.encode(x, seed=seed)
        return data, decode(data, tuple(x.shape), seed=seed)


def make_codec(spec: CompressionSpec, shape: torch.Size | tuple[int, ...], *, role: str = "delta") -> Codec:
    """The codec a run's ``[compression]`` section names for one tensor.

    Args:
        spec: the run's compression section.
        shape: the tensor's full shape. 0-D and 1-D tensors never use topk or lowrank: they get
            ``ELEMENTWISE_FALLBACK`` (exact fp32). A codec made for a full shape also encodes
            any row slice of it (its fallbacks are decided per encoded tensor).
        role: 'delta' (the pseudo-gradient: ``spec.codec``) or 'phi' (NoLoCo's φ half:
            ``spec.phi_codec``).

    Raises:
        ValueError: unknown role, or ``spec.codec`` is 'adaptive' (use :func:`peer.sync.adaptive.plan`).
    """
    if role not in ("delta", "phi"):
        raise ValueError(f"role = {role!r}: choose 'delta' or 'phi'")
    name = spec.codec if role == "delta" else spec.phi_codec
    if name == "adaptive":
        raise ValueError("compression.codec = 'adaptive' picks a codec per tensor each round: "
                         "call peer.sync.adaptive.plan, not make_codec")
    if name in ("topk", "lowrank") and len(shape) < 2:
        name = ELEMENTWISE_FALLBACK
    return Codec(name, block_size=spec.block_size, topk_fraction=spec.topk_fraction, rank=spec.rank)


def _expect_length(what: str, mv: memoryview, expected: int) -> None:
    if len(mv) != expected:
        raise BadPayload(f"{what}: {len(mv)} bytes, expected exactly {expected} for this shape")


def decode(data: bytes | memoryview, shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """Decode an encoding made by :meth:`Codec.encode` for a tensor of ``shape``.

    Validates before allocating: a known wire id, parameters in bounds, the exact byte length
    for ``shape``, top-k indices in range, sorted and unique, scales and values finite. Memory
    is O(numel(shape)) whatever the bytes say.

    Args:
        data: the encoding.
        shape: the tensor's shape, known to the receiver (it is not on the wire).
        seed: the encoder's seed. No current format needs it (lowrank sends both factors);
            it is part of the signature so seed-derived formats stay compatible.

    Returns:
        A new fp32 tensor of ``shape``, all finite.

    Raises:
        BadPayload: the bytes are not a valid encoding for ``shape``; the message names why.
    """
    shape = tuple(shape)
    n = _shape_numel(shape)
    mv = memoryview(data).cast("B")
    if len(mv) < 1:
        raise BadPayload("codec payload is empty")
    if len(mv) > max_encoded_bytes(shape):
        raise BadPayload(f"codec payload of {len(mv)} bytes exceeds the bound {max_encoded_bytes(shape)} "
                         f"for shape {shape}")
    name = NAMES.get(mv[0])
    if name is None:
        raise BadPayload(f"unknown codec wire id {mv[0]}: known {sorted(NAMES)}")
    header = {"fp16": _HDR_SHIFT, "bf16": _HDR_SHIFT, "int8": _HDR_BLOCK, "int4": _HDR_BLOCK, "fp4": _HDR_BLOCK,
              "fp3": _HDR_BLOCK,
              "topk": _HDR_TOPK, "lowrank": _HDR_LOWRANK}.get(name)
    if header is not None and len(mv) < header.size:
        raise BadPayload(f"{name}: {len(mv)} bytes, shorter than its {header.size}-byte header")
    if name == "none":
        _expect_length(name, mv, 1 + 4 * n)
        out = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=n, offset=1).copy())
    elif name in ("fp16", "bf16"):
        _expect_length(name, mv, _HDR_SHIFT.size + 2 * n)
        _, shift = _HDR_SHIFT.unpack_from(mv)
        out = _from_half(mv, _HDR_SHIFT.size, n, shift, name == "bf16", name)
    elif name == "topk":
        out = _decode_topk(mv, n)
    elif name == "lowrank":
        out = _decode_lowrank(mv, shape, n)
    else:
        out = _decode_block(name, mv, n)
    if not bool(torch.isfinite(out).all()):
        raise BadPayload(f"{name}: decoded values overflow to inf")
    return out.reshape(shape)


class ErrorFeedback:
    """Per-peer compression residuals e, one fp32 buffer per tensor (zeros until first committed).

    Error feedback (EF-SGD; SparseLoCo; ALGORITHMS.md §3): a peer sends C(Δ + e) and keeps
    e ← (Δ + e) − C(Δ + e), so what compression drops in one round is sent in a later one and
    the running sum of decoded updates stays within one residual of the sum of Δ. Residuals are
    staged during a sync and made current by :meth:`commit` only once it succeeded;
    :meth:`rollback` keeps the previous residuals (the peer applied its own Δ).

    Args:
        shapes: one shape per tensor, in payload order.
    """

    def __init__(self, shapes: Sequence[Sequence[int]]):
        self.shapes = [torch.Size(s) for s in shapes]
        self._e: list[torch.Tensor | None] = [None] * len(self.shapes)
        self._staged: list[tuple[int, slice | None, torch.Tensor]] = []

    def _view(self, index: int, rows: slice | None) -> torch.Tensor | None:
        e = self._e[index]
        return None if e is None else (e if rows is None else e[rows])

    def compensate(self, index: int, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``x + e[index][rows]`` as a new fp32 tensor (rows: a dim-0 slice of tensor ``index``)."""
        full = self.shapes[index]
        expected = full if rows is None else torch.empty(full, device="meta")[rows].shape
        if x.shape != expected:
            raise ValueError(f"tensor {index}{'' if rows is None else f' rows {rows}'}: shape {tuple(x.shape)}, "
                             f"expected {tuple(expected)}")
        e = self._view(index, rows)
        return x.detach().float().clone() if e is None else x.detach().float() + e

    def stage(self, index: int, compensated: torch.Tensor, decoded: torch.Tensor, rows: slice | None = None) -> None:
        """Stage ``e[index][rows] = compensated − decoded``; current residuals are unchanged until commit."""
        self._staged.append((index, rows, compensated.detach().float() - decoded.detach().float()))

    def commit(self) -> None:
        """Make the staged residuals current (the sync succeeded)."""
        for index, rows, residual in self._staged:
            buf = self._buffer(index)
            (buf if rows is None else buf[rows]).copy_(residual)
        self._staged.clear()

    def rollback(self) -> None:
        """Drop the staged residuals (the sync failed)."""
        self._staged.clear()

    def _buffer(self, index: int) -> torch.Tensor:
        if self._e[index] is None:
            self._e[index] = torch.zeros(self.shapes[index], dtype=torch.float32)
        return self._e[index]

    def state_tensors(self) -> list[torch.Tensor]:
        """The residual buffers (fp32, one per tensor), for checkpoints; loading copies into them."""
        return [self._buffer(i) for i in range(len(self.shapes))]
