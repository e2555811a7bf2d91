"""The donor side of a state download: answer one joiner's REQUEST on one stream.

Frames: protocol/wire/state.py. What is served: peer/state/snapshot.py. The joiner's side, with
several donors at once: peer/state/download.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from peer.state.snapshot import StateSnapshot, chunk_bytes
from protocol.errors import BadPayload
from protocol.wire import framing, state as frames
from protocol.wire.pieces import piece_view

logger = logging.getLogger(__name__)


async def serve_state(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    snapshot_for: Callable[[bytes], Awaitable[StateSnapshot | None]],
    *,
    timeout: float,
    admit: Callable[[int, int], bool] | None = None,
) -> int:
    """Answer one joiner's REQUEST on a fresh stream, then close it.

    Args:
        snapshot_for: ``await snapshot_for(digest)`` returns the snapshot with that 16-byte
            digest, or None if this peer does not hold it (the joiner gets MISSING).
        timeout: seconds to wait for the REQUEST, for each write to drain, and for the joiner
            to close after the last chunk.
        admit: ``admit(request_bytes, state_bytes)`` says whether the joiner may have the chunks
            it asked for (their fp32 bytes, of a state of ``state_bytes``); when it says no the
            stream is closed unanswered. None: every valid request is answered.

    Returns:
        Frame bytes handed to the writer (length prefixes included).

    Never raises for anything the joiner does (malformed or oversized REQUEST, unknown chunk
    index, a request over its budget, silence, disconnect): it logs the reason and closes the
    stream. The snapshot is only read.
    """
    written = 0

    def send(payload: bytes) -> None:
        nonlocal written
        data = framing.frame(payload)
        writer.write(data)
        written += len(data)

    try:
        try:
            payload = await framing.read_frame(reader, max_bytes=frames.MAX_REQUEST_BYTES, timeout=timeout)
            digest, indices = frames.parse_request(payload)
        except (TimeoutError, BadPayload, asyncio.IncompleteReadError) as exc:
            logger.warning("rejected a state request: %s", framing.describe_failure(exc))
            return written
        try:
            snapshot = await snapshot_for(digest)
        except Exception:
            logger.exception("state %s: could not look up the snapshot", digest.hex())
            return written
        if snapshot is None:
            logger.info("state %s requested; not held here", digest.hex())
            send(frames.encode_missing())
        elif indices and indices[-1] >= len(snapshot.chunks):
            logger.warning(
                "rejected a state request for %s: chunk %d requested, the state has %d chunks",
                digest.hex(),
                indices[-1],
                len(snapshot.chunks),
            )
            return written
        elif admit is not None and not admit(_chunk_bytes(snapshot, indices), _chunk_bytes(snapshot)):
            logger.warning(
                "refused a state request for %s: %d chunks is over the joiner's budget", digest.hex(), len(indices)
            )
            return written
        else:
            send(frames.encode_meta(snapshot.meta, snapshot.chunk_hashes))
            for index in indices:
                chunk = snapshot.chunks[index]
                send(frames.encode_chunk(index, chunk_bytes(snapshot.tensors[chunk.tensor], chunk)))
                await asyncio.wait_for(writer.drain(), timeout)
        await asyncio.wait_for(writer.drain(), timeout)
        # The joiner closes first, once it has read everything: closing here could make the p2p
        # daemon drop the stream's tail before it reaches the joiner.
        await asyncio.wait_for(reader.read(1), timeout)
    except (TimeoutError, ConnectionError, OSError) as exc:
        logger.info("state stream ended early after %d bytes: %s", written, framing.describe_failure(exc))
    finally:
        writer.close()
    return written


def _chunk_bytes(snapshot: StateSnapshot, indices: list[int] | None = None) -> int:
    """fp32 bytes of the chunks ``indices`` of ``snapshot`` (None: all of them)."""
    chunks = snapshot.chunks if indices is None else [snapshot.chunks[i] for i in indices]
    return sum(4 * piece_view(snapshot.tensors[c.tensor], c).numel() for c in chunks)
