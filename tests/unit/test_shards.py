"""peer/shards/: a corpus as a hashed shard list, fetched from a real HTTP server on 127.0.0.1 (as a
CDN and as a Hugging Face hub), a local directory, with corrupt and cut downloads, a disk cap smaller
than the corpus, two peers' assignments and a restart continuing its position (issue #52)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from peer.shards.assign import ring, shard_at
from peer.shards.corpus import load_sharded
from peer.shards.fetch import Fetcher, HttpSource, LocalSource, ShardUnavailable, hub_source
from peer.shards.index import INDEX_NAME, index_directory, index_hub_repo, parse_index
from peer.shards.store import ShardStore
from peer.state.checkpoint import PeerState, load_checkpoint, save_checkpoint
from protocol.errors import ConfigError
from protocol.manifest import DataSpec, ManifestError, RunManifest, from_dict
from tests.shard_fixtures import ShardServer, write_shards

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write_shards(root, 8, 120)
    (root / INDEX_NAME).write_bytes(index_directory(root).encode())
    return root


def spec_for(root: Path, **over) -> DataSpec:
    index = index_directory(root)
    values = dict(
        source="shards",
        shards_sha256=index.sha256,
        shard_count=len(index.shards),
        shards_bytes=index.total_bytes,
        seq_len_tokens=32,
        validation_sequences=8,
    )
    values.update(over)
    return DataSpec(**values)


def test_the_list_hashes_into_the_run_id_and_a_changed_shard_changes_it(corpus: Path) -> None:
    before = RunManifest(data=spec_for(corpus))
    index = index_directory(corpus)
    assert parse_index(index.encode(), expected_sha256=index.sha256, where="x") == index
    assert json.loads(index.encode())["shards"][0] == {
        "name": "part-00000.parquet",
        "sha256": hashlib.sha256((corpus / "part-00000.parquet").read_bytes()).hexdigest(),
        "size": (corpus / "part-00000.parquet").stat().st_size,
    }
    write_shards(corpus, 1, 121, seed=9)  # part-00000 rewritten
    after = RunManifest(data=spec_for(corpus))
    assert after.run_id != before.run_id
    with pytest.raises(ConfigError, match=index.sha256):
        parse_index(index_directory(corpus).encode(), expected_sha256=index.sha256, where="the CDN")
    # the shard fields stay out of a run that does not use them: the default run id is unchanged
    assert "shards_sha256" not in RunManifest().to_dict()["data"]
    assert from_dict(before.to_dict()) == before


def test_bad_shard_fields_are_refused_naming_the_field() -> None:
    with pytest.raises(ManifestError, match="data.shards_sha256"):
        DataSpec(source="shards", shard_count=4, shards_bytes=10)
    with pytest.raises(ManifestError, match="data.hub_revision"):
        DataSpec(
            source="shards", shards_sha256="a" * 64, shard_count=4, shards_bytes=10, hub_repo="a/b", hub_revision="main"
        )
    with pytest.raises(ManifestError, match="data.base_url"):
        DataSpec(source="files", path="x", base_url="http://x")


def test_shards_come_from_the_cdn_the_hub_and_a_local_directory(corpus: Path, tmp_path: Path) -> None:
    index = index_directory(corpus)
    shard = index.shards[3]
    with ShardServer(corpus, revision=REV) as server:
        listed = index_hub_repo(server.repo, REV, endpoint=server.url)
        assert listed == index  # the hub's listing gives the same list, nothing downloaded
        assert server.requests == []
        for source in (
            HttpSource(server.cdn, "cdn"),
            hub_source(server.repo, REV, endpoint=server.url),
            LocalSource(corpus),
        ):
            dest = tmp_path / "got" / source.label.replace("/", "_").replace("'", "") / "x.parquet"
            dest.parent.mkdir(parents=True)
            assert Fetcher([source]).fetch(shard, dest) == source.label
            assert dest.read_bytes() == (corpus / shard.name).read_bytes()


def test_a_corrupt_shard_is_refused_named_and_fetched_from_the_next_source(corpus: Path, tmp_path: Path) -> None:
    shard = index_directory(corpus).shards[2]
    lines: list[str] = []
    with ShardServer(corpus, revision=REV) as server:
        server.corrupt.add(shard.name)  # the CDN serves it with one byte flipped; the hub does not
        fetcher = Fetcher(
            [HttpSource(server.cdn, "cdn"), hub_source(server.repo, REV, endpoint=server.url)], on_refused=lines.append
        )
        got = fetcher.fetch(shard, tmp_path / "s.parquet")
    assert got.startswith("dataset team/corpus")
    [line] = lines
    assert shard.name in line and "cdn" in line and shard.sha256 in line
    assert hashlib.sha256((tmp_path / "s.parquet").read_bytes()).hexdigest() == shard.sha256


def test_a_cut_download_resumes_with_a_range_request(corpus: Path, tmp_path: Path) -> None:
    shard = index_directory(corpus).shards[1]
    with ShardServer(corpus) as server:
        server.cut.add(shard.name)
        Fetcher([HttpSource(server.cdn, "cdn")]).fetch(shard, tmp_path / "s.parquet")
        requests = [r for r in server.requests if r[0] == shard.name]
    assert requests[0] == (shard.name, None)
    assert requests[1][1] is not None and int(requests[1][1].removeprefix("bytes=").rstrip("-")) > 0
    assert len(requests) == 2
    assert hashlib.sha256((tmp_path / "s.parquet").read_bytes()).hexdigest() == shard.sha256


def test_an_unreachable_source_is_one_line_exit_69(corpus: Path, tmp_path: Path) -> None:
    with ShardServer(corpus) as server:
        dead = server.cdn
    spec = spec_for(corpus, base_url=dead)
    with pytest.raises(ShardUnavailable) as info:
        load_sharded(spec, cache_dir=tmp_path / "cache")
    assert info.value.exit_code == 69
    message = str(info.value)
    assert "\n" not in message and INDEX_NAME in message and dead in message and "cannot connect" in message


def make_sampler(corpus_spec: DataSpec, cache: Path, peer: str, cap: int | None = None, run: str = "run-1"):
    data = load_sharded(corpus_spec, cache_dir=cache, cache_bytes=cap)
    assert data.make_sampler is not None
    return data, data.make_sampler(peer_id=peer, run_key=run, seq_len=32, batch_sequences=4)


def test_a_peer_streams_its_shards_under_a_disk_cap_smaller_than_the_corpus(corpus: Path, tmp_path: Path) -> None:
    index = index_directory(corpus)
    biggest = max(s.size for s in index.shards)
    cap = 4 * biggest  # validation shard + current + prefetched + one more; the corpus is 8 shards
    assert cap < index.total_bytes
    with ShardServer(corpus) as server:
        data, sampler = make_sampler(spec_for(corpus, base_url=server.cdn), tmp_path / "cache", "peer-a", cap)
        try:
            assert data.validation.numel() > 32 and data.train_files == 7 and data.validation_files == 1
            seen = set()
            while sampler.consumed < 10:  # more than one pass over the 7 training shards
                batch = sampler.next_batch()
                assert batch.shape == (4, 33) and batch.dtype == torch.int64
                seen.add(sampler.current_shard.name)
                assert sampler.store.used_bytes() <= cap
            assert len(seen) == 7
            assert sampler.store.peak_bytes <= cap
        finally:
            sampler.close()
    # a cap below the validation shard and one training shard is refused with the flag named
    with ShardServer(corpus) as server:
        with pytest.raises(ConfigError, match="--data-cache-gb"):
            load_sharded(spec_for(corpus, base_url=server.cdn), cache_dir=tmp_path / "small", cache_bytes=biggest // 2)


def test_two_peers_take_different_shards_and_every_shard_is_someones(corpus: Path) -> None:
    shards = index_directory(corpus).training(1)
    ordered = ring(shards, "run-1")
    walks = {p: [shard_at(ordered, p, "run-1", k).name for k in range(len(shards))] for p in ("peer-a", "peer-b")}
    assert walks["peer-a"][0] != walks["peer-b"][0]
    assert sorted(walks["peer-a"]) == sorted(s.name for s in shards)  # a walk covers the ring
    firsts = {shard_at(ordered, f"peer-{i}", "run-1", 0).name for i in range(200)}
    assert firsts == {s.name for s in shards}
    assert ring(shards, "run-2") != ordered  # another run deals them otherwise


def test_the_peers_sampler_reads_the_shards_its_walk_names(corpus: Path, tmp_path: Path) -> None:
    spec = spec_for(corpus, path=str(corpus))
    _, a = make_sampler(spec, tmp_path / "cache-a", "peer-a")
    _, b = make_sampler(spec, tmp_path / "cache-b", "peer-b")
    try:
        first_a, first_b = a.next_batch(), b.next_batch()
        assert a.current.shard.name != b.current.shard.name
        assert not torch.equal(first_a, first_b)
    finally:
        a.close()
        b.close()


def test_a_restart_continues_its_position(corpus: Path, tmp_path: Path) -> None:
    with ShardServer(corpus) as server:
        spec = spec_for(corpus, base_url=server.cdn)
        _, first = make_sampler(spec, tmp_path / "cache", "peer-a")
        try:
            while first.consumed < 1 or first.offset < 20:  # across a shard boundary, into the next shard
                first.next_batch()
            saved = first.state()
            expected = [first.next_batch() for _ in range(3)]
        finally:
            first.close()
        assert saved.shard >= 1
        # through a real checkpoint file (peer/state/checkpoint.py), as a restarted peer reads it
        t = [torch.ones(2)]
        state = PeerState(
            run_id="r" * 32, round=1, inner_step=1, round_step=0, round_tokens=0, names=["w"],
            phi=t, momentum=t, theta=t, data=saved,
        )  # fmt: skip
        save_checkpoint(tmp_path / "c.safetensors", state)
        restored_state = load_checkpoint(
            tmp_path / "c.safetensors", run_id="r" * 32, names=["w"], shapes=[t[0].shape]
        ).data
        assert restored_state is not None and (restored_state.shard, restored_state.shard_offset) == (
            saved.shard,
            saved.shard_offset,
        )
        _, second = make_sampler(spec, tmp_path / "cache", "peer-a")
        try:
            second.load_state(restored_state)
            assert [torch.equal(second.next_batch(), e) for e in expected] == [True] * 3
            assert second.batches_drawn == saved.batches_drawn + 3
        finally:
            second.close()
        _, other = make_sampler(spec, tmp_path / "cache", "peer-b")
        try:
            with pytest.raises(ValueError, match="seed"):
                other.load_state(saved)
        finally:
            other.close()


def test_the_store_evicts_consumed_shards_oldest_first_and_keeps_pinned_ones(corpus: Path, tmp_path: Path) -> None:
    index = index_directory(corpus)
    size = max(s.size for s in index.shards)
    store = ShardStore(tmp_path / "store", 2 * size)
    fetcher = Fetcher([LocalSource(corpus)])
    pinned = store.get(index.shards[0], fetcher, pin=True)
    store.get(index.shards[1], fetcher)
    store.get(index.shards[2], fetcher)  # evicts shard 1, not the pinned shard 0
    assert pinned.exists() and store.holds(index.shards[2].sha256) and not store.holds(index.shards[1].sha256)


def test_peer_data_prepare_writes_the_list_and_prints_a_data_section_that_loads(corpus: Path) -> None:
    import tomllib

    from peer.cli import main

    (corpus / INDEX_NAME).unlink()
    result = CliRunner().invoke(
        main, ["data", "prepare", "--shards", str(corpus), "--base-url", "http://127.0.0.1:1/c"]
    )
    assert result.exit_code == 0, result.output
    section = tomllib.loads(result.output.split("\n", 1)[1])
    run = from_dict(section)
    assert run.data.shards_sha256 == hashlib.sha256((corpus / INDEX_NAME).read_bytes()).hexdigest()
    assert run.data.shard_count == 8 and run.data.base_url == "http://127.0.0.1:1/c"
    bad = CliRunner().invoke(main, ["data", "prepare", "--shards", str(corpus / "part-00000.parquet")])
    assert bad.exit_code in (2, 78)


def test_a_held_shard_that_changed_on_disk_is_fetched_again(corpus: Path, tmp_path: Path) -> None:
    shard = index_directory(corpus).shards[0]
    store = ShardStore(tmp_path / "store", 1 << 30)
    fetcher = Fetcher([LocalSource(corpus)])
    path = store.get(shard, fetcher)
    path.write_bytes(b"rot" + path.read_bytes()[3:])
    assert hashlib.sha256(store.get(shard, fetcher).read_bytes()).hexdigest() == shard.sha256


def test_a_peer_streams_from_a_dataset_repository_listed_by_peer_data_prepare(
    corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    import tomllib

    from peer.cli import main

    (corpus / INDEX_NAME).unlink()
    with ShardServer(corpus, revision=REV) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(
            main, ["data", "prepare", "--hub-repo", server.repo, "--hub-revision", REV, "--shards", str(corpus)]
        )
        assert result.exit_code == 0, result.output
        spec = from_dict(tomllib.loads(result.output.split("\n", 1)[1])).data
        assert (spec.hub_repo, spec.hub_revision, spec.base_url) == (server.repo, REV, "")
        assert not any(name.endswith(".parquet") for name, _ in server.requests)  # listed, not downloaded
        data, sampler = make_sampler(
            dataclasses.replace(spec, seq_len_tokens=32, validation_sequences=8), tmp_path / "c", "p"
        )
        try:
            assert sampler.next_batch().shape == (4, 33)
        finally:
            sampler.close()
        assert {name for name, _ in server.requests} >= {INDEX_NAME, sampler.current_shard.name}
