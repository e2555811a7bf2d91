"""Verifiable state download for joiners, from several donors at once.

A joiner downloads φ, the outer optimizer's state and the round from the swarm, not from one
donor: the state is cut into chunks, each chunk is named by its hash, and the whole state by a
digest over its metadata and those hashes (Merkle style). Peers publish the digest's hex in their
DHT progress records; a joiner picks a digest held by several peers and asks each of them for an
interleaved share of the chunks, one stream per donor. A donor that fails (cannot be reached,
goes silent, no longer holds the state, sends anything that does not verify) is dropped with its
reason, and the chunks it had not delivered are dealt to the remaining donors in the next pass.
Chunks already verified are kept, from whichever donor they came.

On one stream (frames: ``u32 big-endian length`` + payload, protocol/wire.py; the payload's first
byte is the kind, distinct from the all-reduce's kinds)::

    joiner → donor:  REQUEST
    donor → joiner:  MISSING, or META then one CHUNK per requested index in request order;
                     the joiner closes after its last CHUNK, then the donor closes

======= =====================================================================================
REQUEST kind 16, u16 protocol version, 16 B state digest, u32 count n, n × u32 chunk index
        (strictly ascending, each below the state's chunk count)
MISSING kind 17: the donor does not (or no longer) hold(s) that digest
META    kind 18, u32 length m, m bytes msgpack of {"inner_step", "round", "run_id"} (sorted
        keys), then 16 B blake2b hash of every chunk of the state, in chunk order
CHUNK   kind 19, u32 chunk index, then the chunk's fp32 values, little-endian, row-major
======= =====================================================================================

Chunks are rows of one tensor (:func:`plan_chunks`, the all-reduce's piece plan with one owner
and ``CHUNK_ELEMENTS`` per piece); both sides derive them from the run's tensor shapes. Hashes
are ``blake2b(raw bytes, digest_size=16)``; the digest is
``blake2b(msgpack(meta, sorted keys) + all chunk hashes, digest_size=16)``. Nothing received is
unpickled; every length is bounded before it is read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable, Sequence

import msgpack
import numpy as np
import torch

from peer.sync.allreduce import Piece, piece_shape, piece_view, plan_pieces
from protocol import wire
from protocol.errors import BadPayload, SyncError
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk (1 MiB of fp32). Part of the protocol: it decides the chunks, so the digest."""
HASH_BYTES = 16
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


class StateDownloadFailed(SyncError):
    """No donor is left to deliver the chunks still missing; nothing was returned.

    ``failed`` maps each donor that failed to its reason.
    """

    def __init__(self, message: str, failed: dict[Hashable, str]):
        super().__init__(message)
        self.failed = failed

    def __reduce__(self):
        # It crosses from the averager process to the trainer through a pipe (pickled locally):
        # without this, unpickling would call __init__ with the message only and fail, and the
        # trainer would wait out the whole download bound instead of hearing of the failure.
        return type(self), (str(self), self.failed)


# ---- content addressing ---------------------------------------------------------------------
def plan_chunks(shapes: Sequence[Sequence[int]], chunk_elements: int = CHUNK_ELEMENTS) -> list[Piece]:
    """Cut a state's tensors into chunks of whole rows (dim 0), in tensor order.

    Args:
        shapes: every tensor's shape, in state order (φ, then the outer optimizer's state).
        chunk_elements: target elements per chunk; a chunk is never smaller than one row.
            0-d tensors are one chunk; empty tensors have none.

    Returns:
        Chunks (``Piece``, owner 0) numbered from 0; deterministic in its arguments.

    Raises:
        ValueError: ``chunk_elements`` below 1.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return plan_pieces([torch.Size(s) for s in shapes], owners=[0], piece_elements=chunk_elements)


def chunk_hash(data: bytes | memoryview) -> bytes:
    """16-byte blake2b of one chunk's raw little-endian fp32 bytes."""
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _canonical_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb({key: meta[key] for key in sorted(meta)}, use_bin_type=True)


