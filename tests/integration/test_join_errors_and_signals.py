"""What a user sees on bad input and on interruption: real processes, real sockets."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from protocol.version import PROTOCOL_VERSION
from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration

SOME_PEER_ID = "QmTchctY2mrWtDteP1QWQW79B2bLycdUvtDZ3airqiax6s"


def run_peer(*args, timeout_s=60):
    # The timeout is a hang guard: the requirement is a non-zero exit within 30 s.
    return subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, timeout=timeout_s)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_initial_peer_exits_69_naming_the_address(tmp_path):
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{SOME_PEER_ID}"
    result = run_peer("join", "--initial-peers", address, "--data-dir", str(tmp_path), timeout_s=30)
    assert result.returncode == 69, result.stderr
    assert address in result.stderr and "reachable" in result.stderr


def test_a_port_in_use_exits_78_naming_the_port_not_the_initial_peer(tmp_path):
    # issue #68 item 7: p2pd's failure to listen used to surface as "none of the initial peers answered", exit 69
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{SOME_PEER_ID}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_peer("join", "--initial-peers", address, "--port", str(port), "--data-dir", str(tmp_path))
    assert result.returncode == 78, result.stderr
    assert f"--port {port}: TCP port {port}" in result.stderr and "in use" in result.stderr, result.stderr
    assert "initial peers" not in result.stderr


@pytest.mark.parametrize("address", ["localhost:31337", "/ip4/127.0.0.1/tcp/31337"])
def test_malformed_initial_peer_exits_2_naming_the_address(tmp_path, address):
    result = run_peer("join", "--initial-peers", address, "--data-dir", str(tmp_path), timeout_s=30)
    assert result.returncode == 2, result.stderr
    assert repr(address) in result.stderr and "/p2p/" in result.stderr


def test_bad_manifest_value_exits_78_naming_the_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sync]\ninner_steps = 0\n")
    result = run_peer("join", "--run", str(path), "--data-dir", str(tmp_path))
    assert result.returncode == 78
    assert "sync.inner_steps = 0" in result.stderr and "[1, 1000000]" in result.stderr


def test_other_protocol_version_is_refused_naming_both(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("protocol_version = 99\n")
    result = run_peer("join", "--run", str(path), "--data-dir", str(tmp_path))
    assert result.returncode == 78
    assert "99" in result.stderr and f"speaks {PROTOCOL_VERSION}" in result.stderr


def test_ctrl_c_checkpoints_and_a_restart_resumes(procs, tmp_path):
    manifest = make_manifest(sync={"inner_steps": 400})
    run_file = write_manifest(tmp_path, manifest)
    peer = procs.peer("solo", "--run", str(run_file))
    peer.wait_event(lambda e: e.get("event") == "round" and e["round"] >= 1, 180)
    peer.popen.send_signal(signal.SIGINT)
    assert peer.wait(60) == 130, peer.tail()
    stopped = peer.of("stopped")[-1]
    assert stopped["interrupted"] and stopped["checkpoint"]
    with safe_open(stopped["checkpoint"], framework="pt") as f:
        meta = f.metadata()
    assert meta["run_id"] == manifest.run_id and int(meta["round"]) >= 1

    again = procs.peer("solo", "--run", str(run_file), "--max-rounds", str(int(meta["round"]) + 1))
    assert again.wait(180) == 0, again.tail()
    resumed = again.of("resumed")[0]
    assert (resumed["round"], resumed["round_step"]) == (int(meta["round"]), int(meta["round_step"]))
    assert again.of("round")[-1]["round"] == int(meta["round"]) + 1


def test_missing_data_is_reported_before_any_network_work(tmp_path):
    # The initial peer does not exist: a peer that started its DHT first would exit 69 on it.
    path = write_manifest(tmp_path, make_manifest(data={"source": "files", "path": str(tmp_path / "no-such-corpus")}))
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{SOME_PEER_ID}"
    result = run_peer(
        "join",
        "--run",
        str(path),
        "--initial-peers",
        address,
        "--data-dir",
        str(tmp_path / "peer"),
        "--log-format",
        "json",
    )
    assert result.returncode == 78, result.stderr
    assert "no-such-corpus" in result.stderr
    said = [json.loads(line)["message"] for line in result.stdout.splitlines()]
    assert said[0].startswith("peer join:") and any("reading the data" in m for m in said), said
    assert not any("DHT" in m for m in said), said


def test_peer_swarm_ends_with_the_failing_peers_code_and_reason_and_keeps_its_logs(tmp_path):
    # Only the peers read PEER_JOIN_RUN_FILE (the launcher's own run is fine): each peer fails with 78.
    bad = tmp_path / "bad.toml"
    bad.write_text("[sync]\ninner_steps = 0\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, PEER_JOIN_RUN_FILE=str(bad), TMPDIR=str(temp))
    result = subprocess.run(
        [sys.executable, "-m", "peer", "swarm", "--preset", "tiny", "--peers", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 78, result.stdout + result.stderr
    assert "error: peer-0 exited with code 78: " in result.stderr and "sync.inner_steps = 0" in result.stderr, (
        result.stderr
    )
    kept = [
        line.removeprefix("logs kept in ") for line in result.stdout.splitlines() if line.startswith("logs kept in")
    ]
    assert len(kept) == 1 and Path(kept[0]).parent == temp, result.stdout
    assert "sync.inner_steps = 0" in (Path(kept[0]) / "peer-0.log").read_text()
