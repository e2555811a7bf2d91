"""A run's tokenizer from its peers (issue #52 item 3): the REQUEST framing for a tokenizer.json
(peer/shards/serve.py) over a real stream (TCP on 127.0.0.1 here; libp2p streams give the same
asyncio reader/writer pair), a peer sending wrong bytes refused naming both hashes, and the order
of places in peer/train/bpe.py with the peers as a plain callable."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from peer.shards import serve
from peer.shards.serve import TOKENIZER_NAME, PeerSource, encode_request, fetch_shard, parse_request, serve_shard
from peer.train import bpe
from protocol.errors import BadPayload, ConfigError
from protocol.manifest import DataSpec

TEXTS = [f"def round_{i}(delta, peers={i}):\n    return delta / peers  # averaged {i}\n" for i in range(120)]


def trained(texts: list[str] = TEXTS) -> bytes:
    return bpe.train_bpe(iter(texts), 512).to_str().encode("utf-8")


def spec(want: str, source: str = "") -> DataSpec:
    return DataSpec(tokenizer="bpe", vocab_size=512, tokenizer_sha256=want, tokenizer_source=source)


class Holders:
    """TCP servers on 127.0.0.1, one per named peer, each answering with :func:`serve_shard` from its
    ``tokenizers`` lookup (and ``local_dir``), on one loop thread."""

    def __init__(self, peers: dict[str, Callable[[str], Path | None]], local_dir: Path | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers, self.ports = [], {}
        for name, lookup in peers.items():

            async def start(lookup=lookup):
                return await asyncio.start_server(
                    lambda r, w: serve_shard(r, w, None, local_dir, tokenizers=lookup, timeout=5.0), "127.0.0.1", 0
                )

            server = self.run(start(), 10)
            self.servers.append(server)
            self.ports[name] = server.sockets[0].getsockname()[1]

    def run(self, coro, timeout):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def open(self, peer: str):
        return await asyncio.open_connection("127.0.0.1", self.ports[peer])

    def source(self, *peers: str) -> PeerSource:
        return PeerSource(self.run, self.open, lambda: list(peers))

    def close(self) -> None:
        async def stop():
            for server in self.servers:
                server.close()
                await server.wait_closed()

        self.run(stop(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_tokenizer_request_names_its_hash_and_no_other_json_file_is_asked_for() -> None:
    sha = "cd" * 32
    assert parse_request(encode_request(sha, 0, TOKENIZER_NAME)) == (sha, 0, TOKENIZER_NAME)
    for bad in ("a/tokenizer.json", "../tokenizer.json", "tokenizer.json.part", "vocab.json"):
        with pytest.raises(BadPayload):
            parse_request(encode_request(sha, 0, bad))
    assert serve.MAX_TOKENIZER_BYTES == 64 << 20


def test_a_holder_serves_a_tokenizer_by_hash_only_never_a_file_of_its_corpus_by_name(tmp_path: Path) -> None:
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    held = tmp_path / "held.json"
    held.write_bytes(data)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / TOKENIZER_NAME).write_bytes(b"a private file that happens to be named so")
    holders = Holders({"holder": lambda sha: held if sha == want else None}, local_dir=corpus)

    async def ask(sha256: str, name: str, part: Path, max_size: int) -> bool:
        reader, writer = await holders.open("holder")
        return await fetch_shard(reader, writer, sha256=sha256, name=name, part=part, max_size=max_size)

    try:
        assert holders.run(ask(want, TOKENIZER_NAME, tmp_path / "a.part", 1 << 20), 10)
        assert (tmp_path / "a.part").read_bytes() == data
        assert not holders.run(ask("0" * 64, TOKENIZER_NAME, tmp_path / "b.part", 1 << 20), 10)  # MISSING
        assert not holders.run(ask("0" * 64, "part-00000.parquet", tmp_path / "c.part", 1 << 20), 10)  # no store
        with pytest.raises(OSError, match=f"the holder says {len(data):,} bytes, the asker allows 1,000"):
            holders.run(ask(want, TOKENIZER_NAME, tmp_path / "d.part", 1000), 10)
    finally:
        holders.close()


def test_a_peer_sending_other_bytes_is_refused_naming_both_hashes_and_the_next_one_asked(
    tmp_path: Path, caplog
) -> None:
    data, other = trained(), trained(TEXTS[:60])
    want, got = hashlib.sha256(data).hexdigest(), hashlib.sha256(other).hexdigest()
    (tmp_path / "right.json").write_bytes(data)
    (tmp_path / "wrong.json").write_bytes(other)
    holders = Holders(
        {
            "12D3KooWliar": lambda sha: tmp_path / "wrong.json",  # answers any hash with its file
            "12D3KooWempty": lambda sha: None,
            "12D3KooWhonest": lambda sha: tmp_path / "right.json" if sha == want else None,
        }
    )
    try:
        with caplog.at_level(logging.WARNING, logger="peer.shards.serve"):
            assert holders.source("12D3KooWliar", "12D3KooWempty", "12D3KooWhonest").fetch_tokenizer(want) == data
        assert f"hashes to {got}, the run pins data.tokenizer_sha256 = {want}" in caplog.text
        with pytest.raises(FileNotFoundError) as info:
            holders.source("12D3KooWliar", "12D3KooWempty").fetch_tokenizer(want)
        assert f"wrong bytes (sha256 {got})" in str(info.value) and "not held" in str(info.value)
        with pytest.raises(FileNotFoundError, match="no peer known yet"):
            holders.source().fetch_tokenizer(want)
    finally:
        holders.close()


def test_a_peer_sending_more_than_the_cap_is_refused(tmp_path: Path, monkeypatch) -> None:
    data = trained()
    (tmp_path / "big.json").write_bytes(data)
    monkeypatch.setattr(serve, "MAX_TOKENIZER_BYTES", 4096)
    holders = Holders({"12D3KooWbig": lambda sha: tmp_path / "big.json"})
    try:
        with pytest.raises(FileNotFoundError, match="the asker allows 4,096"):
            holders.source("12D3KooWbig").fetch_tokenizer(hashlib.sha256(data).hexdigest())
    finally:
        holders.close()


class Peers:
    """The peers as bpe.py sees them: a callable counting its calls."""

    def __init__(self, answer: bytes | None = None, error: str = "12D3KooWabc…: not held"):
        self.answer, self.error, self.asked = answer, error, []

    def __call__(self, sha256: str) -> bytes:
        self.asked.append(sha256)
        if self.answer is None:
            raise FileNotFoundError(self.error)
        return self.answer


def test_the_peers_are_asked_after_the_local_places_and_before_the_source(tmp_path: Path) -> None:
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    missing_source = str(tmp_path / "nowhere" / "tokenizer.json")
    peers = Peers(data)
    got, origin = bpe.tokenizer_bytes(spec(want, missing_source), cache_dir=tmp_path / "cache", peers=peers)
    assert got == data and origin == "the run's peers" and peers.asked == [want]
    assert bpe.store_path(tmp_path / "cache", want).read_bytes() == data  # kept: asked once per machine
    again = Peers(data)
    assert bpe.load_tokenizer(spec(want), cache_dir=tmp_path / "cache", peers=again).sha256 == want
    assert not again.asked  # the store has it
    # the peers fail: the source is read
    source = tmp_path / "published.json"
    source.write_bytes(data)
    failing = Peers()
    assert bpe.tokenizer_bytes(spec(want, str(source)), cache_dir=tmp_path / "c2", peers=failing) == (
        data,
        str(source),
    )
    assert failing.asked == [want]


def test_no_peer_holding_it_and_no_source_is_exit_69_naming_what_was_tried(tmp_path: Path) -> None:
    want = hashlib.sha256(trained()).hexdigest()
    with pytest.raises(bpe.TokenizerUnavailable) as info:
        bpe.load_tokenizer(spec(want), cache_dir=tmp_path / "cache", peers=Peers(error="12D3KooWabc…: not held"))
    message = str(info.value)
    assert info.value.exit_code == 69
    assert want in message and "12D3KooWabc…: not held" in message and "data.tokenizer_source" in message
    assert str(tmp_path / "cache" / "tokenizers") in message
    # bytes that hash otherwise from the peers (a callable that does not check) are not kept
    other = trained(TEXTS[:60])
    with pytest.raises(bpe.TokenizerUnavailable, match=hashlib.sha256(other).hexdigest()):
        bpe.load_tokenizer(spec(want), cache_dir=tmp_path / "cache", peers=Peers(other))
    assert not (tmp_path / "cache" / "tokenizers").exists()
    # the peers not asked, no source: a configuration error, as before
    with pytest.raises(ConfigError) as no_peers:
        bpe.load_tokenizer(spec(want), cache_dir=tmp_path / "cache")
    assert no_peers.value.exit_code == 78 and not isinstance(no_peers.value, bpe.TokenizerUnavailable)


def test_prefetch_asks_the_peers_only_for_a_tokenizer_held_nowhere_here(tmp_path: Path) -> None:
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    peers = Peers(data)
    assert bpe.is_held(DataSpec(), cache_dir=tmp_path) and bpe.is_held(spec(""), cache_dir=tmp_path)
    assert not bpe.is_held(spec(want), cache_dir=tmp_path / "cache")
    bpe.prefetch(spec(want), cache_dir=tmp_path / "cache", peers=peers)
    assert peers.asked == [want] and bpe.is_held(spec(want), cache_dir=tmp_path / "cache")
    assert bpe.held_path(want, tmp_path / "cache") == bpe.store_path(tmp_path / "cache", want)
    bpe.prefetch(spec(want), cache_dir=tmp_path / "cache", peers=peers)
    bpe.prefetch(DataSpec(), cache_dir=tmp_path / "cache", peers=peers)
    assert peers.asked == [want]  # held now; a bytes run asks nothing
