"""What lab/fuzz.py fuzzes: every decoder and handler of what another peer sends, with valid seeds.

:func:`decoders` and :func:`handlers` return :class:`lab.fuzz.Target` objects; each documents the
exceptions its target may raise (anything else is a crash). Values from the DHT arrive as bytes
and are decoded as peer/net/dht.py decodes them (hivemind's msgpack serializer, an undecodable
value read as None) before the record's own check.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgpack
import torch

from lab.fuzz import Target

RUN = "fuzzrun"


def _msgpack_after(offset: int):
    return lambda seed: (seed[:offset], seed[offset:], b"")


def _dht_value(data: bytes) -> Any:
    """Bytes from the DHT as peer/net/dht.py reads them: an undecodable value is None."""
    from hivemind.utils.serializer import MSGPackSerializer

    from peer.net.dht_node import _TolerantSerializer

    return _TolerantSerializer(MSGPackSerializer).loads(data)


class _Writer:
    """Counts what a handler writes; never blocks."""

    def __init__(self):
        self.written, self.closed = 0, False

    def write(self, data) -> None:
        self.written += len(data)

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


_LOOPS: list[asyncio.AbstractEventLoop] = []


class _Loop:
    """One event loop per set of targets, reused for every message; :func:`close_loops` closes it
    (it reopens when used again)."""

    def __init__(self):
        self.loop = None

    def run(self, make):
        """``await make()`` on this loop; ``make`` builds its streams there (a StreamReader made
        outside a running loop needs a current loop, which another test may have cleared)."""
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            _LOOPS.append(self.loop)

        async def main():
            return await make()

        return self.loop.run_until_complete(main())


def close_loops() -> None:
    """Close the event loops the targets made (cancelling what is left on them)."""
    while _LOOPS:
        loop = _LOOPS.pop()
        if loop.is_closed():
            continue
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


# ---------------------------------------------------------------- decoders


def decoders() -> list[Target]:
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import averaging_pb2

    from peer.net import reachability
    from peer.net.addresses import valid_addresses
    from peer.sync.hivemind_limits import StreamLimits, read_protobuf
    from protocol import codecs
    from protocol.errors import BadPayload, ManifestError, VersionMismatch
    from protocol.manifest import CompressionSpec, open_announcement, sign_manifest
    from protocol.presets import PRESETS
    from protocol.records import ProgressRecord
    from protocol.signing import OwnerKey, PeerSigner, open_record
    from protocol.wire import allreduce as ar, framing, state as st

    loop = _Loop()
    targets = []

    # -- the framing every stream protocol shares
    frames = [framing.frame(b"\x01" + bytes(30)), framing.frame(bytes([ar.PIECE]) + bytes(100)), b""]

    def read_frame(data: bytes):
        return loop.run(lambda: framing.read_frame(_reader(data), max_bytes=4096, timeout=1.0))

    targets.append(
        Target(
            "wire frame (framing.read_frame)",
            frames[:2],
            read_frame,
            (BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError),
        )
    )

    # -- the all-reduce's frames
    hello = ar.encode_hello(group_id=b"g" * 8, sender=1, weight=1024.0, pieces=3)
    targets.append(
        Target(
            "all-reduce HELLO",
            [hello],
            lambda d: ar.parse_hello(d, group_size=4),
            (BadPayload,),
            msgpack_body=_msgpack_after(1),
        )
    )
    piece = ar.encode_piece(2, bytes(64))
    mean = ar.encode_mean(2, [True, False, True, True], bytes(64))
    abort = ar.encode_abort("a groupmate left")

    def allreduce_frames(d: bytes):
        ar.parse_piece(d, expected_index=2)

    targets.append(Target("all-reduce PIECE", [piece, mean, abort], allreduce_frames, (BadPayload,)))
    targets.append(
        Target(
            "all-reduce MEAN / ABORT",
            [mean, abort, piece],
            lambda d: ar.parse_mean(d, expected_index=2, group_size=4),
            (BadPayload,),
        )
    )

    # -- the state transfer's frames
    digest = bytes(range(16))
    request = st.encode_request(digest, [0, 1, 5, 9])
    meta = st.encode_meta({"run_id": RUN, "round": 3, "inner_step": 30}, [bytes(16)] * 4)
    chunk = st.encode_chunk(1, bytes(4 * 12))
    targets.append(Target("state REQUEST", [request], st.parse_request, (BadPayload,)))
    targets.append(
        Target(
            "state META",
            [meta, st.encode_missing()],
            lambda d: st.parse_meta(d, chunks=4),
            (BadPayload,),
            msgpack_body=lambda s: (s[:5], s[5:-64], s[-64:]),
        )
    )
    targets.append(
        Target("state CHUNK", [chunk], lambda d: st.parse_chunk(d, expected_index=1, shape=(3, 4)), (BadPayload,))
    )

    # -- the pipeline stages' frames (a micro-batch through the next stage)
    from protocol.wire import pipeline as pl

    stage_limits = pl.StageLimits(max_batch_sequences=4, max_seq_len_tokens=8, hidden_size=6, vocab_size=50, stages=3)
    gen = torch.Generator().manual_seed(0)
    stage_request = pl.StageRequest(
        request_id=7,
        micro_batch=3,
        stage=1,
        activations=torch.randn(2, 4, 6, generator=gen).to(torch.bfloat16),
        targets=torch.randint(0, 50, (2, 4), generator=gen, dtype=torch.int32),
    )
    reply = pl.encode_reply(
        pl.StageReply(request_id=7, grad=torch.randn(2, 4, 6, generator=gen).to(torch.bfloat16), loss=3.5, tokens=8)
    )
    targets.append(
        Target(
            "pipeline STAGE_REQUEST",
            [pl.encode_request(stage_request)],
            lambda d: pl.parse_request(d, stage_limits, stage=1),
            (BadPayload,),
        )
    )
    targets.append(
        Target(
            "pipeline STAGE_REPLY / STAGE_ERROR",
            [reply, pl.encode_error(7, "no replica")],
            lambda d: pl.parse_answer(d, stage_limits, request=stage_request),
            (BadPayload,),
        )
    )

    # -- codecs: every format, decoded as a receiver does (it knows the shape)
    shape = (8, 16)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    encodings = []
    for name in ("none", "fp16", "bf16", "int8", "int4", "fp4", "topk", "lowrank"):
        codec = codecs.make_codec(CompressionSpec(codec=name), torch.Size(shape))
        encodings.append(codec.encode(x, seed=1))
    targets.append(
        Target("codec decode (every format)", encodings, lambda d: codecs.decode(d, shape, seed=1), (BadPayload,))
    )

    # -- DHT records: signed envelopes, progress records, addresses, run announcements
    signer = PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    record = ProgressRecord(
        round=3,
        inner_step=30,
        train_loss=3.0,
        tokens_per_s=100.0,
        group_size=2,
        bytes_sent=10,
        state_digest="a" * 32,
        groupmates=(signer.peer_id,),
    )
    key, expiration = f"{RUN}.progress", 1.9e9
    sealed = msgpack.packb(signer.seal(key, expiration, record.to_wire()), use_bin_type=True)

    def signed_record(d: bytes):
        return open_record(key, signer.peer_id, expiration, _dht_value(d))

    targets.append(
        Target("signed envelope (open_record)", [sealed], signed_record, (BadPayload,), msgpack_body=_msgpack_after(0))
    )
    plain = msgpack.packb(record.to_wire(), use_bin_type=True)
    targets.append(
        Target(
            "progress record (ProgressRecord.from_wire)",
            [plain],
            lambda d: ProgressRecord.from_wire(_dht_value(d)),
            (BadPayload,),
            msgpack_body=_msgpack_after(0),
        )
    )
    addresses = msgpack.packb(
        [f"/ip4/127.0.0.1/tcp/4100/p2p/{signer.peer_id}", f"/ip6/::1/tcp/4100/p2p/{signer.peer_id}"], use_bin_type=True
    )
    targets.append(
        Target(
            "address record (valid_addresses)",
            [addresses],
            lambda d: valid_addresses(signer.peer_id, _dht_value(d)),
            (),
            msgpack_body=_msgpack_after(0),
        )
    )
    owner = OwnerKey.generate()
    announcement = msgpack.packb(sign_manifest(PRESETS["tiny"](), owner).to_wire(), use_bin_type=True)
    targets.append(
        Target(
            "run announcement (open_announcement)",
            [announcement],
            lambda d: open_announcement(_dht_value(d)),
            (BadPayload, ManifestError, VersionMismatch),
            msgpack_body=_msgpack_after(0),
        )
    )

    # -- the reachability dial-back's request and answer
    targets.append(
        Target(
            "dial-back request",
            [reachability.encode_request([4100, 4101])],
            reachability.parse_request,
            (BadPayload,),
            msgpack_body=_msgpack_after(0),
        )
    )
    answer = msgpack.packb({"observed": "10.0.0.7", "reachable": [4100]})
    targets.append(
        Target(
            "dial-back answer",
            [answer],
            lambda d: reachability.parse_answer(d, "checker"),
            (BadPayload,),
            msgpack_body=_msgpack_after(0),
        )
    )

    # -- hivemind's protobuf framing as bounded here (JoinRequest and a leader's answer)
    join = averaging_pb2.JoinRequest(
        schema_hash=b"s" * 20, expiration=1.9e9, gather=b"g" * 100, group_key=f"{RUN}.0b0101"
    ).SerializeToString()
    begin = averaging_pb2.MessageFromLeader(
        code=averaging_pb2.BEGIN_ALLREDUCE,
        group_id=b"g" * 8,
        ordered_peer_ids=[b"p" * 34] * 3,
        gathered=[b"x" * 50] * 3,
    ).SerializeToString()

    def hivemind_framed(message: bytes) -> bytes:
        return b"\x00" + len(message).to_bytes(8, "big") + message

    limits = StreamLimits()

    def read_join(d: bytes):
        return loop.run(
            lambda: read_protobuf(
                _reader(d), averaging_pb2.JoinRequest, max_bytes=limits.max_request_bytes, timeout=1.0
            )
        )

    def read_leader(d: bytes):
        return loop.run(
            lambda: read_protobuf(
                _reader(d), averaging_pb2.MessageFromLeader, max_bytes=limits.max_response_bytes, timeout=1.0
            )
        )

    protobuf_errors = (BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError)
    targets.append(Target("hivemind JoinRequest (read_protobuf)", [hivemind_framed(join)], read_join, protobuf_errors))
    targets.append(
        Target("hivemind MessageFromLeader (read_protobuf)", [hivemind_framed(begin)], read_leader, protobuf_errors)
    )
    return targets


# ---------------------------------------------------------------- handlers


def handlers() -> list[Target]:
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import averaging_pb2

    from peer.net import reachability
    from peer.net.limits import ServeBudget
    from peer.state.download import download_state
    from peer.state.serve import serve_state
    from peer.state.snapshot import chunk_bytes, make_snapshot
    from peer.sync.allreduce import GroupAllreduce
    from peer.sync.hivemind_limits import BoundedP2P, StreamLimits
    from peer.sync.pieces import GroupPlan
    from protocol import codecs
    from protocol.errors import AllreduceIncomplete, StateDownloadFailed
    from protocol.manifest import CompressionSpec
    from protocol.signing import PeerSigner
    from protocol.wire import allreduce as ar, framing, state as st
    from protocol.wire.pieces import piece_shape, piece_view, plan_pieces

    loop = _Loop()
    targets = []

    # -- the state donor: a joiner's REQUEST (and whatever follows) on one stream
    shapes = [torch.Size([40, 16]), torch.Size([16]), torch.Size([])]
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    snapshot = make_snapshot({"run_id": RUN, "round": 3, "inner_step": 30}, tensors, chunk_elements=64)
    budget = ServeBudget(per_peer_states=1e12, total_states=1e12, period_s=60.0, min_state_bytes=1)

    async def snapshot_for(digest: bytes):
        return snapshot if digest == snapshot.digest else None

    def serve(d: bytes):
        return loop.run(
            lambda: serve_state(
                _reader(d), _Writer(), snapshot_for, timeout=0.5, admit=lambda a, b: budget.take("fuzzer", a, b)
            )
        )

    n_chunks = len(snapshot.chunks)
    requests = [
        framing.frame(st.encode_request(snapshot.digest, list(range(n_chunks)))),
        framing.frame(st.encode_request(snapshot.digest, [0, 3])),
        framing.frame(st.encode_request(bytes(16), [0])),
    ]
    targets.append(Target("state donor (serve_state)", requests, serve, ()))

    # -- the state downloader: a donor's answer to this joiner's REQUEST
    answer = framing.frame(st.encode_meta(snapshot.meta, snapshot.chunk_hashes)) + b"".join(
        framing.frame(st.encode_chunk(i, chunk_bytes(snapshot.tensors[c.tensor], c)))
        for i, c in enumerate(snapshot.chunks)
    )

    def download(d: bytes):
        async def open_stream(_donor):
            return _reader(d), _Writer()

        return loop.run(
            lambda: download_state(
                ["donor"],
                open_stream,
                digest=snapshot.digest,
                shapes=shapes,
                run_id=RUN,
                timeout=0.5,
                chunk_elements=64,
            )
        )

    targets.append(Target("state downloader (download_state)", [answer], download, (StateDownloadFailed,)))

    # -- the all-reduce stream handler: a groupmate's HELLO and PIECEs into a live session
    group_shapes = [torch.Size([6, 4]), torch.Size([5])]
    pieces = plan_pieces(group_shapes, owners=[0], piece_elements=8)
    piece_shapes = [piece_shape(group_shapes[p.tensor], p) for p in pieces]
    spec = CompressionSpec(codec="int8")
    piece_codecs = [codecs.make_codec(spec, s) for s in piece_shapes]
    contribution = [torch.randn(s, generator=torch.Generator().manual_seed(7)) for s in group_shapes]

    stream = framing.frame(ar.encode_hello(group_id=b"g" * 8, sender=1, weight=100.0, pieces=len(pieces))) + b"".join(
        framing.frame(
            ar.encode_piece(
                p.index, piece_codecs[p.index].encode(piece_view(contribution[p.tensor], p).float(), seed=p.index)
            )
        )
        for p in pieces
    )

    signer = PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def allreduce(d: bytes):
        plan = GroupPlan(
            group_id=b"g" * 8,
            peer_ids=(0, 1),
            my_index=0,
            pieces=pieces,
            codecs=piece_codecs,
            mean_codecs=[c.for_mean(2) for c in piece_codecs],
            max_piece_bytes=[codecs.max_encoded_bytes(s) for s in piece_shapes],
            seeds=[p.index for p in pieces],
        )

        async def exchange():
            session = GroupAllreduce(
                plan,
                [torch.zeros(s) for s in group_shapes],
                weight=100.0,
                compensate=lambda piece, x: x,
                stage=lambda *a: None,
                open_stream=None,
                next_chunk_timeout=0.05,
                max_weight=1000.0,
                signer=signer,
                peer_key=lambda index: signer.peer_id,  # what it seals is never checked against peer 1's key
            )
            reader, writer = _reader(d), _Writer()
            try:
                payload = await framing.read_frame(reader, max_bytes=ar.MAX_HELLO_BYTES, timeout=0.05)
                ar.parse_hello(payload, group_size=ar.MAX_GROUP_SIZE)
            except Exception as exc:  # what LocoAverager._handle_stream refuses before a session sees it
                if isinstance(exc, (ar.BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError)):
                    return
                raise
            outcome = await asyncio.gather(
                session.run(), session.serve(1, payload, reader, writer), return_exceptions=True
            )
            session.close()
            for item in outcome:
                if isinstance(item, BaseException):
                    raise item

        return loop.run(exchange)

    targets.append(Target("all-reduce stream (GroupAllreduce.serve)", [stream], allreduce, (AllreduceIncomplete,)))

    # -- hivemind's rpc_join_group, framed and bounded by BoundedP2P, into a stub matchmaking handler
    p2p = BoundedP2P()  # hivemind's P2P.__init__: no daemon, no client
    p2p.peer_id, p2p._client_listen_maddr = "victim", None
    BoundedP2P.adopt(p2p, StreamLimits(message_timeout_s=0.3, stream_lifetime_s=1.0))
    registered = {}

    async def add_binary_stream_handler(name, handle, balanced=False):
        registered[name] = handle

    p2p.add_binary_stream_handler = add_binary_stream_handler

    async def rpc_join_group(request: averaging_pb2.JoinRequest, context):
        if request.schema_hash != b"s" * 20 or not math.isfinite(request.expiration):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_SCHEMA_HASH)
            return
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_DISBANDED)

    loop.run(
        lambda: p2p.add_protobuf_handler(
            "LocoAverager.rpc_join_group", rpc_join_group, averaging_pb2.JoinRequest, stream_output=True
        )
    )
    handle = registered["LocoAverager.rpc_join_group"]

    class _Info:
        peer_id = "fuzzer"

    join = averaging_pb2.JoinRequest(
        schema_hash=b"s" * 20, expiration=1.9e9, gather=b"g" * 100, group_key=f"{RUN}.0b0101"
    ).SerializeToString()
    join_stream = b"\x00" + len(join).to_bytes(8, "big") + join + b"\x01" + (0).to_bytes(8, "big")

    def join_group(d: bytes):
        return loop.run(lambda: handle(_Info(), _reader(d), _Writer()))

    targets.append(Target("hivemind rpc_join_group (BoundedP2P)", [join_stream], join_group, ()))

    # -- the reachability dial-back server (no dial: the stream's address is relayed)
    class _Relayed:
        peer_id = "fuzzer"
        addr = "/p2p-circuit"

    def dialback(d: bytes):
        return loop.run(lambda: reachability._handle(_Relayed(), _reader(d), _Writer()))

    targets.append(
        Target(
            "dial-back server (reachability._handle)",
            [framing.frame(reachability.encode_request([4100, 4101]))],
            dialback,
            (),
            msgpack_body=_msgpack_after(4),
        )
    )
    return targets
