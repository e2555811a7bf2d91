"""hivemind's protobuf stream handlers, bounded: declared lengths, streams per peer, time.

hivemind 1.1.12 frames a protobuf message on a libp2p stream as ``1 marker byte`` (0: message,
1: error) + ``u64 big-endian length`` + the serialized message, and reads it with
``P2P.receive_raw_data``, which allocates whatever length the sender declares, so one stranger
can make the averager process allocate gigabytes (issue #17). Its stream handlers have
no cap on concurrent streams, and no time limit on a stream whose sender stays silent.

hivemind offers no hook for any of it: ``P2P.receive_protobuf`` is a static method, called by
class name from ``P2P._add_protobuf_stream_handler`` (where every stream handler of a servicer
is registered) and ``P2P._iterate_protobuf_stream_handler`` (where a caller reads the answers).
Both of those are instance methods, so :class:`BoundedP2P` overrides them; the averager process's
``P2P`` object (a replica of the DHT's daemon connection, made in that process) becomes a
``BoundedP2P`` when hivemind assigns it (:class:`BoundedHandlers`, the same seam as
peer/sync/group_key.py). Nothing global is patched: other processes and other ``P2P`` objects
keep hivemind's code.

Handler names and framing are unchanged, so honest peers running this code and stock hivemind
callers interoperate; only oversized, excess, silent or overlong streams are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import averaging_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from peer.net import pacing
from peer.net.limits import StreamSlots
from protocol.errors import BadPayload
from protocol.text import sanitize

logger = logging.getLogger(__name__)

HEADER_BYTES = 8
"""hivemind's length prefix: u64, big-endian (``P2P.HEADER_LEN``)."""


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    """What a remote peer may do on the averager's hivemind handlers."""

    max_request_bytes: int = 16 * 1024
    """Largest message read from a caller. A JoinRequest carries a schema hash (~20 B), an
    expiration, this peer's gathered metadata (~100 B) and a group key (~100 B): 16 KiB is more
    than 50 times what an honest one needs."""
    max_response_bytes: int = 2 * 1024 * 1024
    """Largest message read from a handler this peer called: a leader's BEGIN_ALLREDUCE names
    every groupmate (~40 B) and carries its gathered metadata (~150 B); 2 MiB holds a group of
    4,096 peers (``protocol.wire.allreduce.MAX_GROUP_SIZE``) at 512 B each."""
    max_messages: int = 8
    """Most messages a caller may send on one stream. ``rpc_join_group`` takes one request and
    the end-of-stream marker; the others are refused outright (:class:`BoundedHandlers`)."""
    message_timeout_s: float = 10.0
    """Seconds within which each message must arrive complete; hivemind's caller sends its
    request as soon as the stream is open."""
    stream_lifetime_s: float = 300.0
    """Longest a stream may stay open, s: an honest ``rpc_join_group`` lasts one matchmaking
    window (seconds to a few minutes, see ``for_matchmaking``)."""
    per_peer: int = 2
    """Streams one remote peer may hold open at once: an honest follower asks one leader at a
    time; one more covers a stream still closing when the next opens."""
    total: int = 128
    """Streams all remote peers may hold open at once: a leader hears from its group's followers
    (``target_group_size`` of 2 to a few dozen); at ``max_request_bytes`` plus asyncio's read
    buffer (128 KiB) each, 128 streams hold at most ~19 MiB."""

    def __post_init__(self):
        for name in ("max_request_bytes", "max_response_bytes", "max_messages", "per_peer", "total"):
            if getattr(self, name) < 1:
                raise ValueError(f"StreamLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("message_timeout_s", "stream_lifetime_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StreamLimits.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def for_matchmaking(cls, matchmaking_time_s: float, request_timeout_s: float) -> StreamLimits:
        """Limits whose stream lifetime covers the longest honest matchmaking: the matchmaking
        deadline (3 × ``matchmaking_time_s``, protocol/liveness.py) plus a request timeout, and a
        minute of slack for a slow event loop."""
        return cls(stream_lifetime_s=3 * matchmaking_time_s + request_timeout_s + 60.0)


async def read_protobuf(
    reader: asyncio.StreamReader, message_type: type[Message], *, max_bytes: int, timeout: float | None
) -> tuple[Message | None, RPCError | None]:
    """Read one hivemind-framed message, refusing a declared length over ``max_bytes`` before
    reading (or allocating) its body.

    Returns:
        (message, None) for a message, (None, error) for an error marker (hivemind's end of
        stream is an empty error).

    Raises:
        BadPayload: an unknown marker, a declared length over ``max_bytes``, or a body that is
            not a valid ``message_type``.
        asyncio.TimeoutError: the message was not complete within ``timeout`` seconds.
        asyncio.IncompleteReadError: the stream closed mid-message.
    """

    async def read() -> tuple[Message | None, RPCError | None]:
        marker = await reader.readexactly(1)
        if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
            raise BadPayload(f"unknown hivemind message marker {marker.hex()}")
        length = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
        if length > max_bytes:
            raise BadPayload(f"hivemind message declares {length} bytes; at most {max_bytes} allowed here")
        body = await reader.readexactly(length)
        parsed = message_type() if marker == P2P.MESSAGE_MARKER else RPCError()
        try:
            parsed.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise BadPayload(f"not a valid {type(parsed).__name__}: {exc}") from exc
        return (parsed, None) if marker == P2P.MESSAGE_MARKER else (None, parsed)

    return await asyncio.wait_for(read(), timeout)


class BoundedP2P(P2P):
    """hivemind's ``P2P`` whose protobuf stream handlers and stream calls are bounded by
    ``self.stream_limits`` (a :class:`StreamLimits`) and ``self.stream_slots`` (a
    :class:`~peer.net.limits.StreamSlots`). The averager process's is made by :meth:`adopt`;
    ``adopt(BoundedP2P(), limits)`` (no daemon) serves in-process tests and the fuzzer."""

    stream_limits: StreamLimits
    stream_slots: StreamSlots

    @classmethod
    def adopt(cls, p2p: P2P, limits: StreamLimits) -> BoundedP2P:
        """Turn ``p2p`` (made in this process, before any handler is added) into a BoundedP2P."""
        p2p.__class__ = cls
        p2p.stream_limits = limits
        p2p.stream_slots = StreamSlots(per_peer=limits.per_peer, total=limits.total)
        return p2p

    async def add_binary_stream_handler(self, name: str, handler, balanced: bool = False) -> None:
        """hivemind's, with every accepted stream paced and counted (peer/net/pacing.py)."""

        async def paced_handler(stream_info, reader, writer):
            return await handler(stream_info, pacing.counted(reader), pacing.paced(writer))

        await super().add_binary_stream_handler(name, paced_handler, balanced=balanced)

    async def call_binary_stream_handler(self, peer_id, handler_name: str):
        """hivemind's, with the opened stream paced and counted (peer/net/pacing.py)."""
        info, reader, writer = await super().call_binary_stream_handler(peer_id, handler_name)
        return info, pacing.counted(reader), pacing.paced(writer)

    async def _add_protobuf_stream_handler(
        self, name: str, handler, input_protobuf_type: type[Message], max_prefetch: int = 5, balanced: bool = False
    ) -> None:
        async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer, limits = stream_info.peer_id, self.stream_limits
            if not self.stream_slots.acquire(peer):
                logger.warning(
                    "refused a %s stream from %s: %d of this peer's and %d in all open",
                    name,
                    peer,
                    self.stream_slots.per_peer,
                    self.stream_slots.open,
                )
                writer.close()
                return
            try:
                context = _context(name, self.peer_id, peer)
                await asyncio.wait_for(
                    self._serve_stream(
                        handler,
                        context,
                        input_protobuf_type,
                        reader,
                        writer,
                        prefetch=max(1, min(max_prefetch, limits.max_messages)),
                    ),
                    limits.stream_lifetime_s,
                )
            except (TimeoutError, BadPayload, asyncio.IncompleteReadError, OSError) as exc:
                logger.warning(
                    "closed a %s stream from %s: %s",
                    name,
                    peer,
                    "timed out" if isinstance(exc, asyncio.TimeoutError) else sanitize(str(exc)),
                )
            finally:
                self.stream_slots.release(peer)
                writer.close()

        await self.add_binary_stream_handler(name, handle, balanced=balanced)

    async def _serve_stream(
        self,
        handler,
        context,
        input_type: type[Message],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        prefetch: int,
    ) -> None:
        """hivemind's request/response loop with every read bounded: the requests feed ``handler``
        through a queue of ``prefetch``, its answers are written back as they come.

        Raises:
            BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError: from a request that is
                oversized, malformed, late or cut off, or one message too many; the handler is
                cancelled.
        """
        limits = self.stream_limits
        requests: asyncio.Queue[Message | None] = asyncio.Queue(prefetch)

        async def read_requests() -> None:
            for _ in range(limits.max_messages):
                request, _error = await read_protobuf(
                    reader, input_type, max_bytes=limits.max_request_bytes, timeout=limits.message_timeout_s
                )
                await requests.put(request)
                if request is None:  # end of stream
                    return
            raise BadPayload(f"more than {limits.max_messages} messages on one stream")

        async def request_stream():
            while (request := await requests.get()) is not None:
                yield request

        async def respond() -> None:
            try:
                async for response in handler(request_stream(), context):
                    await P2P.send_protobuf(response, writer)
            except (ConnectionError, OSError):
                return  # the caller left; its own side reports that
            except Exception as exc:
                logger.warning("handler %s failed: %r", context.handle_name, exc)
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=str(exc)), writer)

        reading, responding = asyncio.create_task(read_requests()), asyncio.create_task(respond())
        try:
            await asyncio.wait({reading, responding}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done() and not responding.done():
                reading.result()  # a bad request raises here; the end of stream lets the handler finish
                await responding
        finally:
            for task in (reading, responding):
                task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await responding

    async def _iterate_protobuf_stream_handler(self, peer_id, name: str, requests, output_protobuf_type):
        """Call ``name`` at ``peer_id``: hivemind's call, with each answer's length bounded by
        ``max_response_bytes`` (the caller bounds the time, as hivemind's matchmaking does).

        The returned iterator raises BadPayload for an oversized or malformed answer and
        P2PHandlerError for the handler's error message, as hivemind does."""
        _, reader, writer = await self.call_binary_stream_handler(peer_id, name)
        max_bytes = self.stream_limits.max_response_bytes

        async def write_requests() -> None:
            async for request in requests:
                await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        writing = asyncio.create_task(write_requests())

        async def read_responses():
            try:
                while True:
                    try:
                        response, error = await read_protobuf(
                            reader, output_protobuf_type, max_bytes=max_bytes, timeout=None
                        )
                    except asyncio.IncompleteReadError:  # the handler closed the stream: done
                        break
                    if error is not None:
                        raise P2PHandlerError(
                            f"Failed to call handler `{name}` at {peer_id}: {sanitize(error.message)}"
                        )
                    yield response
                await writing
            finally:
                writing.cancel()
                writer.close()

        return read_responses()


def _context(name: str, local_id, remote_id) -> P2PContext:
    return P2PContext(handle_name=name, local_id=local_id, remote_id=remote_id)


class BoundedHandlers:
    """Mixin for a hivemind ``DecentralizedAverager``: its ``P2P`` becomes a :class:`BoundedP2P`
    with ``self._stream_limits`` when hivemind assigns it in the averager process, before any
    handler is registered (``_run_internal`` assigns ``self._p2p``, then adds the handlers).

    Also refuses hivemind's ``rpc_aggregate_part`` and ``rpc_download_state`` outright: locoswarm
    runs its own all-reduce and state transfer (peer/sync/allreduce.py, peer/state/), so these
    handlers only widen what a stranger can reach.
    """

    _stream_limits: StreamLimits = StreamLimits()

    @property
    def _p2p(self):
        try:
            return self.__dict__["_p2p"]
        except KeyError:
            raise AttributeError("_p2p: the averager process has not connected to its daemon") from None

    @_p2p.setter
    def _p2p(self, p2p) -> None:
        self.__dict__["_p2p"] = BoundedP2P.adopt(p2p, self._stream_limits) if isinstance(p2p, P2P) else p2p

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Refused: hivemind's all-reduce is not this swarm's (see the class docstring)."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Refused: state goes through peer/state/serve.py (see the class docstring)."""
        return
        yield  # an async generator that yields nothing
