# The server and the call function share one stream discipline (answer, linger,
# cancel on give-up) and its workarounds for hivemind 1.1.12; apart they would repeat it.
"""Stage calls between peers: a micro-batch's forward and backward in one exchange on a libp2p stream.

SWARM parallelism (arXiv 2301.11913, §3.2): a peer serving stage k sends a micro-batch's
activations (and its targets) to a replica of stage k+1, which runs its forward, calls the next
stage in turn unless it is the last, runs its backward, and answers with the gradient of the loss
w.r.t. the activations it received. Because a request carries the stage's whole input, any
replica can serve it: a caller that gets no answer in its deadline, an error, or a broken stream
tries the same request on another replica (:func:`call_with_retry`; the order of the replicas is
the router's, peer/pipeline/routing.py).

Frames: protocol/wire/pipeline.py. On a stream the caller sends one STAGE_REQUEST and keeps its
side open until the answer (a STAGE_REPLY or STAGE_ERROR) arrives; it may then send the next
request on the same stream. A caller that closes its side, or sends anything, before its answer
has given up: the server cancels that request's work.

The server runs on the loop of the ``P2P`` it is given; it never raises into hivemind's stream
dispatch and never unpickles anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import suppress
from typing import TypeAlias

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from peer.net.limits import StreamSlots
from protocol.errors import BadPayload, StageCallFailed
from protocol.text import sanitize
from protocol.wire import framing
from protocol.wire.pipeline import (
    KIND_NAMES,
    STAGE_ERROR,
    StageError,
    StageLimits,
    StageReply,
    StageRequest,
    encode_error,
    encode_reply,
    encode_request,
    max_answer_bytes,
    max_request_bytes,
    parse_answer,
    parse_request,
    peek_request_id,
)

logger = logging.getLogger(__name__)

PeerRef: TypeAlias = PeerID | str
"""A replica: a hivemind PeerID, or its base58 text (as the router, peer/pipeline/routing.py, holds it)."""
Handle = Callable[[StageRequest], Awaitable[tuple[torch.Tensor, float, int]]]
"""A stage's work on one request: ``(grad, loss, tokens)`` (see :class:`StageServer`)."""

MAX_REASON_CHARS = 200
"""Longest reason a server puts in a STAGE_ERROR, in characters: enough for one exception line."""
LINGER_S = 1.0
"""Seconds a server waits, after a STAGE_ERROR that ends a stream, for the caller to close it."""
MAX_LINGERING = 16
"""Most streams a server keeps open at once only to let their STAGE_ERROR reach the caller."""


