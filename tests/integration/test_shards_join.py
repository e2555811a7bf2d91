"""`peer join` on a sharded run (issue #52), real processes on loopback: a peer streams its shards
from a real HTTP server on 127.0.0.1 (the CDN) under a disk cap smaller than the corpus and trains;
a second peer, while the CDN lacks the shard list and the validation shard, gets them from the
first peer over libp2p (peer/shards/serve.py) and its training shards from the CDN; a run
whose only source is unreachable stops with one line and exit 69."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.shards.index import INDEX_NAME, index_directory
from tests.integration.harness import Procs, make_manifest, write_manifest
from tests.shard_fixtures import ShardServer, write_shards

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def sharded_run(corpus: Path, base_url: str):
    index = index_directory(corpus)
    (corpus / INDEX_NAME).write_bytes(index.encode())
    return make_manifest(
        data={
            "source": "shards",
            "shards_sha256": index.sha256,
            "shard_count": len(index.shards),
            "shards_bytes": index.total_bytes,
            "base_url": base_url,
            "validation_sequences": 4,
        }
    )


def test_peers_stream_their_shards_from_the_cdn_and_from_each_other(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache"))  # the first peer's (the second, below)
    corpus = tmp_path / "corpus"
    write_shards(corpus, 10, 150)
    index = index_directory(corpus)
    cap_gb = 4 * max(s.size for s in index.shards) / 1e9
    procs = Procs(tmp_path)
    with ShardServer(corpus) as server:
        manifest = sharded_run(corpus, server.cdn)
        run_file = write_manifest(tmp_path, manifest)
        try:
            first = procs.peer(
                "first", "--run", str(run_file), "--host", "127.0.0.1", "--data-cache-gb", f"{cap_gb:.9f}"
            )
            started = first.wait_event(lambda e: e.kind == "started", 300)
            assert started["run_id"] == manifest.run_id
            first.wait_event(lambda e: e.kind == "round" and e.get("round", 0) >= 1, 300)
            served = {name for name, _ in server.requests}
            assert INDEX_NAME in served and len(served & {s.name for s in index.shards}) >= 2
            held = list((tmp_path / "cache" / "shards").glob("*.parquet"))
            assert held and sum(p.stat().st_size for p in held) <= cap_gb * 1e9

            # the CDN now lacks the list and the validation shard: the second peer gets them from the first
            from_peer = {INDEX_NAME, *(s.name for s in index.held_out(1))}
            server.missing.update(from_peer)
            before = len(server.requests)
            addr = started.addresses_on("127.0.0.1")[0]
            monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache2"))
            second = procs.peer("second", "--initial-peers", addr, "--host", "127.0.0.1")
            second.wait_event(lambda e: e.kind == "round", 300)
            asked = [name for name, _ in server.requests[before:]]
            assert not from_peer & set(asked), "asked the CDN for what the first peer holds"
            assert set(asked) <= {s.name for s in index.training(1)} and asked, "training shards come from the CDN"
        finally:
            procs.cleanup()


def test_an_unreachable_source_stops_the_peer_with_one_line_and_exit_69(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    write_shards(corpus, 3, 20)
    with ShardServer(corpus) as server:
        dead = server.cdn
    procs = Procs(tmp_path)
    try:
        peer = procs.peer(
            "lonely", "--run", str(write_manifest(tmp_path, sharded_run(corpus, dead))), "--host", "127.0.0.1"
        )
        assert peer.wait(300) == 69
        [line] = [ln for ln in peer.tail(60).splitlines() if ln.startswith("error:")]
        assert INDEX_NAME in line and dead in line and "cannot connect" in line
        assert not peer.of("started")
    finally:
        procs.cleanup()