def state_digest(meta: dict[str, Any], chunk_hashes: Sequence[bytes]) -> bytes:
    """The 16-byte digest naming a state: blake2b of its canonical meta and all its chunk hashes."""
    return hashlib.blake2b(_canonical_meta(meta) + b"".join(chunk_hashes), digest_size=HASH_BYTES).digest()


def _meta_problem(meta: Any) -> str | None:
    """What is wrong with ``meta``, or None: exactly run_id (str), round and inner_step (int >= 0)."""
    if not isinstance(meta, dict) or set(meta) != set(META_FIELDS):
        found = sorted(map(str, meta)) if isinstance(meta, dict) else type(meta).__name__
        return f"state meta has fields {found}, expected {list(META_FIELDS)}"
    if not isinstance(meta["run_id"], str):
        return f"state meta run_id {meta['run_id']!r} is not a string"
    for name in ("round", "inner_step"):
        value = meta[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"state meta {name} = {value!r}: expected a non-negative integer"
    return None


def chunk_bytes(tensor: torch.Tensor, chunk: Piece) -> bytes:
    """Raw little-endian fp32 bytes of ``chunk``'s rows of ``tensor`` (contiguous fp32, CPU)."""
    return piece_view(tensor, chunk).numpy().astype("<f4", copy=False).tobytes()


@dataclass(frozen=True)
class StateSnapshot:
    """One state as donors serve it; immutable once made (see :func:`make_snapshot`)."""

    meta: dict[str, Any]
    """{"run_id": str, "round": int, "inner_step": int}."""
    tensors: tuple[torch.Tensor, ...]
    """Private contiguous fp32 CPU copies: φ, then the outer optimizer's state."""
    chunks: tuple[Piece, ...]
    chunk_hashes: tuple[bytes, ...]
    digest: bytes
    """16 bytes; ``digest.hex()`` is what progress records publish."""


def make_snapshot(meta: dict[str, Any], tensors: Sequence[torch.Tensor], *,
                  chunk_elements: int = CHUNK_ELEMENTS) -> StateSnapshot:
    """Copy a state and hash it, so that it can be served while training goes on.

    Costs one copy of the state in memory and one blake2b pass over it (about 1 GB/s on one
    core; blake2b releases the GIL, so it may run in an executor).

    Args:
        meta: {"run_id": str, "round": int >= 0, "inner_step": int >= 0}, nothing else.
        tensors: fp32 tensors of any device and layout, all finite.

    Raises:
        ValueError: a meta field is missing, extra or of the wrong type, a tensor is not fp32,
            or holds NaN or inf (a joiner would reject every chunk of it).
    """
    problem = _meta_problem(meta)
    if problem is not None:
        raise ValueError(problem)
    copies = []
    for index, tensor in enumerate(tensors):
        if tensor.dtype != torch.float32:
            raise ValueError(f"state tensor {index} is {tensor.dtype}, expected torch.float32")
        copy = tensor.detach().cpu().clone(memory_format=torch.contiguous_format)
        if not torch.isfinite(copy).all():
            raise ValueError(f"state tensor {index} holds NaN or inf")
        copies.append(copy)
    chunks = plan_chunks([t.shape for t in copies], chunk_elements)
    hashes = tuple(chunk_hash(chunk_bytes(copies[c.tensor], c)) for c in chunks)
    meta = dict(meta)
    return StateSnapshot(meta=meta, tensors=tuple(copies), chunks=tuple(chunks), chunk_hashes=hashes,
                         digest=state_digest(meta, hashes))


# ---- frames ---------------------------------------------------------------------------------
def encode_request(digest: bytes, indices: Sequence[int]) -> bytes:
    return REQUEST_HEADER.pack(REQUEST, PROTOCOL_VERSION, digest, len(indices)) + struct.pack(
        f">{len(indices)}I", *indices)


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


def encode_meta(meta: dict[str, Any], chunk_hashes: Sequence[bytes]) -> bytes:
    body = _canonical_meta(meta)
    return META_HEADER.pack(META, len(body)) + body + b"".join(chunk_hashes)


def encode_chunk(index: int, data: bytes) -> bytes:
    return CHUNK_HEADER.pack(CHUNK, index) + data


# ---- donor side -----------------------------------------------------------------------------
async def serve_state(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      snapshot_for: Callable[[bytes], Awaitable[StateSnapshot | None]], *, timeout: float) -> int:
    """Answer one joiner's REQUEST on a fresh stream, then close it.

    Args:
        snapshot_for: ``await snapshot_for(digest)`` returns the snapshot with that 16-byte
            digest, or None if this peer does not hold it (the joiner gets MISSING).
        timeout: seconds to wait for the REQUEST, for each write to drain, and for the joiner
            to close after the last chunk.

    Returns:
        Frame bytes handed to the writer (length prefixes included).

    Never raises for anything the joiner does (malformed or oversized REQUEST, unknown chunk
    index, silence, disconnect): it logs the reason and closes the stream. The snapshot is only
    read.
    """
    written = 0

    def send(payload: bytes) -> None:
        nonlocal written
        data = wire.frame(payload)
        writer.write(data)
        written += len(data)

    try:
        try:
            payload = await wire.read_frame(reader, max_bytes=MAX_REQUEST_BYTES, timeout=timeout)
            digest, indices = parse_request(payload)
        except (BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            logger.warning("rejected a state request: %s", _describe(exc))
            return written
        try:
            snapshot = await snapshot_for(digest)
        except Exception:
            logger.exception("state %s: could not look up the snapshot", digest.hex())
            return written
        if snapshot is None:
            logger.info("state %s requested; not held here", digest.hex())
            send(bytes([MISSING]))
        elif indices and indices[-1] >= len(snapshot.chunks):
            logger.warning("rejected a state request for %s: chunk %d requested, the state has %d chunks",
                           digest.hex(), indices[-1], len(snapshot.chunks))
            return written
        else:
            send(encode_meta(snapshot.meta, snapshot.chunk_hashes))
            for index in indices:
                chunk = snapshot.chunks[index]
                send(encode_chunk(index, chunk_bytes(snapshot.tensors[chunk.tensor], chunk)))
                await asyncio.wait_for(writer.drain(), timeout)
        await asyncio.wait_for(writer.drain(), timeout)
        # The joiner closes first, once it has read everything: closing here could make the p2p
        # daemon drop the stream's tail before it reaches the joiner.
        await asyncio.wait_for(reader.read(1), timeout)
    except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
        logger.info("state stream ended early after %d bytes: %s", written, _describe(exc))
    finally:
        writer.close()
    return written


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return f"stream closed after {len(exc.partial)} of {exc.expected} bytes of a frame"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, BadPayload) else str(exc)


# ---- joiner side ----------------------------------------------------------------------------
@dataclass
class DownloadResult:
    meta: dict[str, Any]
    """{"run_id", "round", "inner_step"}, verified against the digest."""
    tensors: list[torch.Tensor]
    """fp32 CPU tensors shaped as requested, every chunk hash-verified and finite."""
    bytes_by_donor: dict[Hashable, int] = field(default_factory=dict)
    """Frame bytes read from each donor contacted (length prefixes included)."""
    chunks_by_donor: dict[Hashable, int] = field(default_factory=dict)
    """Verified chunks kept from each donor contacted."""
    failed: dict[Hashable, str] = field(default_factory=dict)
    """Donors dropped, with the reason."""


class _Download:
    """Shared state of one download: the tensors being filled and what each donor did."""

    def __init__(self, open_stream, *, digest: bytes, shapes: list[torch.Size], run_id: str, timeout: float,
                 chunks: list[Piece]):
        self.open_stream, self.digest, self.run_id, self.timeout = open_stream, digest, run_id, timeout
        self.shapes, self.chunks = shapes, chunks
        self.chunk_shapes = [piece_shape(shapes[c.tensor], c) for c in chunks]
        self.tensors = [torch.empty(s, dtype=torch.float32) for s in shapes]
        self.received = [False] * len(chunks)
        self.meta: dict[str, Any] | None = None
        self.bytes_by_donor: dict[Hashable, int] = {}
        self.chunks_by_donor: dict[Hashable, int] = {}
        self.failed: dict[Hashable, str] = {}

    async def fetch(self, donor: Hashable, indices: list[int]) -> None:
        """Get ``indices`` from ``donor``; on any failure record it in ``failed`` and return."""
        self.bytes_by_donor.setdefault(donor, 0)
        self.chunks_by_donor.setdefault(donor, 0)
        try:
            reader, writer = await asyncio.wait_for(self.open_stream(donor), self.timeout)
        except Exception as exc:  # whatever the transport raises: the donor is unreachable
            self._fail(donor, f"could not open a stream: {_describe(exc)}")
            return
        try:
            writer.write(wire.frame(encode_request(self.digest, indices)))
            await asyncio.wait_for(writer.drain(), self.timeout)
            limit = META_HEADER.size + MAX_META_BYTES + HASH_BYTES * len(self.chunks)
            hashes = self._accept_meta(await self._read(donor, reader, limit))
            for index in indices:
                limit = CHUNK_HEADER.size + 4 * math.prod(self.chunk_shapes[index])
                self._accept_chunk(await self._read(donor, reader, limit), index, hashes)
                self.chunks_by_donor[donor] += 1
        except (BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(donor, _describe(exc))
        finally:
            writer.close()

    async def _read(self, donor: Hashable, reader: asyncio.StreamReader, max_bytes: int) -> bytes:
        payload = await wire.read_frame(reader, max_bytes=max_bytes, timeout=self.timeout)
        self.bytes_by_donor[donor] += wire.LENGTH.size + len(payload)
        return payload

    def _fail(self, donor: Hashable, reason: str) -> None:
        self.failed[donor] = reason
        logger.warning("state %s: dropped donor %s: %s", self.digest.hex(), donor, reason)

    def _accept_meta(self, payload: bytes) -> list[bytes]:
        """Check a META against the digest, run and shapes; return its chunk hashes."""
        if payload[0] == MISSING:
            raise BadPayload("MISSING: the donor does not hold this state (any more)")
        if payload[0] != META or len(payload) < META_HEADER.size:
            raise BadPayload(f"expected META, got {KIND_NAMES.get(payload[0], payload[:1].hex())} "
                             f"of {len(payload)} bytes")
        _, meta_bytes = META_HEADER.unpack_from(payload)
        hashes_bytes = len(payload) - META_HEADER.size - meta_bytes
        if meta_bytes > MAX_META_BYTES or hashes_bytes != HASH_BYTES * len(self.chunks):
            raise BadPayload(f"META carries {meta_bytes} bytes of meta and {hashes_bytes} bytes of hashes; "
                             f"expected at most {MAX_META_BYTES} and {HASH_BYTES} per chunk of "
                             f"{len(self.chunks)}")
        body = payload[META_HEADER.size:META_HEADER.size + meta_bytes]
        try:
            meta = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=256, max_bin_len=0,
                                   max_array_len=0, max_map_len=8, max_ext_len=0)
        except Exception as exc:
            raise BadPayload(f"META meta is not valid msgpack: {exc}") from exc
        problem = _meta_problem(meta)
        if problem is not None:
            raise BadPayload(problem)
        start = META_HEADER.size + meta_bytes
        hashes = [payload[i:i + HASH_BYTES] for i in range(start, len(payload), HASH_BYTES)]
        digest = state_digest(meta, hashes)
        if digest != self.digest:
            raise BadPayload(f"META hashes to digest {digest.hex()}, expected {self.digest.hex()}")
        if meta["run_id"] != self.run_id:
            raise BadPayload(f"state belongs to run {meta['run_id']!r}, expected {self.run_id}")
        if self.meta is None:
            self.meta = meta
        return hashes

    def _accept_chunk(self, payload: bytes, index: int, hashes: list[bytes]) -> None:
        """Verify one CHUNK frame and write its rows into the tensors."""
        chunk, shape = self.chunks[index], self.chunk_shapes[index]
        if payload[0] != CHUNK or len(payload) < CHUNK_HEADER.size:
            raise BadPayload(f"expected CHUNK {index}, got {KIND_NAMES.get(payload[0], payload[:1].hex())}")
        _, got = CHUNK_HEADER.unpack_from(payload)
        if got != index:
            raise BadPayload(f"CHUNK {got} arrived where chunk {index} was due")
        if len(payload) != CHUNK_HEADER.size + 4 * math.prod(shape):
            raise BadPayload(f"CHUNK {index} carries {len(payload) - CHUNK_HEADER.size} bytes, expected "
                             f"{4 * math.prod(shape)} (float32 {shape})")
        data = memoryview(payload)[CHUNK_HEADER.size:]
        if chunk_hash(data) != hashes[index]:
            raise BadPayload(f"CHUNK {index} does not match its hash")
        values = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32)).reshape(shape)
        if not torch.isfinite(values).all():
            raise BadPayload(f"CHUNK {index} holds NaN or inf")
        piece_view(self.tensors[chunk.tensor], chunk).copy_(values)
        self.received[index] = True


