"""The joiner side of a state download: a verified state from several donors at once.

A joiner downloads φ, the outer optimizer's state and the round from the swarm, not from one
donor: it picks a state digest held by several peers (peer/state/snapshot.py) and asks each of
them for an interleaved share of the chunks, one stream per donor (frames: protocol/wire/state.py;
the donor's side: peer/state/serve.py). A donor that fails (cannot be reached, goes silent, no
longer holds the state, sends anything that does not verify) is dropped with its reason, and the
chunks it had not delivered are dealt to the remaining donors in the next pass. Chunks already
verified are kept, from whichever donor they came. Every length is bounded before it is read.

:func:`download_state` runs in the averager process (peer/state/sharing.py); the trainer then
checks the result with :func:`validate_state` before any of it touches φ.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from peer.state.snapshot import CHUNK_ELEMENTS, chunk_hash, plan_chunks, state_digest
from peer.train.outer import first_non_finite
from peer.train.step_bound import global_norm
from protocol.errors import BadPayload, StateDownloadFailed
from protocol.text import sanitize
from protocol.wire import framing, state as frames
from protocol.wire.pieces import Piece, piece_shape, piece_view

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadedState:
    """φ, outer optimizer state and position of the swarm, downloaded from a live peer."""

    round: int
    inner_step: int
    phi: list[torch.Tensor]
    outer_state: list[torch.Tensor]
    chunk_hashes: tuple[bytes, ...] | None = None
    """The verified hashes of the state's chunks (peer/state/snapshot.py ``plan_chunks`` of φ then
    the outer state), as the digest binds them; None when not known. With them a snapshot of this
    state needs no second hashing pass (:meth:`peer.round.state.RoundState.take_snapshot`)."""


@dataclass(frozen=True)
class StateDownload:
    """A verified state and how its download went."""

    state: DownloadedState
    chunks_by_donor: dict[str, int]
    """Chunks each donor delivered (peer id → count): the load was spread over these."""
    failed: dict[str, str]
    """Donors dropped during the download, with the reason."""
    bytes_received: int


@dataclass
class DownloadResult:
    meta: dict[str, Any]
    """{"run_id", "round", "inner_step"}, verified against the digest."""
    tensors: list[torch.Tensor]
    """fp32 CPU tensors shaped as requested, every chunk hash-verified and finite."""
    chunk_hashes: tuple[bytes, ...] = ()
    """The chunks' hashes that the digest binds (16 bytes each, in chunk order), each chunk checked against its own."""
    bytes_by_donor: dict[Hashable, int] = field(default_factory=dict)
    """Frame bytes read from each donor contacted (length prefixes included)."""
    chunks_by_donor: dict[Hashable, int] = field(default_factory=dict)
    """Verified chunks kept from each donor contacted."""
    failed: dict[Hashable, str] = field(default_factory=dict)
    """Donors dropped, with the reason."""