class StageServer:
    """Serves one pipeline stage on ``protocol_name`` of a hivemind ``P2P``.

    Each stream carries requests one after the other: the server reads a STAGE_REQUEST (bounded by
    ``max_request_bytes(limits)`` before anything is allocated, and by ``timeout_s``), awaits
    ``handle(request)``, and writes a STAGE_REPLY; a request that fails validation gets a
    STAGE_ERROR naming the problem and the stream is closed; a ``handle`` that raises, or returns
    a gradient the wire refuses (wrong shape or dtype, non-finite), gets a STAGE_ERROR and the
    stream stays open. A stream over ``max_streams_per_peer`` open streams of its peer (or over
    ``max_streams_total`` in all) is answered STAGE_ERROR (request id 0) and closed; what it
    carries is discarded unparsed.

    Args:
        p2p: the hivemind ``P2P`` to serve on.
        protocol_name: the libp2p protocol, e.g. ``/locoswarm/<run id>/stage/2``.
        handle: ``async handle(request) -> (grad, loss, tokens)``: ``grad`` is ∂loss/∂activations
            shaped (B, T, H) in the request's dtype, ``loss`` the mean loss in nats per token,
            ``tokens`` the count it averages over (<= B·T). Its compute belongs in a thread
            executor; it is cancelled when the caller gives up.
        limits: the run's limits (protocol/wire/pipeline.py :class:`StageLimits`).
        max_streams_per_peer: most streams one remote peer may hold open at once (>= 1).
        timeout_s: seconds a request may take to arrive complete, and a stream may sit idle
            between requests, before the stream is closed.
        max_streams_total: most streams all remote peers together may hold open at once.
        stage: the stage index this server serves; a request for another is refused. None: any.

    Attributes:
        served: requests answered with a STAGE_REPLY.
        rejected: requests refused as invalid (each also closed its stream).
        failed: requests whose ``handle`` raised or returned a gradient the wire refuses.
        abandoned: requests whose caller left before the answer (their work was cancelled).
        slots: the stream caps; ``slots.refused`` counts streams refused over a cap.

    Raises:
        ValueError: a cap below 1, ``max_streams_total`` below ``max_streams_per_peer``, or a
            ``timeout_s`` not > 0.
    """

    def __init__(
        self,
        p2p: P2P,
        protocol_name: str,
        handle: Handle,
        limits: StageLimits,
        *,
        max_streams_per_peer: int,
        timeout_s: float,
        max_streams_total: int = 64,
        stage: int | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"StageServer timeout_s must be > 0, got {timeout_s}")
        self.p2p, self.protocol_name, self.handle, self.limits = p2p, protocol_name, handle, limits
        self.timeout_s, self.stage = timeout_s, stage
        self.slots = StreamSlots(per_peer=max_streams_per_peer, total=max_streams_total)
        self.served = self.rejected = self.failed = self.abandoned = 0
        self._max_request = max_request_bytes(limits)
        self._streams: set[asyncio.Task] = set()
        self._lingering = 0
        self._started = False

    @property
    def refused(self) -> int:
        """Streams and requests turned away: over a stream cap, or invalid."""
        return self.slots.refused + self.rejected

    async def start(self) -> StageServer:
        """Register the stream handler on ``p2p``.

        Raises:
            Whatever hivemind raises when the daemon refuses the handler (P2PDaemonError).
        """
        await self.p2p.add_binary_stream_handler(self.protocol_name, self._on_stream)
        self._started = True
        return self

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving: remove the handler (skipped quietly if the daemon is already gone) and
        cancel the streams being served; their callers see their stream close."""
        if self._started:
            self._started = False
            with suppress(Exception):
                await asyncio.wait_for(self.p2p.remove_binary_stream_handler(self.protocol_name), timeout_s)
        for task in list(self._streams):
            task.cancel()
        if self._streams:
            await asyncio.wait(list(self._streams), timeout=timeout_s)

    async def __aenter__(self) -> StageServer:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def _on_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id
        if not self.slots.acquire(peer):
            logger.warning(
                "refused a stage stream from %s: %d of its streams (%d in all) open",
                peer,
                self.slots.per_peer,
                self.slots.open,
            )
            await self._error_and_close(
                reader,
                writer,
                encode_error(
                    0, f"refused: at most {self.slots.per_peer} streams per peer and {self.slots.total} in all"
                ),
            )
            return
        task = asyncio.current_task()
        assert task is not None  # a stream handler runs in its own task
        self._streams.add(task)
        try:
            await self._serve(peer, reader, writer)
        except (ConnectionError, OSError) as exc:
            logger.debug("stage stream from %s broke: %r", peer, exc)
        finally:
            self._streams.discard(task)
            self.slots.release(peer)
            writer.close()

    async def _serve(self, peer: Hashable, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                payload = await framing.read_frame(reader, max_bytes=self._max_request, timeout=self.timeout_s)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    logger.warning("stage stream from %s: %s", peer, framing.describe_failure(exc))
                return  # the caller closed between requests: done
            except TimeoutError:
                return
            except BadPayload as exc:  # a declared length over the cap: the stream cannot resync
                await self._refuse(peer, reader, writer, 0, exc)
                return
            try:
                request = await asyncio.to_thread(parse_request, payload, self.limits, stage=self.stage)
            except BadPayload as exc:
                await self._refuse(peer, reader, writer, peek_request_id(payload), exc)
                return
            answer, caller_left = await self._answer(peer, request, reader)
            if answer is None:
                return
            writer.write(framing.frame(answer))
            await writer.drain()
            if caller_left:  # it sent bytes before its answer: the framing is lost
                return

    async def _refuse(
        self,
        peer: Hashable,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request_id: int,
        exc: BadPayload,
    ) -> None:
        self.rejected += 1
        reason = sanitize(str(exc), max_chars=MAX_REASON_CHARS)
        logger.warning("rejected a stage request from %s: %s", peer, reason)
        await self._error_and_close(reader, writer, encode_error(request_id, f"bad request: {reason}"))

    async def _error_and_close(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
    ) -> None:
        """Send a STAGE_ERROR, then drop what the caller still sends until it closes (at most
        ``LINGER_S``, at most ``MAX_LINGERING`` streams at once), then close. Closing a socket
        with unread data resets the stream, and p2pd may then drop the error before it is sent."""
        try:
            writer.write(framing.frame(payload))
            await asyncio.wait_for(writer.drain(), LINGER_S)
            if self._lingering < MAX_LINGERING:
                self._lingering += 1
                try:
                    await asyncio.wait_for(_discard_until_eof(reader), LINGER_S)
                finally:
                    self._lingering -= 1
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, peer: Hashable, request: StageRequest, reader: asyncio.StreamReader
    ) -> tuple[bytes | None, bool]:
        """Run ``handle`` while watching the stream: (the answer's payload, whether the caller
        closed or sent anything meanwhile: the stream must then end after the answer); (None, True)
        when the caller did so before the work was done: the work is cancelled."""
        work = asyncio.ensure_future(self.handle(request))
        watch = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
            # collect both, so that a cancelled handle has unwound before the slot is released
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            self.abandoned += 1
            logger.info("the caller %s left before the answer to request %d; work cancelled", peer, request.request_id)
            return None, True
        caller_left = watch.done() and not watch.cancelled()
        try:
            grad, loss, tokens = work.result()
            acts = request.activations
            if not isinstance(grad, torch.Tensor) or grad.shape != acts.shape or grad.dtype != acts.dtype:
                got = (tuple(grad.shape), grad.dtype) if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise ValueError(f"the stage returned a gradient {got}, expected {(tuple(acts.shape), acts.dtype)}")
            reply = StageReply(request_id=request.request_id, grad=grad, loss=float(loss), tokens=int(tokens))
            answer = await asyncio.to_thread(encode_reply, reply)
            self.served += 1
            return answer, caller_left
        except Exception as exc:
            self.failed += 1
            reason = sanitize(f"{type(exc).__name__}: {exc}", max_chars=MAX_REASON_CHARS)
            logger.warning("stage request %d from %s failed: %s", request.request_id, peer, reason)
            return encode_error(request.request_id, reason), caller_left


async def _discard_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def call_with_retry(
    p2p: P2P,
    replicas: Sequence[PeerRef],
    protocol_name: str,
    request: StageRequest,
    limits: StageLimits,
    timeout_s: float,
    *,
    attempts: int | None = None,
) -> tuple[StageReply, PeerRef, list[tuple[PeerRef, str]]]:
    """Send ``request`` to the replicas in the given order until one answers.

    Each replica gets its own deadline of ``timeout_s``; the request is encoded once and sent
    unchanged (same request id) to each.

    Args:
        p2p: this peer's hivemind ``P2P``.
        replicas: the stage's replicas, best first (the router's order).
        protocol_name: the stage's libp2p protocol (as its :class:`StageServer` serves it).
        request: activations (B, T, H) fp32/bf16 and int32 targets (B, T) for stage ``request.stage``.
        limits: the run's limits; each answer is bounded by ``max_answer_bytes(limits)``.
        timeout_s: deadline of each replica's whole exchange (opening the stream, the stages after
            this one, the answer), seconds.
        attempts: most replicas to try (the first ``attempts``); None: all of them.

    Returns:
        (the reply, the replica that answered, ``(peer_id, reason)`` for each that failed first).
        The reply's ``grad`` is ∂loss/∂activations, the request's shape and dtype; ``loss`` in
        nats per token; ``tokens`` its count.

    Raises:
        StageCallFailed: no replica answered (or ``replicas`` is empty); the message names every
            replica tried and its reason, ``failures`` lists them.
        ValueError: ``attempts`` below 1, or ``request`` cannot be encoded.
    """
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    framed = framing.frame(await asyncio.to_thread(encode_request, request))
    failures: list[tuple[PeerRef, str]] = []
    for peer_id in list(replicas)[:attempts]:
        try:
            reply = await _exchange(p2p, peer_id, protocol_name, framed, request, limits, timeout_s)
        except StageCallFailed as exc:
            failures.append((peer_id, exc.failures[0][1]))
            logger.debug(
                "stage %d replica %s failed request %d: %s",
                request.stage,
                peer_id,
                request.request_id,
                exc.failures[0][1],
            )
            continue
        return reply, peer_id, failures
    tried = "; ".join(f"{sanitize(str(peer_id), max_chars=80)}: {reason}" for peer_id, reason in failures)
    raise StageCallFailed(
        f"no replica of stage {request.stage} answered micro-batch {request.micro_batch} "
        f"(request {request.request_id}): {tried or 'no replica to call'}",
        failures,
    )


async def _exchange(
    p2p: P2P,
    peer_id: PeerRef,
    protocol_name: str,
    framed: bytes,
    request: StageRequest,
    limits: StageLimits,
    timeout_s: float,
) -> StageReply:
    writer: asyncio.StreamWriter | None = None
    try:
        target = PeerID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
    except ValueError as exc:
        reason = f"not a peer id: {sanitize(str(exc), max_chars=MAX_REASON_CHARS)}"
        raise StageCallFailed(
            f"stage {request.stage} replica {sanitize(str(peer_id), max_chars=80)}: {reason}", [(peer_id, reason)]
        ) from exc

    async def exchange() -> StageReply | StageError:
        nonlocal writer
        _, reader, writer = await p2p.call_binary_stream_handler(target, protocol_name)
        writer.write(framed)
        await writer.drain()
        answer = await framing.read_frame(reader, max_bytes=max_answer_bytes(limits), timeout=None)
        return await asyncio.to_thread(parse_answer, answer, limits, request=request)

    try:
        try:
            result = await asyncio.wait_for(exchange(), timeout_s)
        except BaseException as exc:
            if writer is None:
                _close_abandoned_connection(exc)
            raise
    except TimeoutError:
        reason = f"no answer within {timeout_s:g} s"
    except asyncio.IncompleteReadError as exc:
        reason = framing.describe_failure(exc)
    except BadPayload as exc:
        reason = f"invalid answer: {exc}"
    except (P2PDaemonError, P2PHandlerError, ConnectionError, OSError) as exc:
        reason = f"stream failed: {sanitize(str(exc), max_chars=MAX_REASON_CHARS) or type(exc).__name__}"
    else:
        if isinstance(result, StageReply):
            return result
        reason = f"{KIND_NAMES[STAGE_ERROR]}: {result.reason}"
    finally:
        if writer is not None:
            writer.close()
    raise StageCallFailed(
        f"stage {request.stage} replica {target} failed request {request.request_id}: {reason}", [(peer_id, reason)]
    )


def _close_abandoned_connection(exc: BaseException | None) -> None:
    """Close the daemon connection a failed stream open left behind.

    hivemind 1.1.12's ``ControlClient.stream_open`` opens a connection to its p2pd, and raises
    without closing it when the dial fails (a dead replica) or the call is cancelled (a deadline):
    the socket would stay open until garbage collection. Its frame is still reachable from the
    exception's traceback, so the connection is closed here, at once.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "stream_open":
                writer = tb.tb_frame.f_locals.get("writer")
                if isinstance(writer, asyncio.StreamWriter):
                    writer.close()
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
