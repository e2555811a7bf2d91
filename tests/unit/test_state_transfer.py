"""peer.state.serve and peer.state.download over real unix sockets: multi-donor download, per-chunk
verification, donor faults; and the check of a downloaded state before it touches φ."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile

import pytest
import torch

from peer.state.download import download_state, validate_state
from peer.state.serve import serve_state
from peer.state.snapshot import StateSnapshot, chunk_bytes, chunk_hash, make_snapshot, state_digest
from protocol.errors import BadPayload, StateDownloadFailed
from protocol.version import PROTOCOL_VERSION
from protocol.wire import framing
from protocol.wire.pieces import piece_view
from protocol.wire.state import (
    MAX_REQUEST_BYTES,
    REQUEST_HEADER,
    encode_chunk,
    encode_meta,
    encode_request,
    parse_request,
)
from tests.unit.state_samples import CHUNK, META, RUN, SHAPES, sample_snapshot as _snapshot

TIMEOUT = 2.0


def _tampered(snapshot: StateSnapshot, chunk_index: int, how) -> StateSnapshot:
    """The same hashes and digest, but one value of one chunk changed by ``how`` (in place)."""
    tensors = [t.clone() for t in snapshot.tensors]
    chunk = snapshot.chunks[chunk_index]
    how(piece_view(tensors[chunk.tensor], chunk).reshape(-1)[:1])
    return dataclasses.replace(snapshot, tensors=tuple(tensors))


def _flip_lowest_bit(x: torch.Tensor) -> None:
    x.view(torch.int32).bitwise_xor_(1)


# ---- donors ---------------------------------------------------------------------------------
def honest(snapshot: StateSnapshot, served: list | None = None, *, timeout: float = TIMEOUT):
    async def lookup(digest):
        return snapshot if snapshot is not None and digest == snapshot.digest else None

    async def handle(reader, writer):
        written = await serve_state(reader, writer, lookup, timeout=timeout)
        if served is not None:
            served.append(written)

    return handle


def serves_regardless(snapshot: StateSnapshot):
    """Answers every digest with ``snapshot`` (a donor whose state moved on but who lies about it)."""

    async def lookup(digest):
        return snapshot

    async def handle(reader, writer):
        await serve_state(reader, writer, lookup, timeout=TIMEOUT)

    return handle


def dies_after_one_chunk(snapshot: StateSnapshot):
    async def handle(reader, writer):
        try:
            _, indices = parse_request(await framing.read_frame(reader, max_bytes=MAX_REQUEST_BYTES, timeout=TIMEOUT))
            writer.write(framing.frame(encode_meta(snapshot.meta, snapshot.chunk_hashes)))
            chunk = snapshot.chunks[indices[0]]
            writer.write(framing.frame(encode_chunk(indices[0], chunk_bytes(snapshot.tensors[chunk.tensor], chunk))))
            await writer.drain()
        finally:
            writer.close()

    return handle


async def hangs(reader, writer):
    """Accepts, reads the request, never answers; lets go when the joiner closes."""
    await reader.read()
    writer.close()


@contextlib.asynccontextmanager
async def swarm(handlers: dict):
    """One unix-socket server per donor name; yields ``open_stream(name)``. Names without a
    handler have no server (connecting fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: f"{tmp}/{name}.sock" for name in handlers}
        servers = []
        try:
            for name, handler in handlers.items():
                if handler is not None:
                    servers.append(await asyncio.start_unix_server(handler, path=paths[name]))

            async def open_stream(name):
                return await asyncio.open_unix_connection(paths[name])

            yield open_stream
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()


async def _download(handlers: dict, snapshot: StateSnapshot, *, timeout=TIMEOUT, digest=None, run_id=RUN):
    async with swarm(handlers) as open_stream:
        result = await download_state(
            list(handlers),
            open_stream,
            digest=digest or snapshot.digest,
            shapes=SHAPES,
            run_id=run_id,
            timeout=timeout,
            chunk_elements=CHUNK,
        )
        await asyncio.sleep(0.05)  # let the donors' handlers see the joiner close
        return result


def _assert_exact(result, snapshot: StateSnapshot) -> None:
    assert result.meta == snapshot.meta
    assert len(result.tensors) == len(SHAPES)
    for got, want in zip(result.tensors, snapshot.tensors):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want)
    assert sum(result.chunks_by_donor.values()) == len(snapshot.chunks)


