"""The all-reduce's frames, on one libp2p stream per pair of groupmates (framing: framing.py).

A group all-reduce (peer/sync/allreduce.py) opens one stream from every sender to every owner of
pieces. On that stream::

    sender → owner:  HELLO, then one PIECE per piece the owner reduces, in piece order
    owner → sender:  one MEAN per piece, in piece order, then one SEAL; or one ABORT
    sender → owner:  one RECEIPT once the sender holds every mean of the group (issue #51, item 3)

Every frame is ``u32 big-endian length`` + ``payload``; the payload starts with one kind byte.

====== ===================================================================================
HELLO  kind 1, then a msgpack map {v: protocol version, group: group id (bytes), sender: index
       in the group, weight: tokens (float > 0), pieces: how many PIECE frames follow}
PIECE  kind 2, u32 piece index, then one codec encoding (protocol/codecs/)
MEAN   kind 3, u32 piece index, u16 group size n, ceil(n/8) bytes of bitmap: which senders the
       mean includes (bit i = sender i), then one codec encoding of the weighted fp32 mean
ABORT  kind 4, then a UTF-8 reason of at most 1 KiB (read stripped of control characters)
RECEIPT kind 5, u16 count, then count × (u16 owner index, 16-byte BLAKE2b digest of the MEAN
       frame payloads that owner sent this sender, in piece order, the sender's own: those it sent;
       f32 the sender's alignment with that owner's Δ means, NaN for none; u8 1 if the sender
       refused one of that owner's means, else 0; u16 length, then the owner's SEAL signature of
       that digest: peer/sync/receipts.py)
SEAL   kind 6, u16 length, the owner's public key (DER), then its signature of the digest of the
       MEAN payloads it sent on this stream (protocol/signing.py ``seal_means``)
====== ===================================================================================

The parsers here check everything that is not codec data before anything is allocated or
used: kinds, versions, indices and counts (the declared length is bounded by
:func:`protocol.wire.framing.read_frame`). They raise only :class:`BadPayload`. No message is
ever unpickled.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import msgpack

from protocol.errors import BadPayload
from protocol.text import sanitize
from protocol.version import PROTOCOL_VERSION
from protocol.wire.framing import kind_of

HELLO, PIECE, MEAN, ABORT, RECEIPT, SEAL = 1, 2, 3, 4, 5, 6
KIND_NAMES = {HELLO: "HELLO", PIECE: "PIECE", MEAN: "MEAN", ABORT: "ABORT", RECEIPT: "RECEIPT", SEAL: "SEAL"}
RECEIPT_HEADER = struct.Struct(">BH")
RECEIPT_ENTRY = struct.Struct(">H16sfBH")
SEAL_HEADER = struct.Struct(">BH")
MAX_SEAL_KEY_BYTES = 1024
"""An owner's public key in a SEAL (DER; RSA-2048: 294 bytes) is at most this long."""
MAX_SEAL_SIGNATURE_BYTES = 1024
"""A SEAL's signature (RSA-2048: 256 bytes) is at most this long."""
PIECE_HEADER = struct.Struct(">BI")
MEAN_HEADER = struct.Struct(">BIH")
MAX_HELLO_BYTES = 1024
MAX_ABORT_BYTES = 1024
MAX_GROUP_SIZE = 4096
"""Largest group a MEAN bitmap can describe (matches the manifest's sync.target_group_size bound)."""


@dataclass(frozen=True)
class Hello:
    group_id: bytes
    sender: int
    weight: float
    pieces: int


def encode_hello(*, group_id: bytes, sender: int, weight: float, pieces: int) -> bytes:
    body: bytes = msgpack.packb(
        {"v": PROTOCOL_VERSION, "group": group_id, "sender": sender, "weight": float(weight), "pieces": pieces},
        use_bin_type=True,
    )
    return bytes([HELLO]) + body


