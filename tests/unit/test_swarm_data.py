"""`peer swarm` on a corpus of this machine (issue 53, item 1): the run is announced by content,
the local path goes to the launcher's own peers as ``--data``, a missing path is one line, exit 78."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.swarm import Swarm, SwarmConfig, check_data_path, source_of, with_swarm_data
from protocol.errors import ConfigError
from protocol.presets import tiny_run


def write_corpus(folder: Path, n: int = 30) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(f"word{(i + j) % 17}" for j in range(60)) + "\n")
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache"))


def test_a_missing_data_path_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError) as exc:
        check_data_path(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.exit_code == 78
    cfg = SwarmConfig(manifest=tiny_run(), data_path=tmp_path / "nope")
    with pytest.raises(ConfigError, match="no such file"):
        with_swarm_data(cfg)


def test_data_flag_on_a_stdlib_preset_trains_on_the_corpus_announced_by_content(tmp_path):
    corpus_dir = write_corpus(tmp_path / "corpus")
    cfg, corpus = with_swarm_data(SwarmConfig(manifest=tiny_run(), data_path=tmp_path / "corpus"))
    data = cfg.manifest.data
    assert data.source == "files" and data.path == ""  # no local path travels
    assert data.corpus_sha256 == corpus.corpus_sha256 and data.corpus_bytes == corpus.corpus_bytes
    assert cfg.data_path == corpus_dir.resolve()


def test_a_run_file_with_a_local_path_is_announced_by_content(tmp_path):
    corpus_dir = write_corpus(tmp_path / "corpus")
    run = tiny_run().replace(data={"source": "files", "path": str(corpus_dir)})
    cfg, corpus = with_swarm_data(SwarmConfig(manifest=run))
    assert cfg.manifest.data.path == "" and cfg.manifest.data.corpus_sha256 == corpus.corpus_sha256
    assert cfg.data_path == corpus_dir.resolve()
    assert cfg.manifest.model == run.model and cfg.manifest.sync == run.sync


def test_a_hash_pinned_run_keeps_its_run_id_and_needs_data(tmp_path):
    corpus_dir = write_corpus(tmp_path / "corpus")
    pinned, _ = with_swarm_data(SwarmConfig(manifest=tiny_run(), data_path=corpus_dir))
    run = pinned.manifest  # data.path = "", corpus_sha256 set: what a run file naming its corpus by content holds
    with pytest.raises(ConfigError, match="--data PATH"):
        with_swarm_data(SwarmConfig(manifest=run))
    cfg, _ = with_swarm_data(SwarmConfig(manifest=run, data_path=corpus_dir))
    assert cfg.manifest.run_id == run.run_id and cfg.data_path == corpus_dir.resolve()
    other = write_corpus(tmp_path / "other", n=12)
    with pytest.raises(ConfigError, match="point --data"):
        with_swarm_data(SwarmConfig(manifest=run, data_path=other))


def test_a_stdlib_run_without_data_is_unchanged(tmp_path):
    run = tiny_run()
    cfg = SwarmConfig(manifest=run)
    assert source_of(tmp_path) == "files"
    out, _ = with_swarm_data(cfg)
    assert out is cfg


def test_each_local_peer_gets_the_path_as_data(tmp_path, monkeypatch):
    started: list[list[str]] = []
    swarm = Swarm(SwarmConfig(num_peers=2, manifest=tiny_run(), data_path=tmp_path / "corpus"), tmp_path)
    monkeypatch.setattr(swarm, "_start", lambda name, argv, watched: started.append(argv))
    swarm.start_peer(0, ["/ip4/127.0.0.1/tcp/1/p2p/x"], 1)
    argv = started[0]
    assert argv[argv.index("--data") + 1] == str(tmp_path / "corpus")
    swarm = Swarm(SwarmConfig(num_peers=2, manifest=tiny_run()), tmp_path)
    monkeypatch.setattr(swarm, "_start", lambda name, argv, watched: started.append(argv))
    swarm.start_peer(0, [], 1)
    assert "--data" not in started[1]


def test_source_of_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    assert source_of(tmp_path / "a.jsonl") == "jsonl"
    assert source_of(tmp_path) == "jsonl"
    (tmp_path / "b.txt").write_text("x")
    assert source_of(tmp_path) == "files"
