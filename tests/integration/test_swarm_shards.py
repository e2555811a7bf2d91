"""`peer swarm --run FILE` on a sharded run whose shards lie in a directory of this machine (issue #53
item 3, issue #52), with real processes on 127.0.0.1: the launcher reads the shard list and the
validation shard once, announces the run without the directory, and its two peers each stream their
own training shards from it (``--data``) and train two rounds together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.shards.index import INDEX_NAME, index_directory
from protocol.manifest import dump_toml
from protocol.presets import tiny_run
from tests.shard_fixtures import write_shards

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_local_swarm_streams_the_shards_of_a_directory_and_trains(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    write_shards(shards, 6, 60)
    index = index_directory(shards)
    (shards / INDEX_NAME).write_bytes(index.encode())
    run = tiny_run().replace(
        data={
            "source": "shards",
            "path": str(shards),
            "shards_sha256": index.sha256,
            "shard_count": len(index.shards),
            "shards_bytes": index.total_bytes,
            "validation_sequences": 4,
        }
    )
    (tmp_path / "run.toml").write_text(dump_toml(run))
    result = subprocess.run(
        [
            sys.executable, "-m", "peer", "swarm", "--run", str(tmp_path / "run.toml"), "--peers", "2",
            "--rounds", "2", "--device", "cpu", "--eval-every", "0", "--workdir", str(tmp_path / "work"),
            "--summary", str(tmp_path / "summary.json"),
        ],
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, "LOCOSWARM_CACHE_DIR": str(tmp_path / "cache")},
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the peers stream the {len(index.shards) - 1} training shard(s) of" in result.stdout, result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["rounds_completed"] for p in summary["peers"]] == [2, 2], summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # the run the peers trained names its shards by hash and no directory of this machine
    announced = (tmp_path / "work" / "run.toml").read_text()
    assert index.sha256 in announced and str(shards) not in announced
    # the peers fetched training shards from the directory, their only source (the launcher read the
    # validation shard alone, before they started)
    held = {p.stem for p in (tmp_path / "cache" / "shards").glob("*.parquet")}
    training = {s.sha256 for s in index.training(1)}
    assert held & training and {s.sha256 for s in index.held_out(1)} <= held
