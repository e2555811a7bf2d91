"""A stranger against the averager process's handlers: hivemind's ``rpc_join_group`` and the state
transfer (issue #17 item 5).

A real peer (DHT + averager process, through ``NetworkTransport``) and an attacker that is a stock
hivemind node: it opens libp2p streams to the peer's handlers and writes what it likes. Measured:
the averager process's peak memory (``VmHWM``) and the bytes the peer served. On the code before
the limits, a 256 MiB message into ``rpc_join_group`` grew the averager process by about twice
that, and every one of 20 state requests was answered with the whole state.

``LOCO_ATTACK_MIB`` sets the size of the join-group message (default 256); the issue measured
1536. Run with ``-s`` to see the measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID

from peer.net import dht_node
from peer.net.limits import ServeBudget, StreamSlots
from peer.state.sharing import MIN_STATE_BYTES, STATE_STREAMS_PER_PEER
from peer.state.snapshot import make_snapshot
from peer.sync.averager import ALLREDUCE_STREAMS_PER_PEER
from peer.sync.hivemind_limits import StreamLimits
from peer.sync.transport import NetworkTransport
from protocol.manifest import SyncSpec
from protocol.wire import framing, state as state_frames

ATTACK_MIB = int(os.environ.get("LOCO_ATTACK_MIB", "256"))
STATE_ELEMENTS = 4 << 20  # a 16 MiB state: 16 chunks of 1 MiB


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@contextlib.contextmanager
def victim_and_attacker():
    """A peer with an averager serving a 16 MiB state, and a stock hivemind node connected to it."""
    dht = transport = attacker = None
    try:
        dht = dht_node.start_dht()
        shapes = [torch.Size([STATE_ELEMENTS // 1024, 1024])]
        transport = NetworkTransport(
            dht, shapes, shapes, "run-limits", SyncSpec(matchmaking_time_s=2.0, next_chunk_timeout_s=5.0)
        )
        snapshot = make_snapshot({"run_id": "run-limits", "round": 3, "inner_step": 15}, [torch.randn(shapes[0])])
        transport.share_state(lambda: [snapshot])
        attacker = hivemind.DHT(
            initial_peers=[str(m) for m in dht.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
        yield dht, transport, snapshot, attacker
    finally:
        for thing in (attacker, transport, dht):
            if thing is not None:
                thing.shutdown()


async def _flood(_dht, node, *, victim: bytes, handler: str, declared: int, send: int) -> int:
    """Open ``handler`` at ``victim`` and write a hivemind message declaring ``declared`` bytes,
    then up to ``send`` bytes of its body; return how many body bytes the victim took."""
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID(victim), handler)
    writer.write(b"\x00" + declared.to_bytes(8, "big"))
    sent, block = 0, b"\x07" * (1 << 20)
    try:
        while sent < send:
            writer.write(block)
            await asyncio.wait_for(writer.drain(), 20)
            sent += len(block)
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        writer.close()
    return sent


async def _request_state(
    _dht, node, *, victim: bytes, handler: str, digest: bytes, chunks: int, requests: int
) -> tuple[int, int]:
    """Send ``requests`` REQUESTs for every chunk, two at a time; return (bytes sent, bytes received)."""
    sent = received = 0

    async def one() -> None:
        nonlocal sent, received
        try:
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID(victim), handler)
        except Exception:
            return
        request = framing.frame(state_frames.encode_request(digest, list(range(chunks))))
        writer.write(request)
        sent += len(request)
        try:
            while True:
                data = await asyncio.wait_for(reader.read(1 << 20), 10)
                if not data:
                    break
                received += len(data)
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    for _ in range(requests // 2):
        await asyncio.gather(one(), one())
    return sent, received


async def _hold(_dht, node, *, victim: bytes, handler: str, streams: int) -> int:
    """Open ``streams`` streams to ``handler`` at ``victim`` and send nothing; return how many the
    victim closed within 2 s (less than any of its read timeouts)."""
    opened = [await node.p2p.call_binary_stream_handler(PeerID(victim), handler) for _ in range(streams)]

    async def closed(reader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(1), 2) == b""
        except (TimeoutError, ConnectionError):
            return False

    try:
        return sum(await asyncio.gather(*(closed(reader) for _, reader, _ in opened)))
    finally:
        for _, _, writer in opened:
            writer.close()


def test_a_huge_message_into_rpc_join_group_is_refused_before_it_is_read():
    with victim_and_attacker() as (dht, transport, _, attacker):
        averager = transport.averager
        handler = f"{averager.prefix}::LocoAverager.rpc_join_group"
        before = _peak_rss_mb(averager.pid)
        body = attacker.run_coroutine(
            functools.partial(
                _flood, victim=dht.peer_id.to_bytes(), handler=handler, declared=ATTACK_MIB << 20, send=ATTACK_MIB << 20
            )
        )
        growth = _peak_rss_mb(averager.pid) - before
        print(f"\nrpc_join_group: {ATTACK_MIB} MiB declared, {body >> 20} MiB written; averager peak +{growth:.0f} MB")
        assert growth < max(64, ATTACK_MIB / 4), f"the averager grew by {growth:.0f} MB"
        assert averager.is_alive()


def test_state_requests_are_bounded_per_peer():
    with victim_and_attacker() as (dht, transport, snapshot, attacker):
        averager = transport.averager
        before = _peak_rss_mb(averager.pid)
        sent, received = attacker.run_coroutine(
            functools.partial(
                _request_state,
                victim=dht.peer_id.to_bytes(),
                handler=averager.state_protocol,
                digest=snapshot.digest,
                chunks=len(snapshot.chunks),
                requests=20,
            )
        )
        growth = _peak_rss_mb(averager.pid) - before
        state_bytes = 4 * STATE_ELEMENTS
        print(
            f"\n20 state requests: {sent} B sent, {received / 2**20:.1f} MiB served "
            f"({received / sent:.0f}x); averager peak +{growth:.0f} MB"
        )
        # one joiner gets at most a budget's worth (a 64 MiB floor) plus one state in flight
        assert received <= max(state_bytes, MIN_STATE_BYTES) + state_bytes + 65536, received
        assert received >= state_bytes  # an honest-looking first request is answered
        assert growth < 128, f"the averager grew by {growth:.0f} MB"


@pytest.mark.parametrize("handler", ["state", "rpc_join_group", "allreduce"])
def test_silent_streams_over_the_per_peer_cap_are_closed_at_once(handler):
    with victim_and_attacker() as (dht, transport, _, attacker):
        averager = transport.averager
        name, cap = {
            "state": (averager.state_protocol, STATE_STREAMS_PER_PEER),
            "rpc_join_group": (f"{averager.prefix}::LocoAverager.rpc_join_group", StreamLimits().per_peer),
            "allreduce": (averager.stream_protocol, ALLREDUCE_STREAMS_PER_PEER),
        }[handler]
        streams = cap + 4
        closed = attacker.run_coroutine(
            functools.partial(_hold, victim=dht.peer_id.to_bytes(), handler=name, streams=streams)
        )
        assert closed >= streams - cap


# ---------------------------------------------------------------- in process: the limits themselves


def _fed(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_a_declared_length_over_the_cap_is_refused_before_its_body_is_awaited():
    from hivemind.proto import averaging_pb2

    from peer.sync.hivemind_limits import read_protobuf
    from protocol.errors import BadPayload

    async def read(declared: int):
        # no body and no end of stream: a reader that trusted the length would wait forever
        reader = _fed(b"\x00" + declared.to_bytes(8, "big"), eof=False)
        return await read_protobuf(reader, averaging_pb2.JoinRequest, max_bytes=16384, timeout=None)

    for declared in (16385, 1536 << 20, 2**64 - 1):
        with pytest.raises(BadPayload, match=f"declares {declared} bytes"):
            asyncio.run(read(declared))


def test_a_malicious_leader_s_oversized_answer_ends_the_call_with_bad_payload():
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter

    from peer.sync.hivemind_limits import BoundedP2P
    from protocol.errors import BadPayload

    class Writer:
        def write(self, data):
            pass

        async def drain(self):
            pass

        def close(self):
            pass

    async def call():
        p2p = BoundedP2P()
        p2p._client_listen_maddr = None
        BoundedP2P.adopt(p2p, StreamLimits(max_response_bytes=1024))

        async def open_stream(peer_id, name):  # the leader answers with a 1 GiB message it never sends
            return None, _fed(b"\x00" + (1 << 30).to_bytes(8, "big"), eof=False), Writer()

        p2p.call_binary_stream_handler = open_stream
        answers = await p2p._iterate_protobuf_stream_handler(
            "leader",
            "LocoAverager.rpc_join_group",
            as_aiter(averaging_pb2.JoinRequest()),
            averaging_pb2.MessageFromLeader,
        )
        return [a async for a in answers]

    with pytest.raises(BadPayload, match="declares 1073741824 bytes"):
        asyncio.run(call())


def test_a_stream_that_stays_silent_or_outlives_its_limit_is_closed():
    from hivemind.proto import averaging_pb2

    from peer.sync.hivemind_limits import BoundedP2P

    class Info:
        peer_id = "stranger"

    class Writer:
        closed = False

        def write(self, data):
            pass

        async def drain(self):
            pass

        def close(self):
            Writer.closed = True

    async def endless(request, context):  # a handler that would keep the stream forever
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        await asyncio.Event().wait()

    async def run(data: bytes) -> bool:
        p2p = BoundedP2P()
        p2p.peer_id, p2p._client_listen_maddr = "me", None
        BoundedP2P.adopt(p2p, StreamLimits(message_timeout_s=0.2, stream_lifetime_s=0.5))
        handlers = {}

        async def register(name, handle, balanced=False):
            handlers[name] = handle

        p2p.add_binary_stream_handler = register
        await p2p.add_protobuf_handler("join", endless, averaging_pb2.JoinRequest, stream_output=True)
        Writer.closed = False
        await handlers["join"](Info(), _fed(data, eof=False), Writer())
        return Writer.closed and p2p.stream_slots.open == 0

    request = averaging_pb2.JoinRequest(schema_hash=b"s").SerializeToString()
    whole = b"\x00" + len(request).to_bytes(8, "big") + request + b"\x01" + (0).to_bytes(8, "big")
    assert asyncio.run(run(b""))  # silent: closed after the message timeout
    assert asyncio.run(run(whole))  # a handler that never ends: closed at the stream's lifetime


def test_stream_slots_cap_per_peer_and_in_total():
    slots = StreamSlots(per_peer=2, total=3)
    assert slots.acquire("a") and slots.acquire("a") and not slots.acquire("a")
    assert slots.acquire("b") and not slots.acquire("c")
    slots.release("a")
    assert slots.acquire("c") and slots.refused == 2
    with pytest.raises(ValueError, match="per_peer=3, total=2"):
        StreamSlots(per_peer=3, total=2)


def test_serve_budget_grants_one_state_per_period_per_peer_and_refills():
    now = [0.0]
    budget = ServeBudget(
        per_peer_states=1.0, total_states=2.0, period_s=60.0, min_state_bytes=100, clock=lambda: now[0]
    )
    assert budget.take("a", 1000, 1000)  # one full state
    assert not budget.take("a", 10, 1000)  # nothing left for this peer
    assert budget.take("b", 1000, 1000) and not budget.take("c", 10, 1000)  # nor for anyone: total spent
    now[0] = 30.0  # half a state refilled for each peer, one for everyone
    assert budget.take("a", 500, 1000) and not budget.take("a", 100, 1000)
    now[0] = 60.0
    assert not budget.take("a", 60, 10)  # a 10-byte state costs as if it had min_state_bytes: 0.6 > 0.5
    assert budget.take("a", 50, 10)
