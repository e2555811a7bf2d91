"""`peer swarm`: the launcher a developer (and the README's first command) uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SUMMARY_KEYS = {"initial_eval_loss", "final_eval_loss", "peers", "wall_" + "seconds"}


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_peer_swarm_trains_and_leaves_no_process_and_no_file_behind(tmp_path):
    # Its temporary directory goes under TMPDIR: what it leaves there is what it would leave in /tmp.
    temp, summary_path = tmp_path / "tmp", tmp_path / "summary.json"
    temp.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer",
            "swarm",
            "--preset",
            "tiny",
            "--peers",
            "2",
            "--rounds",
            "3",
            "--summary",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, TMPDIR=str(temp)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(summary_path.read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert len(summary["peers"]) == 2
    for peer in summary["peers"]:
        assert {"peer_id", "rounds_completed", "max_group_size", "bytes_sent"} <= peer.keys()
        assert peer["rounds_completed"] == 3 and peer["max_group_size"] == 2 and peer["bytes_sent"] > 0
    assert "swarm summary" in result.stdout
    # Peers, their DHT and averager processes and the p2pd daemons (whose command lines name
    # the identity files under the workdir) are all gone, and so is the workdir.
    workdir = summary["workdir"]
    assert workdir.startswith(str(temp)), workdir
    assert processes_mentioning(workdir) == []
    # (torch may leave its own shared cache there, torchinductor_<user>: not the swarm's)
    assert not Path(workdir).exists() and not list(temp.glob("locoswarm-*")), sorted(temp.iterdir())
