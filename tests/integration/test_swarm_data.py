"""`peer swarm --run FILE --data PATH` trains its local peers on a corpus of this machine (issue 53,
item 1), with real processes: the run is announced by content, each peer gets ``--data``; a
``--data`` path that does not exist is one line naming it, exit 78, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.manifest import dump_toml
from protocol.presets import tiny_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def write_corpus(folder: Path, n: int = 30) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(f"word{(i * 7 + j) % 23}" for j in range(200)) + "\n")
    return folder


def swarm(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env_cache = {"LOCOSWARM_CACHE_DIR": str(tmp_path / "cache")}
    import os

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "peer",
            "swarm",
            "--peers",
            "2",
            "--rounds",
            "2",
            "--device",
            "cpu",
            "--eval-every",
            "0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, **env_cache},
        cwd=tmp_path,
    )


def test_a_local_swarm_trains_on_a_corpus_of_this_machine(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    run = tiny_run().replace(
        data={"source": "files", "path": str(corpus), "validation_fraction": 0.2, "validation_sequences": 4}
    )
    (tmp_path / "run.toml").write_text(dump_toml(run))
    result = swarm(
        tmp_path,
        "--run",
        str(tmp_path / "run.toml"),
        "--data",
        str(corpus),
        "--summary",
        str(tmp_path / "summary.json"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the peers train on {corpus}" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["rounds_completed"] for p in summary["peers"]] == [2, 2]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_a_missing_data_path_exits_78_before_anything_starts(tmp_path):
    missing = tmp_path / "no-such-corpus"
    result = swarm(tmp_path, "--preset", "tiny", "--data", str(missing))
    assert result.returncode == 78, result.stdout + result.stderr
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert str(missing) in line
    assert "bootstrap node at" not in result.stdout


def test_a_local_swarm_trains_on_the_shards_peer_data_prepare_cut_from_a_text_tree(tmp_path):
    """Issue #68 item 1: `peer data prepare TREE --out DIR`, then `peer swarm --data DIR`."""
    import os

    corpus = write_corpus(tmp_path / "notes")
    (corpus / "page.html").write_text("<html><body><p>" + "word3 word5 " * 200 + "</p></body></html>")
    out = tmp_path / "shards"
    prepared = subprocess.run(
        [sys.executable, "-m", "peer", "data", "prepare", str(corpus), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LOCOSWARM_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert f"peer swarm --data {out}" in prepared.stdout.splitlines()[-1]
    shards = sorted(p.name for p in out.glob("part-*.parquet"))
    assert len(shards) >= 2
    result = swarm(
        tmp_path, "--preset", "tiny", "--rounds", "1", "--data", str(out), "--summary", str(tmp_path / "s.json")
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the peers stream the {len(shards) - 1} training shard(s) of" in result.stdout, result.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [p["rounds_completed"] for p in summary["peers"]] == [1, 1]
