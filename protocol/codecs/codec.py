"""The codec API: :class:`Codec`, :func:`make_codec`, :func:`decode`, and the registry of formats.

Every operation looks the format up in ``FORMATS`` by name (to encode) or by wire id (to decode);
adding a format is one entry there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from protocol.codecs.base import (
    BLOCK_RANGE,
    DENSE_FALLBACK,
    ELEMENTWISE_FALLBACK,
    HEADER_MAX_BYTES,
    LOSSY_MAX,
    Format,
    shape_numel,
)
from protocol.codecs.blockwise import FloatBlock, IntBlock
from protocol.codecs.dense import Exact, Half
from protocol.codecs.structured import LowRank, TopK
from protocol.errors import BadPayload
from protocol.manifest import CompressionSpec

logger = logging.getLogger(__name__)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Exact("none", 0),
        Half("fp16", 1, torch.float16),
        Half("bf16", 2, torch.bfloat16),
        IntBlock("int8", 3, bits=8),
        IntBlock("int4", 4, bits=4),
        FloatBlock("fp4", 5, bits=4, exponents=7),
        TopK("topk", 6),
        LowRank("lowrank", 7),
        FloatBlock("fp3", 8, bits=3, exponents=3),
    )
}
"""Every wire format by codec name, in wire-id order."""
WIRE_IDS = {name: f.wire_id for name, f in FORMATS.items()}
"""First byte of every encoding."""
NAMES = {v: k for k, v in WIRE_IDS.items()}
assert len(NAMES) == len(FORMATS), "two formats share a wire id"
EXACT = "none"
"""The format lossy codecs fall back to for a tensor holding |x| ≥ ``LOSSY_MAX``."""


def max_encoded_bytes(shape: Sequence[int]) -> int:
    """Upper bound of any codec's encoding of a tensor of ``shape``: ``4·numel + HEADER_MAX_BYTES``."""
    return 4 * shape_numel(tuple(shape)) + HEADER_MAX_BYTES


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

    def __init__(
        self, name: str, *, block_size: int = 64, topk_fraction: float = 0.01, rank: int = 4, multiplier: int = 1
    ):
        if name not in FORMATS:
            raise ValueError(f"codec {name!r} unknown: choose one of {sorted(WIRE_IDS)}")
        if not BLOCK_RANGE[0] <= block_size <= BLOCK_RANGE[1]:
            raise ValueError(f"block_size = {block_size} outside {list(BLOCK_RANGE)}")
        if not 0.0 < topk_fraction <= 1.0 or rank < 1 or multiplier < 1:
            raise ValueError(
                f"topk_fraction = {topk_fraction}, rank = {rank}, multiplier = {multiplier}: "
                "need a fraction in (0, 1] and positive integers"
            )
        self.name, self.lossy = name, FORMATS[name].lossy
        self.block_size, self.topk_fraction, self.rank, self.multiplier = block_size, topk_fraction, rank, multiplier

    def __repr__(self) -> str:
        extra = FORMATS[self.name].describe(self)
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
        return FORMATS[self.name].structured

    def for_mean(self, group_size: int) -> Codec:
        """The codec an owner uses to send the group's mean back (no error feedback there).

        Elementwise codecs: this one. topk: k × ``group_size`` (the mean of n top-k tensors has
        at most n·k nonzeros, so it is sent exactly up to fp16 value precision). lowrank: rank ×
        ``group_size`` (one power iteration recovers a matrix of rank ≤ r exactly). Both claims
        need every contribution to be a decoded encoding (see :attr:`structured`).
        """
        if group_size < 1:
            raise ValueError(f"group_size = {group_size}: need at least 1")
        if not self.structured:
            return self
        return Codec(
            self.name,
            block_size=self.block_size,
            topk_fraction=self.topk_fraction,
            rank=self.rank,
            multiplier=self.multiplier * group_size,
        )

    def resolve(self, shape: Sequence[int]) -> str:
        """The wire format this codec uses for a tensor of ``shape`` (its fallbacks applied)."""
        if not self.structured:
            return self.name
        if len(shape) < 2:
            return ELEMENTWISE_FALLBACK
        smaller = FORMATS[self.name].encoded_size(self, shape) < FORMATS[DENSE_FALLBACK].encoded_size(self, shape)
        return self.name if smaller else DENSE_FALLBACK

    def encoded_size(self, shape: Sequence[int]) -> int:
        """Bytes of ``encode`` of a finite tensor of ``shape`` (all of whose |x| < 2^100)."""
        return FORMATS[self.resolve(shape)].encoded_size(self, shape)

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
        if FORMATS[fmt].lossy and x.numel() and float(x.abs().max()) >= LOSSY_MAX:
            logger.warning(
                "a tensor of shape %s has |x| >= 2^100: sending it as exact fp32, not %s", tuple(x.shape), fmt
            )
            fmt = EXACT
        return FORMATS[fmt].encode(self, x, seed=seed)

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
        raise ValueError(
            "compression.codec = 'adaptive' picks a codec per tensor each round: "
            "call peer.sync.adaptive.plan, not make_codec"
        )
    if name in FORMATS and FORMATS[name].structured and len(shape) < 2:
        name = ELEMENTWISE_FALLBACK
    return Codec(name, block_size=spec.block_size, topk_fraction=spec.topk_fraction, rank=spec.rank)


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
    n = shape_numel(shape)
    mv = memoryview(data).cast("B")
    if len(mv) < 1:
        raise BadPayload("codec payload is empty")
    if len(mv) > max_encoded_bytes(shape):
        raise BadPayload(
            f"codec payload of {len(mv)} bytes exceeds the bound {max_encoded_bytes(shape)} for shape {shape}"
        )
    name = NAMES.get(mv[0])
    if name is None:
        raise BadPayload(f"unknown codec wire id {mv[0]}: known {sorted(NAMES)}")
    fmt = FORMATS[name]
    if fmt.header is not None and len(mv) < fmt.header.size:
        raise BadPayload(f"{name}: {len(mv)} bytes, shorter than its {fmt.header.size}-byte header")
    out = fmt.decode(mv, shape, n)
    if not bool(torch.isfinite(out).all()):
        raise BadPayload(f"{name}: decoded values overflow to inf")
    return out.reshape(shape)
