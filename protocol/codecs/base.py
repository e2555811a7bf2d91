"""What every wire format shares: the limits a decoder enforces, the :class:`Format` interface and
the codec parameters a format reads (:class:`Params`).

A format is one way of laying a tensor out as bytes, named by the one-byte wire id every encoding
starts with. :class:`~protocol.codecs.codec.Codec` holds a run's parameters and dispatches every
operation through the registry of formats (``FORMATS`` in :mod:`protocol.codecs.codec`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Protocol

import torch

from protocol.errors import BadPayload

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


class Params(Protocol):
    """What a format reads of a :class:`~protocol.codecs.codec.Codec`: its parameters (documented there)."""

    block_size: int
    topk_fraction: float
    rank: int
    multiplier: int


class Format:
    """One wire format. Subclasses set the class attributes and implement the three methods.

    Attributes:
        name: the codec name a manifest or plan uses, e.g. 'int4'.
        wire_id: the first byte of every encoding in this format.
        header: the fixed header (wire id included) that ``decode`` reads first; None when the
            header is the wire id alone.
        lossy: False only for exact fp32.
        structured: True for formats that keep a matrix's support or rank (topk, lowrank): a 0-D
            or 1-D tensor is sent as ``ELEMENTWISE_FALLBACK``, a tensor whose encoding would not
            be smaller than ``DENSE_FALLBACK``'s as that, and the codec of a group mean scales
            its size with the group (:meth:`~protocol.codecs.codec.Codec.for_mean`).
    """

    name: str
    wire_id: int
    header: struct.Struct | None = None
    lossy: bool = True
    structured: bool = False

    def __init__(self, name: str, wire_id: int):
        self.name, self.wire_id = name, wire_id

    def describe(self, codec: Params) -> str:
        """The codec's parameters this format uses, for ``repr`` (empty when none)."""
        return ""

    def encoded_size(self, codec: Params, shape: Sequence[int]) -> int:
        """Bytes of :meth:`encode` of a finite tensor of ``shape``."""
        raise NotImplementedError

    def encode(self, codec: Params, x: torch.Tensor, *, seed: int) -> bytes:
        """The encoding of finite, contiguous fp32 CPU ``x`` (every |x| < ``LOSSY_MAX``)."""
        raise NotImplementedError

    def decode(self, mv: memoryview, shape: tuple[int, ...], n: int) -> torch.Tensor:
        """The flat fp32 tensor of ``n`` elements that ``mv`` encodes; BadPayload if invalid.

        ``mv`` is at least ``header.size`` bytes and at most ``max_encoded_bytes(shape)``.
        """
        raise NotImplementedError


def shape_numel(shape: Sequence[int]) -> int:
    """Elements of ``shape``; BadPayload unless it is a tuple of non-negative integers."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadPayload(f"shape {tuple(shape)!r} must be a tuple of non-negative integers")
    return math.prod(shape)


def expect_length(what: str, mv: memoryview, expected: int) -> None:
    """BadPayload unless ``mv`` is exactly ``expected`` bytes."""
    if len(mv) != expected:
        raise BadPayload(f"{what}: {len(mv)} bytes, expected exactly {expected} for this shape")
