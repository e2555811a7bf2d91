"""What an operator checks from outside with `peer status`: the swarm's peers, read from the DHT
without training, or exit 69 when the bootstrap node cannot be reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="250")
    return subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, env=env,
                          timeout=timeout_s)


def test_status_lists_the_peers_without_training(procs, tmp_path):
    manifest = make_manifest()
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    rounds = 2
    peers = [procs.peer(f"peer-{i}", "--initial-peers", addr, "--max-rounds", str(rounds), "--wait-for-peers", "2")
             for i in range(2)]
    ids = set()
    for p in peers:
        ids.add(p.wait_event(lambda e: e.kind == "started", 120)["peer_id"])
        p.wait_event(lambda e: e.kind == "round" and e.round >= 1, 120)

    out = run_cli("status", "--initial-peers", addr, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    [run] = status["runs"]
    assert (run["run_id"], run["name"]) == (manifest.run_id, manifest.name)
    assert {p["peer_id"] for p in run["peers"]} == ids  # the status node itself is no peer
    for p in run["peers"]:
        assert 1 <= p["round"] <= rounds, p
        assert p["expires_in_s"] > 0, p
        assert p["inner_step"] >= p["round"] * manifest.sync.inner_steps

    table = run_cli("status", "--initial-peers", addr, "--run-id", manifest.run_id)
    assert table.returncode == 0, table.stderr
    assert f"run {manifest.run_id} ({manifest.name}): 2 live peer(s)" in table.stdout
    for peer_id in ids:
        assert peer_id in table.stdout


def test_status_exits_69_when_the_bootstrap_node_is_unreachable(tmp_path):
    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmV7BMfCd2mABfLwHmtsM5eQxTzqNqYpgGotFMUzKJQ5Gi"
    out = run_cli("status", "--initial-peers", addr, "--wait", "0")
    assert out.returncode == 69, (out.returncode, out.stderr)
    assert "none of the initial peers answered" in out.stderr and addr in out.stderr
