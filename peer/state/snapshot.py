"""Content-addressed state snapshots: what donors serve to joiners (peer/state/serve.py).

A state (φ, the outer optimizer's state, the round) is cut into chunks, each chunk is named by
its hash, and the whole state by a digest over its metadata and those hashes (Merkle style).
Peers publish the digest's hex in their DHT progress records; a joiner asks donors for it by
digest and verifies every chunk against its hash (peer/state/download.py).

Chunks are rows of one tensor (:func:`plan_chunks`, the all-reduce's piece plan with one owner
and ``CHUNK_ELEMENTS`` per piece); both sides derive them from the run's tensor shapes. Hashes
are ``blake2b(raw bytes, digest_size=16)``; the digest is
``blake2b(msgpack(meta, sorted keys) + all chunk hashes, digest_size=16)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.train.outer import all_finite
from protocol.wire.pieces import Piece, piece_view, plan_pieces
from protocol.wire.state import HASH_BYTES, canonical_meta, meta_problem

CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk (1 MiB of fp32). Part of the protocol: it decides the chunks, so the digest."""


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


def state_digest(meta: dict[str, Any], chunk_hashes: Sequence[bytes]) -> bytes:
    """The 16-byte digest naming a state: blake2b of its canonical meta and all its chunk hashes."""
    return hashlib.blake2b(canonical_meta(meta) + b"".join(chunk_hashes), digest_size=HASH_BYTES).digest()


def chunk_view(tensor: torch.Tensor, chunk: Piece) -> memoryview:
    """``chunk``'s rows of ``tensor`` (contiguous fp32, CPU) as one little-endian fp32 buffer, not copied."""
    return piece_view(tensor, chunk).numpy().astype("<f4", copy=False).data


def chunk_bytes(tensor: torch.Tensor, chunk: Piece) -> bytes:
    """Raw little-endian fp32 bytes of ``chunk``'s rows of ``tensor`` (contiguous fp32, CPU)."""
    return chunk_view(tensor, chunk).tobytes()


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


def make_snapshot(
    meta: dict[str, Any],
    tensors: Sequence[torch.Tensor],
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
    owned: bool = False,
    chunk_hashes: Sequence[bytes] | None = None,
) -> StateSnapshot:
    """Copy a state and hash it, so that it can be served while training goes on.

    Costs one copy of the state in memory and one blake2b pass over it (blake2b releases the GIL,
    so it may run in an executor); with ``owned`` no copy, with ``chunk_hashes`` no hashing.

    Args:
        meta: {"run_id": str, "round": int >= 0, "inner_step": int >= 0}, nothing else.
        tensors: fp32 tensors of any device and layout, all finite.
        owned: ``tensors`` are contiguous CPU tensors that nothing else holds or changes (made for
            this snapshot): they become its own without a copy.
        chunk_hashes: the hashes of exactly these tensors' chunks, in chunk order, as a verified
            download checked them (peer/state/download.py): taken as they are, not recomputed.

    Raises:
        ValueError: a meta field is missing, extra or of the wrong type, a tensor is not fp32,
            or holds NaN or inf (a joiner would reject every chunk of it), or ``chunk_hashes`` are
            not one 16-byte hash per chunk.
    """
    problem = meta_problem(meta)
    if problem is not None:
        raise ValueError(problem)
    copies = [_private_copy(tensor, index, owned=owned) for index, tensor in enumerate(tensors)]
    chunks = plan_chunks([t.shape for t in copies], chunk_elements)
    if chunk_hashes is not None:
        hashes = tuple(chunk_hashes)
        if len(hashes) != len(chunks) or any(len(h) != HASH_BYTES for h in hashes):
            raise ValueError(
                f"{len(hashes)} chunk hashes given for a state of {len(chunks)} chunks "
                f"(each {HASH_BYTES} bytes); pass None to hash the tensors"
            )
    else:
        hashes = tuple(chunk_hash(chunk_view(copies[c.tensor], c)) for c in chunks)  # hashed in place
    meta = dict(meta)
    return StateSnapshot(
        meta=meta, tensors=tuple(copies), chunks=tuple(chunks), chunk_hashes=hashes, digest=state_digest(meta, hashes)
    )


def _private_copy(tensor: torch.Tensor, index: int, *, owned: bool) -> torch.Tensor:
    """``tensor`` as a snapshot holds it (contiguous fp32 on the CPU, its own), checked finite."""
    if tensor.dtype != torch.float32:
        raise ValueError(f"state tensor {index} is {tensor.dtype}, expected torch.float32")
    if owned and tensor.device.type == "cpu" and tensor.is_contiguous():
        copy = tensor.detach()
    else:
        copy = tensor.detach().cpu().clone(memory_format=torch.contiguous_format)
    if not all_finite(copy):
        raise ValueError(f"state tensor {index} holds NaN or inf")
    return copy