# ---- downloads ------------------------------------------------------------------------------
def test_three_donors_share_the_load_bit_exact():
    snapshot = _snapshot()
    served: list[int] = []
    names = ["d0", "d1", "d2"]
    result = asyncio.run(_download({n: honest(snapshot, served) for n in names}, snapshot))
    _assert_exact(result, snapshot)
    assert result.chunk_hashes == snapshot.chunk_hashes  # what the digest binds, for the joiner's own snapshot
    assert result.failed == {}
    assert set(result.chunks_by_donor) == set(names) and all(c > 0 for c in result.chunks_by_donor.values())
    assert max(result.chunks_by_donor.values()) - min(result.chunks_by_donor.values()) <= 1
    assert all(b > 0 for b in result.bytes_by_donor.values())
    # every byte a donor wrote was read: the counts agree on both ends
    assert sorted(served) == sorted(result.bytes_by_donor.values())
    meta_frame = len(framing.frame(encode_meta(snapshot.meta, snapshot.chunk_hashes)))
    chunk_frames = sum(
        framing.LENGTH.size + 5 + 4 * t[c.start : c.stop].numel() if t.dim() else 13
        for c in snapshot.chunks
        for t in [snapshot.tensors[c.tensor]]
    )
    assert sum(served) == 3 * meta_frame + chunk_frames


def test_donor_dying_mid_download_is_replaced_and_its_verified_chunk_kept():
    snapshot = _snapshot()
    result = asyncio.run(
        _download({"d0": honest(snapshot), "dying": dies_after_one_chunk(snapshot), "d2": honest(snapshot)}, snapshot)
    )
    _assert_exact(result, snapshot)
    assert set(result.failed) == {"dying"} and "stream closed" in result.failed["dying"]
    assert result.chunks_by_donor["dying"] == 1


def test_hanging_donor_is_dropped_after_the_timeout():
    snapshot = _snapshot()
    result = asyncio.run(
        _download({"d0": honest(snapshot), "stuck": hangs, "d2": honest(snapshot)}, snapshot, timeout=0.4)
    )
    _assert_exact(result, snapshot)
    assert result.failed == {"stuck": "timed out"}  # dropped by its silence timeout, not waited for
    assert result.chunks_by_donor["stuck"] == 0


def test_corrupted_and_nan_donors_are_excluded_and_result_is_exact():
    snapshot = _snapshot()
    # with 4 donors, the donor at position k gets chunks k, k+4, ...: corrupt the second chunk of
    # donor 1 (so it delivers one good chunk first) and the first chunk of donor 2
    flipped = _tampered(snapshot, 1 + 4, _flip_lowest_bit)
    nan = _tampered(snapshot, 2, lambda x: x.fill_(float("nan")))
    result = asyncio.run(
        _download(
            {"d0": honest(snapshot), "flipped": honest(flipped), "nan": honest(nan), "d3": honest(snapshot)}, snapshot
        )
    )
    _assert_exact(result, snapshot)
    assert set(result.failed) == {"flipped", "nan"}
    assert result.failed["flipped"] == "CHUNK 5 does not match its hash"
    assert result.failed["nan"] == "CHUNK 2 does not match its hash"
    assert result.chunks_by_donor["flipped"] == 1 and result.chunks_by_donor["nan"] == 0


def test_state_with_consistent_hashes_but_nan_is_never_returned():
    base = _snapshot()
    tensors = [t.clone() for t in base.tensors]
    tensors[1][3] = float("nan")  # a donor whose own state went bad and still published its digest
    hashes = tuple(chunk_hash(chunk_bytes(tensors[c.tensor], c)) for c in base.chunks)
    bad = StateSnapshot(
        meta=dict(META),
        tensors=tuple(tensors),
        chunks=base.chunks,
        chunk_hashes=hashes,
        digest=state_digest(META, hashes),
    )
    with pytest.raises(StateDownloadFailed, match="NaN or inf") as info:
        asyncio.run(_download({"d0": honest(bad), "d1": honest(bad)}, bad))
    assert set(info.value.failed) == {"d0", "d1"}


def test_missing_and_unreachable_donors_fall_back_to_the_others():
    snapshot = _snapshot()
    result = asyncio.run(_download({"gone": None, "moved_on": honest(None), "d2": honest(snapshot)}, snapshot))
    _assert_exact(result, snapshot)
    assert result.failed["moved_on"].startswith("MISSING")
    assert result.failed["gone"].startswith("could not open a stream")
    assert result.chunks_by_donor == {"gone": 0, "moved_on": 0, "d2": len(snapshot.chunks)}


def test_all_donors_missing_raises_naming_the_digest_and_every_reason():
    snapshot = _snapshot()
    with pytest.raises(StateDownloadFailed) as info:
        asyncio.run(_download({"a": honest(None), "b": honest(None)}, snapshot))
    message = str(info.value)
    assert snapshot.digest.hex() in message and "0 of 26 chunks" in message
    assert "a: MISSING" in message and "b: MISSING" in message


def test_meta_that_does_not_match_the_digest_is_rejected():
    snapshot = _snapshot()
    later = _snapshot(meta={**META, "round": 13})
    result = asyncio.run(_download({"liar": serves_regardless(later), "d1": honest(snapshot)}, snapshot))
    _assert_exact(result, snapshot)
    assert result.failed["liar"].startswith(f"META hashes to digest {later.digest.hex()}, expected")
    assert result.chunks_by_donor["liar"] == 0


