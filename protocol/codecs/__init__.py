"""Codecs for pseudo-gradients: fp32 tensors to self-describing bytes and back (no networking).

docs/algorithms.md §5 lists what the field uses; this package implements each as a :class:`Codec`
made by :func:`make_codec` from the run's ``[compression]`` section. An encoding starts with a
one-byte wire id, then the codec's parameters, then the data, so :func:`decode` needs only the
bytes and the tensor's shape. Decoding validates everything before it allocates (exact length
for the shape, parameters in bounds, indices in range, scales and values finite) and raises only
:class:`~protocol.errors.BadPayload`. Sums of decoded tensors are the caller's job, in fp32.

base.py: what every format shares: the decoder's limits, the :class:`Format` interface, :class:`Params`
blockwise.py: blockwise absmax formats: 'int8', 'int4', 'fp4', 'fp3'
codec.py: the API (:class:`Codec`, :func:`make_codec`, :func:`decode`) and the registry of formats
dense.py: dense formats: exact fp32 ('none'), 'fp16' and 'bf16' with a power-of-two shift
structured.py: structured formats of matrices: 'topk' and 'lowrank' (PowerSGD-style)

Wire layouts (little-endian; n = numel; "f16s" = fp16 values times 2^shift, see ``dense.to_half``)::

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

import sys

if sys.byteorder != "little":  # the wire is little-endian and the arrays are native views
    raise ImportError("protocol.codecs supports little-endian hosts only")

from protocol.codecs.base import (
    BLOCK_RANGE,
    DENSE_FALLBACK,
    ELEMENTWISE_FALLBACK,
    FLUSH_BELOW,
    HEADER_MAX_BYTES,
    LOSSY_MAX,
    SHIFT_RANGE,
    TOPK_CHUNK,
)
from protocol.codecs.codec import FORMATS, NAMES, WIRE_IDS, Codec, decode, make_codec, max_encoded_bytes

__all__ = [
    "BLOCK_RANGE",
    "DENSE_FALLBACK",
    "ELEMENTWISE_FALLBACK",
    "FLUSH_BELOW",
    "FORMATS",
    "HEADER_MAX_BYTES",
    "LOSSY_MAX",
    "NAMES",
    "SHIFT_RANGE",
    "TOPK_CHUNK",
    "WIRE_IDS",
    "Codec",
    "decode",
    "make_codec",
    "max_encoded_bytes",
]
