"""`peer swarm` on a sharded corpus in a directory of this machine (issue #53 item 3, issue #52):
peer/swarm_data.py reads the shard list and the validation shards once, announces the run without
the directory (its shards stay bound by ``data.shards_sha256``) and hands the directory to its own
peers as ``--data``. Real parquet shards, a real shard list, nothing mocked."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.shards.index import INDEX_NAME, index_directory
from peer.swarm import Swarm, SwarmConfig, with_swarm_data
from protocol.errors import ConfigError, LocoError
from protocol.presets import tiny_run
from tests.shard_fixtures import write_shards


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache"))


def prepared(root: Path, count: int = 4, seed: int = 0):
    """Shards and their ``shards.json`` under ``root``, as ``peer data prepare --shards`` leaves them."""
    write_shards(root, count, 40, seed=seed)
    index = index_directory(root)
    (root / INDEX_NAME).write_bytes(index.encode())
    return index


def sharded_run(index, **data):
    return tiny_run().replace(
        data={
            "source": "shards",
            "shards_sha256": index.sha256,
            "shard_count": len(index.shards),
            "shards_bytes": index.total_bytes,
            "validation_sequences": 4,
            **data,
        }
    )


def test_a_run_file_with_a_shard_directory_is_announced_without_it(tmp_path):
    shards = tmp_path / "shards"
    index = prepared(shards)
    run = sharded_run(index, path=str(shards))
    cfg, corpus = with_swarm_data(SwarmConfig(manifest=run, num_peers=2))
    data = cfg.manifest.data
    assert data.source == "shards" and data.path == ""  # the directory never travels
    assert (data.shards_sha256, data.shard_count, data.shards_bytes) == (
        index.sha256,
        len(index.shards),
        index.total_bytes,
    )
    assert cfg.data_path == shards.resolve()
    assert cfg.manifest.model == run.model and cfg.manifest.sync == run.sync
    assert corpus.corpus_sha256 == index.sha256 and corpus.make_sampler is not None
    assert (corpus.train_files, corpus.validation_files) == (len(index.shards) - 1, 1)
    assert corpus.validation.numel() > run.data.seq_len_tokens  # the validation shard was read and tokenized
    held = list((tmp_path / "cache" / "shards").glob("*.parquet"))
    assert [p.stem for p in held] == [s.sha256 for s in index.held_out(1)]  # only the validation shard, so far


def test_data_flag_overrides_the_run_files_directory_and_names_a_hash_pinned_run(tmp_path):
    shards = tmp_path / "shards"
    index = prepared(shards)
    run = sharded_run(index)  # no directory: a run named by its shard list only
    with pytest.raises(ConfigError, match=r"pass --data DIR") as exc:
        with_swarm_data(SwarmConfig(manifest=run))
    assert index.sha256 in str(exc.value) and exc.value.exit_code == 78
    cfg, _ = with_swarm_data(SwarmConfig(manifest=run, data_path=shards))
    assert cfg.manifest.run_id == run.run_id and cfg.data_path == shards.resolve()


def test_data_flag_with_a_preset_makes_a_sharded_run_of_the_prepared_directory(tmp_path):
    shards = tmp_path / "shards"
    index = prepared(shards, count=5)
    cfg, corpus = with_swarm_data(SwarmConfig(manifest=tiny_run(), data_path=shards))
    data = cfg.manifest.data
    assert data.source == "shards" and data.path == "" and data.validation_shards == 1
    assert data.shards_sha256 == index.sha256 == corpus.corpus_sha256 and data.shard_count == 5
    assert cfg.manifest.model == tiny_run().model and data.tokenizer == tiny_run().data.tokenizer


def test_a_directory_of_other_shards_is_refused_naming_the_run_s_list(tmp_path):
    run = sharded_run(prepared(tmp_path / "ours"))
    prepared(tmp_path / "theirs", seed=1)
    with pytest.raises(LocoError) as exc:
        with_swarm_data(SwarmConfig(manifest=run, data_path=tmp_path / "theirs"))
    assert run.data.shards_sha256[:16] in str(exc.value)


def test_a_missing_directory_in_the_run_file_is_one_line_naming_it(tmp_path):
    run = sharded_run(prepared(tmp_path / "shards"), path=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="does not exist") as exc:
        with_swarm_data(SwarmConfig(manifest=run))
    assert str(tmp_path / "gone") in str(exc.value) and "\n" not in str(exc.value)


def test_each_local_peer_gets_the_shard_directory_as_data(tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    cfg, _ = with_swarm_data(SwarmConfig(manifest=sharded_run(prepared(shards), path=str(shards)), num_peers=2))
    started: list[list[str]] = []
    swarm = Swarm(cfg, tmp_path)
    monkeypatch.setattr(swarm, "_start", lambda name, argv, watched: started.append(argv))
    for i in range(2):
        swarm.start_peer(i, ["/ip4/127.0.0.1/tcp/1/p2p/x"], 1)
    assert all(argv[argv.index("--data") + 1] == str(shards.resolve()) for argv in started)
