"""peer/shards/serve.py: a peer serving its shard files to another over a real stream (TCP on
127.0.0.1 here; libp2p streams give the same asyncio reader/writer pair), resumed, bounded and refused:
only the run's listed files by their hash, a few streams per asking peer, silent streams closed, and
each holder's bytes kept apart by the asker so that a lying holder costs one attempt."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest

from peer.net.limits import StreamSlots
from peer.shards import serve
from peer.shards.fetch import Fetcher, LocalSource, ShardUnavailable
from peer.shards.index import Shard, ShardIndex, index_directory
from peer.shards.serve import (
    PeerSource,
    encode_request,
    fetch_shard,
    listing,
    parse_request,
    serve_shard,
    serve_stream,
    serving_slots,
)
from peer.shards.store import ShardStore
from protocol.errors import BadPayload
from protocol.wire import framing
from tests.shard_fixtures import write_shards


class Holder:
    """TCP servers on 127.0.0.1, one per named peer, on one loop thread, each answering every
    connection with :func:`serve_shard` (within ``slots`` when given: :func:`serve_stream` with the
    peer's name as the asker's id) from ``store``, ``local_dir`` and the run's ``listed`` files."""

    def __init__(
        self,
        store: ShardStore | None,
        local_dir: Path | None,
        listed: Mapping[str, str] | None,
        *,
        names: tuple[str, ...] = ("holder",),
        slots: StreamSlots | None = None,
    ):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}
        for name in names:

            async def handle(r, w, name=name):
                if slots is None:
                    await serve_shard(r, w, store, local_dir, listed=listed, timeout=5.0)
                else:
                    await serve_stream(slots, name, r, w, store, local_dir, listed=listed, timeout=5.0)

            self.add(name, handle)
        self.port = next(iter(self.ports.values()))

    def add(self, name: str, handle) -> None:
        """Listen as peer ``name`` with ``await handle(reader, writer)`` for each connection."""

        async def start():
            return await asyncio.start_server(handle, "127.0.0.1", 0)

        server = self.run(start(), 10)
        self.servers.append(server)
        self.ports[name] = server.sockets[0].getsockname()[1]

    def run(self, coro, timeout):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def open(self, peer: str):
        return await asyncio.open_connection("127.0.0.1", self.ports.get(peer, self.port))

    def close(self) -> None:
        async def stop():  # on the loop's own thread: asyncio's Server is not thread-safe
            for server in self.servers:
                server.close()
                await server.wait_closed()
            # what a handler left cancelled but not yet run (a watcher task it stopped on its way
            # out) ends here, not destroyed pending when the loop stops
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(stop(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def listed(index: ShardIndex) -> dict[str, str]:
    return listing(index, index.sha256)


def test_a_peer_streams_a_shard_from_another_peer_and_a_missing_one_is_said(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 4, 400)
    index = index_directory(corpus)
    holder_store = ShardStore(tmp_path / "holder", 1 << 30)
    held = index.shards[0]
    holder_store.get(held, Fetcher([LocalSource(corpus)]))  # the holder has shard 0 in its store only
    holder = Holder(holder_store, None, listed(index))
    try:
        source = PeerSource(holder.run, holder.open, lambda: ["12D3KooWholder"])
        source.sha256_of = {s.name: s.sha256 for s in index.shards}
        fetcher = Fetcher([source])
        assert fetcher.fetch(held, tmp_path / "got.parquet") == "the peers"
        assert hashlib.sha256((tmp_path / "got.parquet").read_bytes()).hexdigest() == held.sha256
        # a resumed transfer: half the file is already here
        part = tmp_path / "half.parquet"
        part.write_bytes((corpus / held.name).read_bytes()[: held.size // 2])
        assert (
            holder.run(_ask(holder, held.sha256, held.name, part, held.size), 10)
            and part.read_bytes() == (corpus / held.name).read_bytes()
        )
        with pytest.raises(ShardUnavailable, match="not held"):
            fetcher.fetch(index.shards[1], tmp_path / "other.parquet")
    finally:
        holder.close()


async def _ask(holder: Holder, sha256: str, name: str, part: Path, size: int) -> bool:
    reader, writer = await holder.open("x")
    return await fetch_shard(reader, writer, sha256=sha256, name=name, part=part, max_size=size)


def test_a_holder_with_the_corpus_directory_serves_a_listed_file_and_a_lying_size_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 3, 50)
    index = index_directory(corpus)
    holder = Holder(ShardStore(tmp_path / "holder", 1 << 30), corpus, listed(index))
    try:
        shard = index.shards[2]
        assert holder.run(_ask(holder, shard.sha256, shard.name, tmp_path / "a.part", shard.size), 10)
        assert (tmp_path / "a.part").read_bytes() == (corpus / shard.name).read_bytes()
        with pytest.raises(OSError, match="allows"):  # the list bounds what a holder may send
            holder.run(_ask(holder, shard.sha256, shard.name, tmp_path / "b.part", shard.size - 1), 10)
    finally:
        holder.close()


def test_requests_are_parsed_strictly() -> None:
    sha = "ab" * 32
    assert parse_request(encode_request(sha, 7, "a/b.parquet")) == (sha, 7, "a/b.parquet")
    assert parse_request(encode_request(sha, 0, "shards.json"))[2] == "shards.json"
    bad_names = ("../etc/passwd.parquet", "x.txt", "secrets.json", "/abs.parquet")
    for bad in (*(encode_request(sha, 0, n) for n in bad_names), b"\x20", b""):
        with pytest.raises(BadPayload):
            parse_request(bad)


def _liar(offsets: list[int], size: int, wrong: int):
    """A holder's handler that answers any REQUEST with ``size`` as the file's size, then ``wrong``
    bytes that are not the file's, and hangs up; it notes each REQUEST's offset."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, offset, _ = parse_request(await framing.read_frame(reader, max_bytes=2048, timeout=5.0))
        offsets.append(offset)
        writer.write(framing.frame(struct.pack(">BQ", serve.SIZE, size)))
        writer.write(framing.frame(bytes([serve.DATA]) + b"\xff" * wrong))
        await writer.drain()
        writer.close()

    return handle


def test_a_lying_holder_costs_one_attempt_and_the_honest_one_starts_from_its_own_bytes(tmp_path: Path, caplog) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 3, 200)
    index = index_directory(corpus)
    shard = index.shards[1]
    store = ShardStore(tmp_path / "holder", 1 << 30)
    holder = Holder(store, corpus, listed(index), names=("12D3KooWhonest",))
    cutter, whole = [], []
    holder.add("12D3KooWcutter", _liar(cutter, shard.size, 16))  # 16 wrong bytes, then hangs up
    holder.add("12D3KooWwhole", _liar(whole, shard.size, shard.size))  # a whole file of wrong bytes
    try:
        source = PeerSource(holder.run, holder.open, lambda: ["12D3KooWcutter", "12D3KooWwhole", "12D3KooWhonest"])
        source.learn(index, index.sha256)
        dest = tmp_path / "got" / "s.parquet"
        dest.parent.mkdir()
        with caplog.at_level(logging.WARNING, logger="peer.shards.serve"):
            assert Fetcher([source]).fetch(shard, dest) == "the peers"
        assert dest.read_bytes() == (corpus / shard.name).read_bytes()
        assert cutter == [0, 16]  # asked once, resumed once from its own 16 bytes, then left
        assert whole == [0]  # its file hashed otherwise: refused, never resumed
        assert "refused part-00001.parquet from peer 12D3KooWwhole" in caplog.text
        assert sorted(p.name for p in dest.parent.iterdir()) == ["s.parquet"]  # no partial file left
        # without the honest holder: every liar named, nothing left behind
        liars = PeerSource(holder.run, holder.open, lambda: ["12D3KooWcutter", "12D3KooWwhole"])
        liars.learn(index, index.sha256)
        with pytest.raises(ShardUnavailable, match="wrong bytes") as info:
            Fetcher([liars]).fetch(shard, tmp_path / "got" / "t.parquet")
        assert "12D3KooWcutt" in str(info.value)
        assert sorted(p.name for p in dest.parent.iterdir()) == ["s.parquet"]
    finally:
        holder.close()


def test_another_holders_or_sources_partial_is_never_resumed_and_is_removed_once_fetched(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 2, 200)
    index = index_directory(corpus)
    shard = index.shards[0]
    holder = Holder(ShardStore(tmp_path / "holder", 1 << 30), corpus, listed(index), names=("12D3KooWhonest",))
    try:
        dest = tmp_path / "got" / "s.parquet"
        dest.parent.mkdir()
        part = dest.with_name("s.parquet.part")
        serve.holder_part(part, "12D3KooWgone").write_bytes(b"\xff" * 16)  # a liar's, from a run killed mid-way
        part.write_bytes(b"\xff" * 16)  # another source's prefix (HTTP's, resumed with a Range): not the peers'
        source = PeerSource(holder.run, holder.open, lambda: ["12D3KooWhonest"])
        source.learn(index, index.sha256)
        assert Fetcher([source]).fetch(shard, dest) == "the peers"
        assert dest.read_bytes() == (corpus / shard.name).read_bytes()
        assert sorted(p.name for p in dest.parent.iterdir()) == ["s.parquet"]
    finally:
        holder.close()


async def _ask_open(holder: Holder, peer: str, sha256: str, name: str, part: Path, size: int) -> bool:
    reader, writer = await holder.open(peer)
    return await fetch_shard(reader, writer, sha256=sha256, name=name, part=part, max_size=size)


def test_only_the_runs_listed_files_are_served_each_by_its_hash(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 3, 50)
    index = index_directory(corpus)
    (corpus / "private.jsonl").write_text('{"text": "not the run\'s"}\n')  # under --data, not in the list
    private = hashlib.sha256((corpus / "private.jsonl").read_bytes()).hexdigest()
    store = ShardStore(tmp_path / "holder", 1 << 30)
    other = store.root / f"{'0' * 64}.jsonl"  # another run's shard in the same store
    other.write_text('{"text": "another run"}\n')
    (store.root / f"index-{index.sha256}.json").write_bytes(index.encode())
    holder = Holder(store, corpus, listed(index))
    first, last = index.shards[0], index.shards[2]

    def ask(sha256: str, name: str, size: int = 1 << 20) -> bool:
        part = tmp_path / "asked.part"
        part.unlink(missing_ok=True)
        return holder.run(_ask_open(holder, "holder", sha256, name, part, size), 10)

    try:
        assert ask(first.sha256, first.name)  # listed, by its hash: served
        assert ask(index.sha256, "shards.json")  # the run's list, by its hash
        assert not ask(private, "private.jsonl")  # under --data, with its true hash, but not listed
        assert not ask("0" * 64, "private.jsonl")
        assert not ask(first.sha256, last.name)  # a listed name with another listed file's hash
        assert not ask("ab" * 32, first.name)  # a listed name with a hash the list does not give it
        assert not ask("0" * 64, "part-00000.jsonl")  # a held file of another run, by its hash
        assert not ask("ab" * 32, "shards.json")
        (corpus / last.name).write_bytes(b"changed on disk")  # a listed name whose file no longer matches
        assert not ask(last.sha256, last.name)
    finally:
        holder.close()


def test_a_third_stream_from_one_peer_is_refused_while_another_peer_is_served(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 2, 50)
    index = index_directory(corpus)
    slots = serving_slots()
    assert (slots.per_peer, slots.total) == (serve.MAX_STREAMS_PER_PEER, serve.MAX_SERVED_STREAMS) == (2, 4)
    holder = Holder(ShardStore(tmp_path / "holder", 1 << 30), corpus, listed(index), names=("a", "b"), slots=slots)
    shard = index.shards[0]

    async def scenario() -> tuple[str, bool]:
        silent = [await holder.open("a") for _ in range(2)]  # two streams of peer a, no REQUEST yet
        while slots.open < 2:  # until the holder took both
            await asyncio.sleep(0.01)
        try:
            await _ask_open(holder, "a", shard.sha256, shard.name, tmp_path / "a.part", shard.size)
            refused = ""
        except OSError as exc:  # closed unanswered
            refused = str(exc)
        served = await _ask_open(holder, "b", shard.sha256, shard.name, tmp_path / "b.part", shard.size)
        for _, w in silent:
            w.close()
        return refused, served

    try:
        refused, served = holder.run(scenario(), 20)
        assert refused  # closed unanswered: reset, or the first frame cut short
        assert not (tmp_path / "a.part").exists()
        assert served and (tmp_path / "b.part").read_bytes() == (corpus / shard.name).read_bytes()
        assert slots.refused == 1
    finally:
        holder.close()


def test_a_silent_stream_is_closed_after_the_idle_timeout_and_gives_its_slot_back(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(serve, "IDLE_TIMEOUT_S", 0.05)
    slots = serving_slots()
    holder = Holder(None, None, None, names=("a",), slots=slots)

    async def silent() -> bytes:
        reader, writer = await holder.open("a")
        try:
            got = await reader.read()  # returns once the holder closed the stream
            while slots.open:  # the holder gives the slot back right after closing
                await asyncio.sleep(0.01)
            return got
        finally:
            writer.close()

    try:
        assert holder.run(silent(), 20) == b""
    finally:
        holder.close()


def test_an_asker_that_stops_reading_loses_its_stream(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(serve, "IDLE_TIMEOUT_S", 0.1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    big = corpus / "big.jsonl"
    big.write_bytes(bytes(range(256)) * (128 << 10))  # 32 MiB: more than the loopback's socket buffers
    shard = Shard("big.jsonl", big.stat().st_size, hashlib.sha256(big.read_bytes()).hexdigest())
    index = ShardIndex((shard,))
    holder = Holder(None, None, None)
    sent: list[int] = []

    async def handle(r, w):  # no overall limit per frame: only the stall ends this stream
        store = ShardStore(tmp_path / "holder", 1 << 30)
        sent.append(await serve_shard(r, w, store, corpus, listed=listed(index), timeout=600.0))

    holder.add("slow", handle)

    async def stalled() -> None:
        reader, writer = await holder.open("slow")
        writer.write(framing.frame(encode_request(shard.sha256, 0, shard.name)))
        await writer.drain()
        while not sent:  # reads nothing until the holder gave up
            await asyncio.sleep(0.02)
        writer.close()

    try:
        holder.run(stalled(), 60)
        assert 0 < sent[0] < shard.size
    finally:
        holder.close()