async def download_state(donors: Sequence[Hashable], open_stream, *, digest: bytes,
                         shapes: Sequence[Sequence[int]], run_id: str, timeout: float,
                         chunk_elements: int = CHUNK_ELEMENTS) -> DownloadResult:
    """Download and verify the state named ``digest`` from ``donors``, spreading the chunks.

    Each pass deals the missing chunks to the live donors interleaved (chunk i of the missing
    list to donor i mod n), one stream per donor, all at once. A donor that fails is dropped and
    its undelivered chunks go to the others in the next pass; its verified chunks are kept.

    Args:
        donors: peer handles holding this digest (duplicates are ignored), in preference order.
        open_stream: ``await open_stream(donor) -> (asyncio.StreamReader, asyncio.StreamWriter)``.
        digest: the 16-byte state digest (from a progress record's hex).
        shapes: every tensor's shape, from the run manifest: φ, then the outer optimizer's state.
        run_id: the run the state must belong to.
        timeout: seconds to open a stream and to wait for each frame before dropping a donor.
        chunk_elements: the chunking the digest was made with.

    Returns:
        DownloadResult with the verified meta, fp32 CPU tensors shaped ``shapes``, and per-donor
        bytes read, chunks kept and failure reasons.

    Raises:
        StateDownloadFailed: every donor failed with chunks (or the meta) still missing; the
            message names the digest and each donor's reason. Nothing partial is returned.
        ValueError: ``digest`` is not 16 bytes, or ``chunk_elements`` below 1.
    """
    if len(digest) != HASH_BYTES:
        raise ValueError(f"a state digest has {HASH_BYTES} bytes, got {len(digest)}")
    sizes = [torch.Size(s) for s in shapes]
    download = _Download(open_stream, digest=digest, shapes=sizes, run_id=run_id, timeout=timeout,
                         chunks=plan_chunks(sizes, chunk_elements))
    alive = list(dict.fromkeys(donors))
    while True:
        missing = [i for i, done in enumerate(download.received) if not done]
        if not missing and download.meta is not None:
            break
        alive = [d for d in alive if d not in download.failed]
        if not alive:
            reasons = "; ".join(f"{d}: {r}" for d, r in download.failed.items()) or "no donors"
            raise StateDownloadFailed(
                f"could not download state {digest.hex()} ({len(download.chunks) - len(missing)} of "
                f"{len(download.chunks)} chunks verified): {reasons}", dict(download.failed))
        if missing:
            shares = {d: missing[k::len(alive)] for k, d in enumerate(alive[:len(missing)])}
        else:  # a state without chunks: one donor for the meta
            shares = {alive[0]: []}
        tasks = [asyncio.create_task(download.fetch(d, share)) for d, share in shares.items()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    assert download.meta is not None and all(download.received)
    return DownloadResult(meta=download.meta, tensors=download.tensors, bytes_by_donor=download.bytes_by_donor,
                          chunks_by_donor=download.chunks_by_donor, failed=download.failed)