class _Download:
    """Shared state of one download: the tensors being filled and what each donor did."""

    def __init__(
        self,
        open_stream,
        *,
        digest: bytes,
        shapes: list[torch.Size],
        run_id: str,
        timeout: float,
        chunks: list[Piece],
        on_progress=None,
    ):
        self.open_stream, self.digest, self.run_id, self.timeout = open_stream, digest, run_id, timeout
        self.on_progress = on_progress
        self.shapes, self.chunks = shapes, chunks
        self.chunk_shapes = [piece_shape(shapes[c.tensor], c) for c in chunks]
        self.tensors = [torch.empty(s, dtype=torch.float32) for s in shapes]
        self.received = [False] * len(chunks)
        self.meta: dict[str, Any] | None = None
        self.hashes: tuple[bytes, ...] = ()
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
            self._fail(donor, f"could not open a stream: {framing.describe_failure(exc)}")
            return
        try:
            writer.write(framing.frame(frames.encode_request(self.digest, indices)))
            await asyncio.wait_for(writer.drain(), self.timeout)
            limit = frames.META_HEADER.size + frames.MAX_META_BYTES + frames.HASH_BYTES * len(self.chunks)
            hashes = self._accept_meta(await self._read(donor, reader, limit))
            for index in indices:
                limit = frames.CHUNK_HEADER.size + 4 * math.prod(self.chunk_shapes[index])
                self._accept_chunk(await self._read(donor, reader, limit), index, hashes)
                self.chunks_by_donor[donor] += 1
                self._report()
        except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(donor, framing.describe_failure(exc))
        finally:
            writer.close()

    async def _read(self, donor: Hashable, reader: asyncio.StreamReader, max_bytes: int) -> bytes:
        payload = await framing.read_frame(reader, max_bytes=max_bytes, timeout=self.timeout)
        self.bytes_by_donor[donor] += framing.LENGTH.size + len(payload)
        return payload

    def _report(self) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(
                    sum(self.received),
                    len(self.chunks),
                    sum(self.bytes_by_donor.values()),
                    sum(1 for n in self.chunks_by_donor.values() if n),
                )
            except Exception:  # drawing progress must never fail a download
                logger.debug("progress callback failed", exc_info=True)

    def _fail(self, donor: Hashable, reason: str) -> None:
        self.failed[donor] = reason
        logger.warning("state %s: dropped donor %s: %s", self.digest.hex(), donor, reason)

    def _accept_meta(self, payload: bytes) -> list[bytes]:
        """Check a META against the digest and run; return its chunk hashes."""
        meta, hashes = frames.parse_meta(payload, chunks=len(self.chunks))
        digest = state_digest(meta, hashes)
        if digest != self.digest:
            raise BadPayload(f"META hashes to digest {digest.hex()}, expected {self.digest.hex()}")
        if meta["run_id"] != self.run_id:
            raise BadPayload(f"state belongs to run {meta['run_id']!r}, expected {self.run_id}")
        if self.meta is None:  # one digest binds one meta and one list of hashes: every donor's are these
            self.meta, self.hashes = meta, tuple(hashes)
        return hashes

    def _accept_chunk(self, payload: bytes, index: int, hashes: list[bytes]) -> None:
        """Verify one CHUNK frame and write its rows into the tensors."""
        chunk, shape = self.chunks[index], self.chunk_shapes[index]
        data = frames.parse_chunk(payload, expected_index=index, shape=shape)
        if chunk_hash(data) != hashes[index]:
            raise BadPayload(f"CHUNK {index} does not match its hash")
        values = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32)).reshape(shape)
        if not torch.isfinite(values).all():
            raise BadPayload(f"CHUNK {index} holds NaN or inf")
        piece_view(self.tensors[chunk.tensor], chunk).copy_(values)
        self.received[index] = True


