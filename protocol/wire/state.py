"""The state transfer's frames, on one libp2p stream per joiner and donor (framing: framing.py).

A joiner downloads a state snapshot (peer/state/snapshot.py) from several donors at once
(peer/state/download.py); each donor answers on its own stream (peer/state/serve.py)::

    joiner → donor:  REQUEST
    donor → joiner:  MISSING, or META then one CHUNK per requested index in request order;
                     the joiner closes after its last CHUNK, then the donor closes

Every frame is ``u32 big-endian length`` + ``payload``; the payload's first byte is the kind,
distinct from the all-reduce's kinds.

======= =====================================================================================
REQUEST kind 16, u16 protocol version, 16 B state digest, u32 count n, n × u32 chunk index
        (strictly ascending, each below the state's chunk count)
MISSING kind 17: the donor does not (or no longer) hold(s) that digest
META    kind 18, u32 length m, m bytes msgpack of {"inner_step", "round", "run_id"} (sorted
        keys; round ≤ MAX_ROUND, inner_step ≤ MAX_INNER_STEP, protocol/records.py's bounds),
        then 16 B blake2b hash of every chunk of the state, in chunk order
CHUNK   kind 19, u32 chunk index, then the chunk's fp32 values, little-endian, row-major
======= =====================================================================================

The parsers check kinds, versions, counts, indices and lengths before anything is used; they
raise only :class:`BadPayload`. The meta is msgpack with every length bounded; nothing is
unpickled. Whether a META matches the digest asked for, and a CHUNK its hash, is the
downloader's check (peer/state/download.py).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, cast

import msgpack

from protocol.errors import BadPayload
from protocol.records import MAX_INNER_STEP, MAX_ROUND
from protocol.text import sanitize
from protocol.version import PROTOCOL_VERSION

HASH_BYTES = 16
"""Bytes of a chunk hash and of a state digest (blake2b, digest_size=16)."""
REQUEST, MISSING, META, CHUNK = 16, 17, 18, 19
KIND_NAMES = {REQUEST: "REQUEST", MISSING: "MISSING", META: "META", CHUNK: "CHUNK"}
REQUEST_HEADER = struct.Struct(">BH16sI")
META_HEADER = struct.Struct(">BI")
CHUNK_HEADER = struct.Struct(">BI")
MAX_REQUEST_CHUNKS = 1 << 20
"""Most chunk indices one REQUEST may carry (a 1 Ti-element state at the default chunk size)."""
MAX_REQUEST_BYTES = REQUEST_HEADER.size + 4 * MAX_REQUEST_CHUNKS
MAX_META_BYTES = 1024
META_FIELDS = ("inner_step", "round", "run_id")
META_BOUNDS = {"round": MAX_ROUND, "inner_step": MAX_INNER_STEP}
"""A meta's largest round and inner step: a progress record's bounds (a state is of a round some
record published). A served meta claiming round 2^63 is refused here, before it reaches a digest,
a snapshot or a round counter."""


def canonical_meta(meta: dict[str, Any]) -> bytes:
    """The meta as META carries it and the digest hashes it: msgpack, keys sorted."""
    return cast(bytes, msgpack.packb({key: meta[key] for key in sorted(meta)}, use_bin_type=True))


def meta_problem(meta: Any) -> str | None:
    """What is wrong with ``meta``, or None: exactly run_id (str), round and inner_step (integers in
    ``[0, META_BOUNDS[name]]``)."""
    if not isinstance(meta, dict) or set(meta) != set(META_FIELDS):
        found = sorted(sanitize(str(k), max_chars=16) for k in meta) if isinstance(meta, dict) else type(meta).__name__
        return f"state meta has fields {found}, expected {list(META_FIELDS)}"
    if not isinstance(meta["run_id"], str):
        return f"state meta run_id {meta['run_id']!r} is not a string"
    for name in ("round", "inner_step"):
        value = meta[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= META_BOUNDS[name]:
            return (
                f"state meta {name} = {sanitize(repr(value), max_chars=40)}: expected an integer in "
                f"[0, {META_BOUNDS[name]}]"
            )
    return None


def _kind_name(payload: bytes) -> str:
    return KIND_NAMES.get(payload[0], payload[:1].hex()) if payload else "(empty)"


def encode_request(digest: bytes, indices: Sequence[int]) -> bytes:
    return REQUEST_HEADER.pack(REQUEST, PROTOCOL_VERSION, digest, len(indices)) + struct.pack(
        f">{len(indices)}I", *indices
    )


def parse_request(payload: bytes) -> tuple[bytes, list[int]]:
    """Return (digest, chunk indices) of a REQUEST.

    Raises:
        BadPayload: not a REQUEST, another protocol version, a count that does not match the
            frame's length or exceeds ``MAX_REQUEST_CHUNKS``, or indices not strictly ascending.
    """
    if not payload or payload[0] != REQUEST:
        raise BadPayload(f"expected REQUEST, got kind {payload[:1].hex() or '(empty)'}")
    if len(payload) < REQUEST_HEADER.size:
        raise BadPayload(f"REQUEST of {len(payload)} bytes is shorter than its header")
    _, version, digest, count = REQUEST_HEADER.unpack_from(payload)
    if version != PROTOCOL_VERSION:
        raise BadPayload(f"REQUEST speaks protocol version {version}, this peer speaks {PROTOCOL_VERSION}")
    if count > MAX_REQUEST_CHUNKS or len(payload) != REQUEST_HEADER.size + 4 * count:
        raise BadPayload(f"REQUEST announces {count} chunk indices in {len(payload)} bytes")
    indices = list(struct.unpack_from(f">{count}I", payload, REQUEST_HEADER.size))
    if any(a >= b for a, b in zip(indices, indices[1:])):
        raise BadPayload("REQUEST chunk indices are not strictly ascending")
    return digest, indices


def encode_missing() -> bytes:
    return bytes([MISSING])


def encode_meta(meta: dict[str, Any], chunk_hashes: Sequence[bytes]) -> bytes:
    body = canonical_meta(meta)
    return META_HEADER.pack(META, len(body)) + body + b"".join(chunk_hashes)


def parse_meta(payload: bytes, *, chunks: int) -> tuple[dict[str, Any], list[bytes]]:
    """Return (meta, one hash per chunk) of a META for a state of ``chunks`` chunks.

    Raises:
        BadPayload: a MISSING (the donor does not hold the state), not a META, a meta longer
            than ``MAX_META_BYTES``, other than ``HASH_BYTES`` of hashes per chunk, or a meta
            that is not msgpack of exactly :data:`META_FIELDS` (see :func:`meta_problem`).
    """
    if payload[:1] == bytes([MISSING]):
        raise BadPayload("MISSING: the donor does not hold this state (any more)")
    if payload[:1] != bytes([META]) or len(payload) < META_HEADER.size:
        raise BadPayload(f"expected META, got {_kind_name(payload)} of {len(payload)} bytes")
    _, meta_bytes = META_HEADER.unpack_from(payload)
    hashes_bytes = len(payload) - META_HEADER.size - meta_bytes
    if meta_bytes > MAX_META_BYTES or hashes_bytes != HASH_BYTES * chunks:
        raise BadPayload(
            f"META carries {meta_bytes} bytes of meta and {hashes_bytes} bytes of hashes; "
            f"expected at most {MAX_META_BYTES} and {HASH_BYTES} per chunk of {chunks}"
        )
    body = payload[META_HEADER.size : META_HEADER.size + meta_bytes]
    try:
        meta = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=256,
            max_bin_len=0,
            max_array_len=0,
            max_map_len=8,
            max_ext_len=0,
        )
    except Exception as exc:
        raise BadPayload(f"META meta is not valid msgpack: {exc}") from exc
    problem = meta_problem(meta)
    if problem is not None:
        raise BadPayload(problem)
    start = META_HEADER.size + meta_bytes
    return meta, [payload[i : i + HASH_BYTES] for i in range(start, len(payload), HASH_BYTES)]


def encode_chunk(index: int, data: bytes) -> bytes:
    return CHUNK_HEADER.pack(CHUNK, index) + data


def parse_chunk(payload: bytes, *, expected_index: int, shape: Sequence[int]) -> memoryview:
    """Return the raw little-endian fp32 bytes of a CHUNK that must carry chunk ``expected_index``,
    shaped ``shape``.

    Raises:
        BadPayload: not a CHUNK, another index (chunks come in request order), or a length
            other than 4 bytes per element of ``shape``.
    """
    if payload[:1] != bytes([CHUNK]) or len(payload) < CHUNK_HEADER.size:
        raise BadPayload(f"expected CHUNK {expected_index}, got {_kind_name(payload)}")
    _, got = CHUNK_HEADER.unpack_from(payload)
    if got != expected_index:
        raise BadPayload(f"CHUNK {got} arrived where chunk {expected_index} was due")
    elements = math.prod(shape)
    if len(payload) != CHUNK_HEADER.size + 4 * elements:
        raise BadPayload(
            f"CHUNK {expected_index} carries {len(payload) - CHUNK_HEADER.size} bytes, expected "
            f"{4 * elements} (float32 {shape})"
        )
    return memoryview(payload)[CHUNK_HEADER.size :]
