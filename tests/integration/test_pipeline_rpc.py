"""Stage calls over real libp2p streams (peer/pipeline/rpc.py, issue #19; SWARM arXiv 2301.11913).

Real hivemind P2P daemons on 127.0.0.1, port 0, all driven from this test's event loop: the
caller is the first daemon, every replica dials it at start, so the caller knows their addresses.
Each test shuts every daemon down and checks that no p2pd child is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from peer.pipeline.rpc import StageCallFailed, StageServer, call_with_retry
from protocol.wire import framing, pipeline as frames
from protocol.wire.pipeline import StageLimits, StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LIMITS = StageLimits(max_batch_sequences=4, max_seq_len_tokens=16, hidden_size=32, vocab_size=259, stages=3)
PROTOCOL = "/locoswarm/test-run/stage/1"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _p2pd_children() -> set[int]:
    """PIDs of this process's p2pd children (Linux /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if name == "p2pd" and int(rest[1]) == os.getpid():
                found.add(int(entry.name))
    return found


@contextlib.asynccontextmanager
async def _daemons(n: int):
    """``n`` P2P daemons; the first is the caller, the others dialled it at start."""
    before = _p2pd_children()
    started: list[P2P] = []
    try:
        started.append(await P2P.create(host_maddrs=LOOPBACK))
        maddrs = await started[0].get_visible_maddrs()
        for _ in range(n - 1):
            started.append(await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs))
        assert len(_p2pd_children() - before) == n  # the leftover check below can see them
        yield started
    finally:
        for p2p in started:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
    assert _p2pd_children() - before == set(), "a p2pd daemon outlived its test"


def _request(request_id: int = 1, dtype=torch.bfloat16) -> StageRequest:
    g = torch.Generator().manual_seed(request_id)
    return StageRequest(
        request_id=request_id,
        micro_batch=100 + request_id,
        stage=1,
        activations=torch.randn(2, 8, LIMITS.hidden_size, generator=g).to(dtype),
        targets=torch.randint(0, LIMITS.vocab_size, (2, 8), generator=g, dtype=torch.int32),
    )


async def _double(request: StageRequest):
    """A stage whose loss is Σ activations² (so its gradient is 2 × activations), 1.5 nats/token."""
    return request.activations * 2, 1.5, request.targets.numel()


def _server(p2p: P2P, handle=_double, **kwargs) -> StageServer:
    options = dict(max_streams_per_peer=2, timeout_s=2.0, stage=1)
    options.update(kwargs)
    return StageServer(p2p, PROTOCOL, handle, LIMITS, **options)


async def _call(caller: P2P, peer_id, request: StageRequest, timeout_s: float):
    """One replica's answer to ``request`` (``call_with_retry`` with that replica alone)."""
    reply, _, _ = await call_with_retry(caller, [peer_id], PROTOCOL, request, LIMITS, timeout_s)
    return reply


def test_a_call_returns_the_stage_gradient_bit_for_bit():
    async def main():
        seen: list[StageRequest] = []

        async def handle(request):
            seen.append(request)
            return await _double(request)

        async with _daemons(2) as (caller, replica):
            async with _server(replica, handle) as server:
                for request_id, dtype in ((1, torch.bfloat16), (2, torch.float32)):
                    request = _request(request_id, dtype)
                    reply = await _call(caller, replica.peer_id, request, timeout_s=5.0)
                    expected = request.activations * 2
                    assert reply.grad.dtype == dtype and reply.grad.shape == (2, 8, LIMITS.hidden_size)
                    assert torch.equal(reply.grad.view(torch.uint8), expected.view(torch.uint8))
                    assert (reply.request_id, reply.loss, reply.tokens) == (request_id, 1.5, 16)
                    assert torch.equal(seen[-1].activations.view(torch.uint8), request.activations.view(torch.uint8))
                    assert torch.equal(seen[-1].targets, request.targets) and seen[-1].micro_batch == 100 + request_id
                assert (server.served, server.rejected, server.failed) == (2, 0, 0)

    asyncio.run(main())


def test_a_dead_and_a_silent_replica_each_cost_one_retry_then_the_next_answers():
    async def main():
        cancelled = asyncio.Event()

        async def silent(request):  # never answers within the caller's deadline
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async with _daemons(4) as (caller, dead, hung, good):
            dead_id = dead.peer_id
            await dead.shutdown()
            async with _server(hung, silent) as hung_server, _server(good) as good_server:
                request = _request(7)
                reply, answered, failures = await call_with_retry(
                    caller, [dead_id, hung.peer_id, good.peer_id], PROTOCOL, request, LIMITS, timeout_s=1.0
                )
                assert answered == good.peer_id and reply.request_id == 7
                assert torch.equal(reply.grad.view(torch.uint8), (request.activations * 2).view(torch.uint8))
                assert [peer for peer, _ in failures] == [dead_id, hung.peer_id]
                assert "stream failed" in failures[0][1] and failures[1][1] == "no answer within 1 s"
                # the silent replica saw its caller leave and dropped the work
                await asyncio.wait_for(cancelled.wait(), 5.0)
                assert hung_server.abandoned == 1 and good_server.served == 1

    asyncio.run(main())