async def download_state(
    donors: Sequence[Hashable],
    open_stream,
    *,
    digest: bytes,
    shapes: Sequence[Sequence[int]],
    run_id: str,
    timeout: float,
    chunk_elements: int = CHUNK_ELEMENTS,
    on_progress=None,
) -> DownloadResult:
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
        on_progress: ``on_progress(chunks_verified, chunks_total, bytes_read, donors_delivering)``
            after each verified chunk (e.g. :class:`peer.progress.TransferProgress`); its errors are
            logged and ignored.

    Returns:
        DownloadResult with the verified meta, fp32 CPU tensors shaped ``shapes``, and per-donor
        bytes read, chunks kept and failure reasons.

    Raises:
        StateDownloadFailed: every donor failed with chunks (or the meta) still missing; the
            message names the digest and each donor's reason. Nothing partial is returned.
        ValueError: ``digest`` is not 16 bytes, or ``chunk_elements`` below 1.
    """
    if len(digest) != frames.HASH_BYTES:
        raise ValueError(f"a state digest has {frames.HASH_BYTES} bytes, got {len(digest)}")
    sizes = [torch.Size(s) for s in shapes]
    download = _Download(
        open_stream,
        digest=digest,
        shapes=sizes,
        run_id=run_id,
        timeout=timeout,
        chunks=plan_chunks(sizes, chunk_elements),
        on_progress=on_progress,
    )
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
                f"{len(download.chunks)} chunks verified): {reasons}",
                dict(download.failed),
            )
        if missing:
            shares = {d: missing[k :: len(alive)] for k, d in enumerate(alive[: len(missing)])}
        else:  # a state without chunks: one donor for the meta
            shares = {alive[0]: []}
        tasks = [asyncio.create_task(download.fetch(d, share)) for d, share in shares.items()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    assert download.meta is not None and all(download.received)
    return DownloadResult(
        meta=download.meta,
        tensors=download.tensors,
        chunk_hashes=download.hashes,
        bytes_by_donor=download.bytes_by_donor,
        chunks_by_donor=download.chunks_by_donor,
        failed=download.failed,
    )


NORM_FACTOR = 10.0
"""How far a downloaded φ's global L2 norm may lie from this peer's own φ's, as a factor either way.
Training moves the norm slowly, and ever more slowly as a run goes on. A joiner compares with
φ_0, a peer with history with its own trained φ; a factor of 10 leaves that room several times
over, while a zeroed, scaled-up (1e30) or otherwise
implausible φ lies outside it. Within the bound the check proves nothing: it stops crude
takeovers, not a subtly poisoned φ."""


def check_sanity(state: DownloadedState, reference_phi: Sequence[torch.Tensor]) -> None:
    """Check a downloaded state's values before it replaces this peer's (issue #17, item 3): the
    global L2 norm of ``state.phi`` must lie in ``[ref/NORM_FACTOR, ref·NORM_FACTOR]``.

    Args:
        state: the verified download (digest, shapes and finiteness already checked).
        reference_phi: this peer's own φ (a joiner's is φ_0 from the run's seed), fp32 tensors.

    Raises:
        BadPayload: a tensor of φ or the outer state holds NaN or inf, or φ's norm lies outside the
            bound (the message gives both norms); nothing is changed either way.
    """
    bad = first_non_finite([*state.phi, *state.outer_state])
    if bad is not None:
        raise BadPayload(f"downloaded state tensor {bad} holds NaN or inf")
    norm, ref = global_norm(state.phi), global_norm(reference_phi)
    if ref > 0 and not ref / NORM_FACTOR <= norm <= ref * NORM_FACTOR:
        raise BadPayload(
            f"downloaded φ has norm {norm:.4g}, this peer's has {ref:.4g}: outside a factor of {NORM_FACTOR:g} either way"
        )


def check_agrees(state: DownloadedState, *, round_: int, inner_steps: int) -> None:
    """Check that a downloaded state is of the round the progress records that advertised its digest
    claim, before it replaces this peer's (issue #51): the digest binds the state's meta, not the
    record's round, so a donor can serve a state whose meta claims any round (2^63, a million rounds
    ahead) under a record of round r+1; adopting it would move this peer's round counter there.

    Args:
        state: the verified download (its meta within :data:`protocol.wire.state.META_BOUNDS`).
        round_: the round of the records that publish the state's digest.
        inner_steps: the run's H; a snapshot's meta is at the round's start, inner step ``round·H``.

    Raises:
        BadPayload: another round, or another inner step than ``round_·H``; nothing is changed.
    """
    if state.round != round_ or not 0 <= state.round <= frames.META_BOUNDS["round"]:
        raise BadPayload(f"the state's meta claims round {state.round}, the records that publish it round {round_}")
    if state.inner_step != round_ * inner_steps:
        raise BadPayload(
            f"the state's meta claims inner step {state.inner_step}, expected {round_ * inner_steps} "
            f"(the start of round {round_})"
        )


def validate_state(
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    *,
    run_id: str,
    shapes: Sequence[torch.Size],
    chunk_hashes: Sequence[bytes] | None = None,
) -> DownloadedState:
    """Check a downloaded state before any of it touches φ.

    Args:
        metadata: {"run_id", "round", "inner_step"} (more fields are ignored).
        tensors: φ then the outer optimizer's state, one fp32 tensor per shape each.
        shapes: the run's parameter shapes.
        chunk_hashes: the hashes the download verified the chunks against (``DownloadResult``),
            passed on; None: not known.

    Returns:
        A DownloadedState holding private copies of ``tensors`` (the averager's process hands them
        over in shared memory, one file descriptor each) and ``chunk_hashes``.

    Raises:
        BadPayload: names the first field or tensor that is wrong (a round or inner step outside
            :data:`protocol.wire.state.META_BOUNDS` included).
    """
    if not isinstance(metadata, dict):
        raise BadPayload(f"downloaded state metadata is a {type(metadata).__name__}, expected a map")
    if metadata.get("run_id") != run_id:
        raise BadPayload(f"downloaded state is for run {metadata.get('run_id')!r}, expected {run_id}")
    for name in ("round", "inner_step"):
        value, bound = metadata.get(name), frames.META_BOUNDS[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound:
            raise BadPayload(
                f"downloaded state field {name} = {sanitize(repr(value), max_chars=40)}: "
                f"expected an integer in [0, {bound}]"
            )
    n = len(shapes)
    if len(tensors) != 2 * n:
        raise BadPayload(f"downloaded state has {len(tensors)} tensors, expected {2 * n} (φ and outer momentum)")
    for index, tensor in enumerate(tensors):
        shape = shapes[index % n]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tensor.shape != shape:
            raise BadPayload(
                f"downloaded state tensor {index} is {getattr(tensor, 'dtype', type(tensor))} "
                f"{tuple(getattr(tensor, 'shape', ()))}, expected float32 {tuple(shape)}"
            )
    bad = first_non_finite(tensors)
    if bad is not None:
        raise BadPayload(f"downloaded state tensor {bad} holds NaN or inf")
    return DownloadedState(
        round=metadata["round"],
        inner_step=metadata["inner_step"],
        phi=[t.clone() for t in tensors[:n]],
        outer_state=[t.clone() for t in tensors[n:]],
        chunk_hashes=None if chunk_hashes is None else tuple(chunk_hashes),
    )
