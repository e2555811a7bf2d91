"""peer/shards/serve.py: a peer serving its shard files to another over a real stream (TCP on
127.0.0.1 here; libp2p streams give the same asyncio reader/writer pair), resumed, bounded and refused."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import pytest

from peer.shards.fetch import Fetcher, LocalSource, ShardUnavailable
from peer.shards.index import index_directory
from peer.shards.serve import PeerSource, encode_request, fetch_shard, parse_request, serve_shard
from peer.shards.store import ShardStore
from protocol.errors import BadPayload
from tests.shard_fixtures import write_shards


class Holder:
    """A TCP server on 127.0.0.1 answering every connection with :func:`serve_shard`, on a loop thread."""

    def __init__(self, store: ShardStore, local_dir: Path | None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            return await asyncio.start_server(
                lambda r, w: serve_shard(r, w, store, local_dir, timeout=5.0), "127.0.0.1", 0
            )

        self.server = self.run(start(), 10)
        self.port = self.server.sockets[0].getsockname()[1]

    def run(self, coro, timeout):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def open(self, _peer: str):
        return await asyncio.open_connection("127.0.0.1", self.port)

    def close(self) -> None:
        async def stop():  # on the loop's own thread: asyncio's Server is not thread-safe
            self.server.close()
            await self.server.wait_closed()

        self.run(stop(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_peer_streams_a_shard_from_another_peer_and_a_missing_one_is_said(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 4, 400)
    index = index_directory(corpus)
    holder_store = ShardStore(tmp_path / "holder", 1 << 30)
    held = index.shards[0]
    holder_store.get(held, Fetcher([LocalSource(corpus)]))  # the holder has shard 0 in its store only
    holder = Holder(holder_store, None)
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


def test_a_holder_with_the_corpus_directory_serves_by_name_and_a_lying_size_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_shards(corpus, 3, 50)
    index = index_directory(corpus)
    holder = Holder(ShardStore(tmp_path / "holder", 1 << 30), corpus)
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