@dataclass(frozen=True)
class SealedTensor:
    """One tensor of a state, copied, checked and hashed ahead of the snapshot that will hold it
    (:func:`seal_tensor`, :func:`make_snapshot_from`): made in another thread, it costs the thread
    that takes the snapshot nothing."""

    index: int
    """Its position in the state (φ, then the outer optimizer's state)."""
    tensor: torch.Tensor
    """A private contiguous fp32 CPU tensor, finite; nothing may change it."""
    chunk_hashes: tuple[bytes, ...]
    """The hashes of its chunks, in chunk order."""


def seal_tensor(
    tensor: torch.Tensor,
    *,
    index: int,
    shapes: Sequence[Sequence[int]],
    owned: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> SealedTensor:
    """Copy (unless ``owned``), check and hash state tensor ``index`` as :func:`make_snapshot` would.

    Args:
        tensor: the tensor's new value, fp32, any device and layout, shaped ``shapes[index]``.
        index: its position in the state.
        shapes: every tensor's shape in state order (they decide the chunks).
        owned: as :func:`make_snapshot`'s: a contiguous CPU tensor nothing else holds or changes.

    Raises:
        ValueError: ``index`` outside ``shapes``, another shape, not fp32, or NaN or inf in it.
    """
    if not 0 <= index < len(shapes) or tuple(tensor.shape) != tuple(shapes[index]):
        raise ValueError(
            f"state tensor {index} of shape {tuple(tensor.shape)}: the state has "
            f"{len(shapes)} tensors" + (f", this one shaped {tuple(shapes[index])}" if 0 <= index < len(shapes) else "")
        )
    copy = _private_copy(tensor, index, owned=owned)
    # a tensor's chunk rows follow from its own shape alone (plan_pieces), so it is planned alone
    chunks = plan_chunks([copy.shape], chunk_elements)
    return SealedTensor(index=index, tensor=copy, chunk_hashes=tuple(chunk_hash(chunk_view(copy, c)) for c in chunks))


def make_snapshot_from(previous: StateSnapshot, meta: dict[str, Any], sealed: Iterable[SealedTensor]) -> StateSnapshot:
    """The snapshot of a state that differs from ``previous``'s only in the ``sealed`` tensors
    (:func:`seal_tensor`): the other tensors and their chunk hashes are ``previous``'s, shared (both
    snapshots are immutable), so nothing is copied or hashed but the digest. The result is
    :func:`make_snapshot`'s for the same meta and tensors, digest included.

    Streaming DiLoCo's round loop takes its round-end snapshot so: each fragment whose mean landed
    during the round was sealed by the sync's thread (peer/round/streamed.py ``FragmentSchedule.prepare_fragment``).

    Args:
        previous: the snapshot of the state before the sealed tensors changed.
        meta: the new snapshot's meta, as for :func:`make_snapshot`.
        sealed: at most one per state index; a later one for the same index replaces an earlier.

    Raises:
        ValueError: a bad meta, or a sealed tensor whose index, shape or chunks are not ``previous``'s.
    """
    problem = meta_problem(meta)
    if problem is not None:
        raise ValueError(problem)
    tensors, by_index = list(previous.tensors), {}
    for s in sealed:
        if not 0 <= s.index < len(tensors) or s.tensor.shape != tensors[s.index].shape:
            raise ValueError(
                f"sealed tensor {s.index} of shape {tuple(s.tensor.shape)} does not fit the state's "
                f"{len(tensors)} tensors"
            )
        tensors[s.index], by_index[s.index] = s.tensor, s.chunk_hashes
    hashes = list(previous.chunk_hashes)
    for index, new_hashes in by_index.items():
        at = [c.index for c in previous.chunks if c.tensor == index]
        if len(new_hashes) != len(at):
            raise ValueError(
                f"sealed tensor {index} has {len(new_hashes)} chunk hashes, the state's chunks "
                "of it are not as many (sealed with another chunk size)"
            )
        for i, h in zip(at, new_hashes):
            hashes[i] = h
    meta = dict(meta)
    return StateSnapshot(
        meta=meta,
        tensors=tuple(tensors),
        chunks=previous.chunks,
        chunk_hashes=tuple(hashes),
        digest=state_digest(meta, hashes),
    )