def parse_hello(payload: bytes, *, group_size: int) -> Hello:
    """Decode and check a HELLO frame.

    Raises:
        BadPayload: not a HELLO, too long, not a map of exactly the five fields, another
            protocol version, sender outside ``[0, group_size)``, weight not finite and > 0,
            or a negative piece count.
    """
    if kind_of(payload, KIND_NAMES) != HELLO:
        raise BadPayload(f"expected HELLO, got {KIND_NAMES[payload[0]]}")
    if len(payload) > MAX_HELLO_BYTES:
        raise BadPayload(f"HELLO of {len(payload)} bytes exceeds {MAX_HELLO_BYTES}")
    try:
        body = msgpack.unpackb(
            payload[1:], raw=False, strict_map_key=True, max_bin_len=256, max_str_len=64, max_array_len=0, max_map_len=8
        )
    except Exception as exc:
        raise BadPayload(f"HELLO is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict) or set(body) != {"v", "group", "sender", "weight", "pieces"}:
        found = sorted(sanitize(str(k), max_chars=16) for k in body) if isinstance(body, dict) else type(body).__name__
        raise BadPayload(f"HELLO fields {found}, expected group, pieces, sender, v, weight")
    if body["v"] != PROTOCOL_VERSION:
        raise BadPayload(f"HELLO speaks protocol version {body['v']!r}, this peer speaks {PROTOCOL_VERSION}")
    group, sender, weight, pieces = body["group"], body["sender"], body["weight"], body["pieces"]
    if not isinstance(group, bytes):
        raise BadPayload("HELLO group id is not bytes")
    if not isinstance(sender, int) or isinstance(sender, bool) or not 0 <= sender < group_size:
        raise BadPayload(f"HELLO sender index {sender!r} outside [0, {group_size})")
    if not isinstance(weight, float) or not math.isfinite(weight) or weight <= 0:
        raise BadPayload(f"HELLO weight {weight!r}: expected a finite number > 0")
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 0:
        raise BadPayload(f"HELLO piece count {pieces!r}: expected a non-negative integer")
    return Hello(group_id=group, sender=sender, weight=weight, pieces=pieces)


def encode_piece(index: int, data: bytes) -> bytes:
    return PIECE_HEADER.pack(PIECE, index) + data


def parse_piece(payload: bytes, *, expected_index: int) -> memoryview:
    """Return the codec data of a PIECE frame that must carry piece ``expected_index``.

    Raises:
        BadPayload: not a PIECE, too short, or another piece index (pieces come in order).
    """
    if kind_of(payload, KIND_NAMES) != PIECE:
        raise BadPayload(f"expected PIECE, got {KIND_NAMES[payload[0]]}")
    if len(payload) < PIECE_HEADER.size:
        raise BadPayload(f"PIECE frame of {len(payload)} bytes is shorter than its header")
    _, index = PIECE_HEADER.unpack_from(payload)
    if index != expected_index:
        raise BadPayload(f"PIECE {index} arrived where piece {expected_index} was due")
    return memoryview(payload)[PIECE_HEADER.size :]


def encode_mean(index: int, included: list[bool], data: bytes) -> bytes:
    n = len(included)
    bitmap = bytearray((n + 7) // 8)
    for i, bit in enumerate(included):
        if bit:
            bitmap[i // 8] |= 1 << (i % 8)
    return MEAN_HEADER.pack(MEAN, index, n) + bytes(bitmap) + data


def parse_mean(payload: bytes, *, expected_index: int, group_size: int) -> tuple[list[bool], memoryview]:
    """Return (which senders the mean includes, codec data) of a MEAN frame.

    Raises:
        BadPayload: not a MEAN (an ABORT's reason is included in the message), wrong piece
            index, a group size other than ``group_size``, bits set beyond it, or no sender.
    """
    kind = kind_of(payload, KIND_NAMES)
    if kind == ABORT:
        raise BadPayload(f"the owner aborted: {parse_abort(payload)}")
    if kind != MEAN:
        raise BadPayload(f"expected MEAN, got {KIND_NAMES[kind]}")
    if len(payload) < MEAN_HEADER.size:
        raise BadPayload(f"MEAN frame of {len(payload)} bytes is shorter than its header")
    _, index, n = MEAN_HEADER.unpack_from(payload)
    if index != expected_index:
        raise BadPayload(f"MEAN {index} arrived where piece {expected_index} was due")
    if n != group_size:
        raise BadPayload(f"MEAN describes a group of {n}, this group has {group_size}")
    start, width = MEAN_HEADER.size, (n + 7) // 8
    if len(payload) < start + width:
        raise BadPayload("MEAN frame is shorter than its sender bitmap")
    bitmap = payload[start : start + width]
    included = [bool(bitmap[i // 8] >> (i % 8) & 1) for i in range(n)]
    if n % 8 and bitmap[-1] >> (n % 8):
        raise BadPayload("MEAN sender bitmap has bits beyond the group")
    if not any(included):
        raise BadPayload("MEAN includes no sender")
    return included, memoryview(payload)[start + width :]


def encode_abort(reason: str) -> bytes:
    return bytes([ABORT]) + reason.encode("utf-8", "replace")[:MAX_ABORT_BYTES]


def parse_abort(payload: bytes) -> str:
    """The reason of an ABORT frame, stripped of control characters and escape sequences (protocol/text.py)."""
    if kind_of(payload, KIND_NAMES) != ABORT:
        raise BadPayload(f"expected ABORT, got {KIND_NAMES[payload[0]]}")
    return sanitize(bytes(payload[1 : 1 + MAX_ABORT_BYTES]).decode("utf-8", "replace"))


def max_receipt_bytes(group_size: int) -> int:
    """The longest RECEIPT of a group of ``group_size``: one entry per groupmate, each with a signature."""
    return RECEIPT_HEADER.size + group_size * (RECEIPT_ENTRY.size + MAX_SEAL_SIGNATURE_BYTES)


def max_seal_bytes() -> int:
    return SEAL_HEADER.size + MAX_SEAL_KEY_BYTES + MAX_SEAL_SIGNATURE_BYTES


def encode_seal(public_der: bytes, signature: bytes) -> bytes:
    """A SEAL of an owner's public key and its signature of its means' digest."""
    return SEAL_HEADER.pack(SEAL, len(public_der)) + public_der + signature


def parse_seal(payload: bytes) -> tuple[bytes, bytes]:
    """``(public key DER, signature)`` of a SEAL frame (checked for form only: the signature is
    verified by the receiver, protocol/signing.py ``verify_means``).

    Raises:
        BadPayload: not a SEAL (an ABORT's reason is included in the message), a key or signature
            empty or longer than its bound.
    """
    kind = kind_of(payload, KIND_NAMES)
    if kind == ABORT:
        raise BadPayload(f"the owner aborted: {parse_abort(payload)}")
    if kind != SEAL:
        raise BadPayload(f"expected SEAL, got {KIND_NAMES[kind]}")
    if len(payload) < SEAL_HEADER.size:
        raise BadPayload(f"SEAL frame of {len(payload)} bytes is shorter than its header")
    _, key_bytes = SEAL_HEADER.unpack_from(payload)
    key = bytes(payload[SEAL_HEADER.size : SEAL_HEADER.size + key_bytes])
    signature = bytes(payload[SEAL_HEADER.size + key_bytes :])
    if not 0 < len(key) == key_bytes <= MAX_SEAL_KEY_BYTES or not 0 < len(signature) <= MAX_SEAL_SIGNATURE_BYTES:
        raise BadPayload(f"SEAL of a {len(key)}-byte key and a {len(signature)}-byte signature")
    return key, signature


@dataclass(frozen=True)
class Receipt:
    """One RECEIPT, parsed (or this peer's own, before it is sent)."""

    digests: dict[int, bytes]
    """Owner index → digest of the MEAN payloads that owner sent the receipt's sender."""
    alignments: dict[int, float]
    """Owner index → the sender's alignment with that owner's Δ means (finite values only)."""
    refused: frozenset[int] = frozenset()
    """Owners one of whose means the sender refused (a vote: peer/sync/receipts.py)."""
    signatures: dict[int, bytes] = field(default_factory=dict)
    """Owner index → the owner's SEAL signature of its digest, as the sender received it (empty
    bytes: none)."""


def encode_receipt(
    digests: dict[int, bytes],
    alignments: dict[int, float] | None = None,
    *,
    refused: frozenset[int] | set[int] = frozenset(),
    signatures: dict[int, bytes] | None = None,
) -> bytes:
    """A RECEIPT of ``digests`` (owner index → 16-byte digest of the MEAN payloads it sent),
    ``alignments`` (owner index → float; absent, non-finite or beyond float32: sent as NaN), the
    owners ``refused`` and each owner's ``signatures`` of its digest (absent: none).

    Raises:
        ValueError: a signature longer than :data:`MAX_SEAL_SIGNATURE_BYTES`.
    """
    alignments, signatures = alignments or {}, signatures or {}

    def f32(owner: int) -> float:
        value = alignments.get(owner, math.nan)
        return value if math.isfinite(value) and abs(value) < 3.0e38 else math.nan

    out = [RECEIPT_HEADER.pack(RECEIPT, len(digests))]
    for owner, digest in sorted(digests.items()):
        signature = signatures.get(owner, b"")
        if len(signature) > MAX_SEAL_SIGNATURE_BYTES:
            raise ValueError(f"a {len(signature)}-byte signature, more than {MAX_SEAL_SIGNATURE_BYTES}")
        out.append(RECEIPT_ENTRY.pack(owner, digest, f32(owner), owner in refused, len(signature)) + signature)
    return b"".join(out)


def parse_receipt(payload: bytes, *, group_size: int) -> Receipt:
    """A RECEIPT frame's digests, finite alignments, refusals and signatures by owner index.

    Raises:
        BadPayload: not a RECEIPT, a count above ``group_size`` or a length other than the
            entries', an owner index outside the group or named twice, a refusal flag other than
            0 or 1, a signature longer than :data:`MAX_SEAL_SIGNATURE_BYTES`.
    """
    if kind_of(payload, KIND_NAMES) != RECEIPT:
        raise BadPayload(f"expected RECEIPT, got {KIND_NAMES[payload[0]]}")
    if len(payload) < RECEIPT_HEADER.size:
        raise BadPayload(f"RECEIPT frame of {len(payload)} bytes is shorter than its header")
    _, count = RECEIPT_HEADER.unpack_from(payload)
    if count > group_size:
        raise BadPayload(f"RECEIPT of {count} entries, group of {group_size}")
    out, refused, at = Receipt({}, {}), set(), RECEIPT_HEADER.size
    for _ in range(count):
        if at + RECEIPT_ENTRY.size > len(payload):
            raise BadPayload(f"RECEIPT of {count} entries is cut short at byte {len(payload)}")
        owner, digest, alignment, flag, signature_bytes = RECEIPT_ENTRY.unpack_from(payload, at)
        at += RECEIPT_ENTRY.size
        if owner >= group_size or owner in out.digests:
            raise BadPayload(f"RECEIPT names owner {owner} (group of {group_size}, or twice)")
        if flag > 1 or signature_bytes > MAX_SEAL_SIGNATURE_BYTES or at + signature_bytes > len(payload):
            raise BadPayload(f"RECEIPT entry of owner {owner}: flag {flag}, a {signature_bytes}-byte signature")
        out.digests[owner] = digest
        out.signatures[owner] = bytes(payload[at : at + signature_bytes])
        at += signature_bytes
        if flag:
            refused.add(owner)
        if math.isfinite(alignment):
            out.alignments[owner] = alignment
    if at != len(payload):
        raise BadPayload(f"RECEIPT of {count} entries in {len(payload)} bytes: {len(payload) - at} left over")
    return Receipt(out.digests, out.alignments, frozenset(refused), out.signatures)
