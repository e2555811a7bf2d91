"""A run's tokenizer fetched from its peers over real libp2p streams (issue #52 item 3): real hivemind
DHT nodes (each its own process and p2pd) on loopback, each with the shard protocol's handler
(peer/shards/share.py). Peer A holds the run's tokenizer.json in its store; B, whose cache dir is
empty and whose run names no data.tokenizer_source, gets it from A, hash-checked and kept. A peer C
that answers with other bytes is refused naming both hashes, and B asks the next peer, or, with no
other peer, stops with exit 69 naming the hash C's bytes had. And the join wiring (peer/node.py), real
``peer join`` processes: a peer whose cache dir lacks the run's tokenizer, joining with ``--run`` and
``--initial-peers``, defers reading its data until its DHT node is up, gets the tokenizer from the
first peer and starts."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.net import dht_node
from peer.shards.share import ShardSharing
from peer.train import bpe
from peer.train.data import load_corpus
from protocol.manifest import DataSpec
from tests.integration.harness import Procs, make_manifest, write_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RUN = "run-tokenizer-peers"
TEXTS = [f"def sync_{i}(phi, delta={i}):\n    return phi - delta / {i + 1}  # outer step\n" for i in range(150)]


def trained(texts: list[str]) -> bytes:
    return bpe.train_bpe(iter(texts), 512).to_str().encode("utf-8")


@contextlib.contextmanager
def nodes(count: int, tmp_path: Path, want: str) -> Iterator[list[tuple[object, ShardSharing, Path]]]:
    """``count`` DHT nodes on 127.0.0.1 (the first the others' initial peer), each sharing run RUN's
    tokenizer ``want`` from its own cache dir and asking the peers :data:`ASK` names for it (as a
    swarm view would name them); yields (dht, sharing, cache dir) per node."""
    made: list[tuple[object, ShardSharing, Path]] = []
    try:
        for k in range(count):
            first = [str(m) for m in made[0][0].get_visible_maddrs()] if made else []  # type: ignore[attr-defined]
            dht = dht_node.start_dht(initial_peers=first)
            cache = tmp_path / f"cache{k}"
            try:
                sharing = ShardSharing(dht, RUN, lambda: list(ASK), tokenizer_sha256=want, cache_dir=cache)
            except Exception:
                dht.shutdown()
                raise
            made.append((dht, sharing, cache))
        yield made
    finally:
        for dht, sharing, _ in reversed(made):
            sharing.close()
            dht.shutdown()  # type: ignore[attr-defined]


ASK: list[str] = []
"""The peer ids every node's sharing asks, in order (set by :func:`asking`)."""


def asking(sharing: ShardSharing, *holders) -> ShardSharing:
    """``sharing``, its peers to ask now those of ``holders`` (DHT nodes), in that order."""
    ASK[:] = [str(dht.peer_id) for dht in holders]
    return sharing


def test_a_joiner_gets_the_runs_tokenizer_from_a_peer_and_a_lying_peer_is_refused(tmp_path: Path, caplog) -> None:
    data, other = trained(TEXTS), trained(TEXTS[:70])
    want, got = hashlib.sha256(data).hexdigest(), hashlib.sha256(other).hexdigest()
    assert want != got
    spec = DataSpec(tokenizer="bpe", vocab_size=512, tokenizer_sha256=want)  # no tokenizer_source
    with nodes(3, tmp_path, want) as [(a_dht, _, a_cache), (b_dht, b, b_cache), (c_dht, c, _)]:
        bpe.keep(a_cache, data)  # A holds it in its store; B's cache dir is empty
        assert not b_cache.exists()
        liar = tmp_path / "other.json"
        liar.write_bytes(other)
        c.tokenizer_file = lambda sha256: liar  # C answers any tokenizer request with other bytes

        # only C to ask: refused with its hash named, nothing kept, exit 69
        with pytest.raises(bpe.TokenizerUnavailable) as info:
            bpe.load_tokenizer(spec, cache_dir=b_cache, peers=asking(b, c_dht).fetch_tokenizer)
        assert info.value.exit_code == 69
        assert want in str(info.value) and f"wrong bytes (sha256 {got})" in str(info.value)
        assert not bpe.store_path(b_cache, want).exists()

        # C first, then A: C refused naming both hashes, A's bytes taken over a real libp2p stream
        with caplog.at_level(logging.WARNING, logger="peer.shards.serve"):
            tokenizer = bpe.load_tokenizer(spec, cache_dir=b_cache, peers=asking(b, c_dht, a_dht).fetch_tokenizer)
        assert f"refused the tokenizer from peer {c_dht.peer_id}: it hashes to {got}" in caplog.text
        assert want in caplog.text
        assert tokenizer.sha256 == want and tokenizer.kind == "bpe"
        kept = bpe.store_path(b_cache, want)
        assert hashlib.sha256(kept.read_bytes()).hexdigest() == want  # kept: B now serves it too

        # B, holding it now, serves it to a fourth asker (C's own cache is empty of it)
        assert asking(c, b_dht).fetch_tokenizer(want) == data
        # a tokenizer other than the run's is not served, even when held
        bpe.keep(a_cache, other)
        with pytest.raises(FileNotFoundError, match="not held"):
            asking(b, a_dht).fetch_tokenizer(got)


def test_peer_join_without_the_tokenizer_gets_it_from_the_first_peer_and_starts(tmp_path: Path, monkeypatch) -> None:
    data = trained(TEXTS)
    want = hashlib.sha256(data).hexdigest()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXTS[:60]):
        (corpus / f"doc{i:03d}.py").write_text(text * 4, encoding="utf-8")
    bpe.keep(tmp_path / "cache-a", data)  # the first peer's store holds it; the second's is empty
    files = DataSpec(source="files", path=str(corpus), seq_len_tokens=32, validation_sequences=4)
    pinned = load_corpus(files, cache_dir=tmp_path / "scratch").corpus_sha256
    manifest = make_manifest(
        data={
            "source": "files",
            "corpus_sha256": pinned,
            "tokenizer": "bpe",
            "vocab_size": 512,
            "tokenizer_sha256": want,
            "validation_sequences": 4,
            "validation_fraction": 0.2,
        }
    )
    run_file = write_manifest(tmp_path, manifest)
    procs = Procs(tmp_path)
    try:
        monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache-a"))
        first = procs.peer("first", "--run", str(run_file), "--data", str(corpus), "--host", "127.0.0.1")
        addr = first.wait_event(lambda e: e.kind == "started", 300).addresses_on("127.0.0.1")[0]
        monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache-b"))
        second = procs.peer(
            "second", "--run", str(run_file), "--initial-peers", addr, "--data", str(corpus), "--host", "127.0.0.1"
        )
        started = second.wait_event(lambda e: e.kind == "started", 300)
        assert started["run_id"] == manifest.run_id
        assert any("tokenizer is not on this machine" in e.get("message", "") for e in second.of("status"))
        kept = bpe.store_path(tmp_path / "cache-b", want)
        assert hashlib.sha256(kept.read_bytes()).hexdigest() == want
    finally:
        procs.cleanup()