def test_when_every_replica_fails_the_error_names_each_with_its_reason():
    async def main():
        async def broken(request):
            raise RuntimeError("out of memory\x1b[2J")

        async with _daemons(3) as (caller, dead, failing):
            dead_id = dead.peer_id
            await dead.shutdown()
            async with _server(failing, broken) as server:
                replicas = [dead_id, failing.peer_id.to_base58()]  # the router holds base58 text
                with pytest.raises(StageCallFailed) as info:
                    await call_with_retry(caller, replicas, PROTOCOL, _request(3), LIMITS, timeout_s=2.0)
                message = str(info.value)
                assert "no replica of stage 1 answered micro-batch 103 (request 3)" in message
                assert str(dead_id) in message and failing.peer_id.to_base58() in message
                assert "STAGE_ERROR: RuntimeError: out of memory" in message and "\x1b" not in message
                assert [peer for peer, _ in info.value.failures] == replicas
                assert server.failed == 1

                with pytest.raises(StageCallFailed, match="no replica to call"):
                    await call_with_retry(caller, [], PROTOCOL, _request(4), LIMITS, timeout_s=1.0)
                with pytest.raises(StageCallFailed) as info:  # attempts caps the replicas tried
                    await call_with_retry(caller, replicas, PROTOCOL, _request(5), LIMITS, timeout_s=1.0, attempts=1)
                assert [peer for peer, _ in info.value.failures] == [dead_id]

    asyncio.run(main())


async def _exchange_raw(caller: P2P, replica: P2P, *frames_out: bytes) -> tuple[list[bytes], bytes]:
    """Write raw frames on one stream, each after the answer to the one before; return the answers'
    payloads and what follows them (b'': the server closed the stream)."""
    _, reader, writer = await caller.call_binary_stream_handler(replica.peer_id, PROTOCOL)
    try:
        answers = []
        for data in frames_out:
            writer.write(data)
            await writer.drain()
            answers.append(await framing.read_frame(reader, max_bytes=1 << 20, timeout=5.0))
        rest = await asyncio.wait_for(reader.read(1), 5.0)
        return answers, rest
    finally:
        writer.close()


def test_a_malformed_request_gets_stage_error_and_the_server_serves_the_next_call():
    async def main():
        async with _daemons(2) as (caller, replica):
            async with _server(replica) as server:
                bad = _request(42)
                bad.targets[1, 3] = LIMITS.vocab_size
                (answer,), rest = await _exchange_raw(caller, replica, framing.frame(frames.encode_request(bad)))
                error = frames.parse_error(answer)
                assert error.request_id == 42
                assert "bad request: STAGE_REQUEST targets hold 259 at (1, 3); allowed [0, 259)" in error.reason
                assert rest == b""  # the stream was closed after the error

                huge = framing.LENGTH.pack(frames.max_request_bytes(LIMITS) + 1)  # declared, never sent
                (answer,), rest = await _exchange_raw(caller, replica, huge)
                error = frames.parse_error(answer)
                assert error.request_id == 0 and "bad request: frame declares" in error.reason
                assert rest == b""

                # two good requests, one after the other, on one stream
                first, second = _request(8), _request(9, torch.float32)
                answers = await _two_on_one_stream(caller, replica, first, second)
                assert [a.request_id for a in answers] == [8, 9]

                reply = await _call(caller, replica.peer_id, _request(10), timeout_s=5.0)
                assert reply.request_id == 10
                assert (server.rejected, server.served, server.refused) == (2, 3, 2)

    asyncio.run(main())


async def _two_on_one_stream(caller: P2P, replica: P2P, *requests: StageRequest):
    _, reader, writer = await caller.call_binary_stream_handler(replica.peer_id, PROTOCOL)
    try:
        answers = []
        for request in requests:
            writer.write(framing.frame(frames.encode_request(request)))
            await writer.drain()
            payload = await framing.read_frame(reader, max_bytes=frames.max_answer_bytes(LIMITS), timeout=5.0)
            answers.append(frames.parse_answer(payload, LIMITS, request=request))
        return answers
    finally:
        writer.close()


def test_streams_over_the_per_peer_cap_are_refused_at_once():
    async def main():
        async with _daemons(2) as (caller, replica):
            async with _server(replica, max_streams_per_peer=1, timeout_s=5.0) as server:
                _, _, holding = await caller.call_binary_stream_handler(replica.peer_id, PROTOCOL)  # silent
                try:
                    await asyncio.sleep(0.2)  # let the server take the first stream's slot
                    with pytest.raises(StageCallFailed, match="STAGE_ERROR: refused: at most 1 streams per peer"):
                        await _call(caller, replica.peer_id, _request(1), timeout_s=3.0)
                    assert server.slots.refused == 1
                finally:
                    holding.close()
                await asyncio.sleep(0.2)  # the slot is free again once the silent stream closed
                reply = await _call(caller, replica.peer_id, _request(2), timeout_s=3.0)
                assert reply.request_id == 2

    asyncio.run(main())