def test_state_of_another_run_is_rejected():
    other = _snapshot(meta={**META, "run_id": "other"})
    with pytest.raises(StateDownloadFailed, match="state belongs to run 'other', expected run0"):
        asyncio.run(_download({"d0": honest(other)}, other))


def test_state_without_chunks_still_delivers_its_meta():
    snapshot = make_snapshot(META, [torch.zeros(0, 3)], chunk_elements=CHUNK)

    async def run():
        async with swarm({"d0": honest(snapshot), "d1": honest(snapshot)}) as open_stream:
            return await download_state(
                ["d0", "d1"],
                open_stream,
                digest=snapshot.digest,
                shapes=[[0, 3]],
                run_id=RUN,
                timeout=TIMEOUT,
                chunk_elements=CHUNK,
            )

    result = asyncio.run(run())
    assert result.meta == META and result.tensors[0].shape == (0, 3) and result.failed == {}


# ---- donor side: malformed requests ---------------------------------------------------------
@pytest.mark.parametrize(
    "raw, match",
    [
        (framing.frame(REQUEST_HEADER.pack(16, PROTOCOL_VERSION + 1, b"x" * 16, 0)), "protocol version"),
        (framing.frame(encode_request(b"x" * 16, [3, 2])), "strictly ascending"),
        (framing.frame(encode_request(b"x" * 16, [1, 2])[:-4]), "announces 2 chunk indices"),
        (framing.frame(b"\x01hello"), "expected REQUEST"),
        (framing.LENGTH.pack(MAX_REQUEST_BYTES + 1), "at most"),
        (None, "chunk 1000 requested"),  # the snapshot's digest, an index past its 26 chunks
    ],
    ids=["version", "order", "truncated", "kind", "oversized", "index"],
)
def test_donor_rejects_malformed_requests_logs_and_closes(raw, match, caplog):
    snapshot = _snapshot()
    raw = raw if raw is not None else framing.frame(encode_request(snapshot.digest, [0, 1000]))
    served: list[int] = []

    async def run():
        async with swarm({"d0": honest(snapshot, served)}) as open_stream:
            reader, writer = await open_stream("d0")
            writer.write(raw)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), TIMEOUT)
            writer.close()
            for _ in range(50):
                if served:
                    break
                await asyncio.sleep(0.01)
            return answer

    with caplog.at_level(logging.WARNING, logger="peer.state.serve"):
        answer = asyncio.run(run())
    assert answer == b"" and served == [0]
    assert any(match in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_donor_gives_up_on_a_silent_client():
    snapshot = _snapshot()
    served: list[int] = []

    async def run():
        async with swarm({"d0": honest(snapshot, served, timeout=0.2)}) as open_stream:
            reader, writer = await open_stream("d0")
            answer = await asyncio.wait_for(reader.read(), 2.0)
            writer.close()
            return answer

    assert asyncio.run(run()) == b""


# ---- the downloaded state's check ---------------------------------------------------------
PARAM_SHAPES = [torch.Size([2, 2]), torch.Size([3])]
STATE_META = {"run_id": "abc", "round": 4, "inner_step": 80, "version": 1}


def _state_tensors():
    return [torch.zeros(s) for s in PARAM_SHAPES] * 2


def test_valid_state_passes():
    state = validate_state(STATE_META, _state_tensors(), run_id="abc", shapes=PARAM_SHAPES)
    assert state.round == 4 and state.inner_step == 80 and len(state.phi) == 2
    assert state.chunk_hashes is None  # none given: a snapshot of it hashes it


def test_a_valid_state_holds_private_copies_and_the_hashes_it_was_verified_with():
    tensors, hashes = _state_tensors(), [bytes([i]) * 16 for i in range(4)]
    state = validate_state(STATE_META, tensors, run_id="abc", shapes=PARAM_SHAPES, chunk_hashes=hashes)
    assert state.chunk_hashes == tuple(hashes)
    held = [*state.phi, *state.outer_state]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(held, tensors, strict=True))


@pytest.mark.parametrize(
    "meta, tensors, match",
    [
        ({**STATE_META, "run_id": "other"}, None, "run 'other'"),
        ({**STATE_META, "round": -1}, None, "round"),
        ({**STATE_META, "round": "7"}, None, "round"),
        ("not a map", None, "map"),
        (STATE_META, [torch.zeros(2, 2)], "tensors"),
        (STATE_META, [torch.zeros(2, 3), torch.zeros(3)] * 2, "tensor 0"),
        (STATE_META, [torch.zeros(2, 2, dtype=torch.float64), torch.zeros(3)] * 2, "float32"),
        (STATE_META, [torch.full((2, 2), float("nan")), torch.zeros(3)] * 2, "NaN"),
    ],
)
def test_bad_state_is_rejected_with_reason(meta, tensors, match):
    with pytest.raises(BadPayload, match=match):
        validate_state(meta, tensors if tensors is not None else _state_tensors(), run_id="abc", shapes=PARAM_SHAPES)
