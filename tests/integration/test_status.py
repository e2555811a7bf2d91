"""What an operator checks from outside with `peer status`: the swarm's peers, read from the DHT
without training, a killed peer shown gone within one round's deadline (and by the monitor too),
or exit 69 when the bootstrap node cannot be reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from peer.launch import bootstrap_argv
from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``peer ARGS`` with its stdout a pipe, as ``peer status > file`` (no COLUMNS: rich's own width)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, "-m", "peer", *args], capture_output=True, text=True, env=env, timeout=timeout_s
    )


def test_status_lists_the_peers_without_training(procs, tmp_path):
    manifest = make_manifest()
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    rounds = 2
    peers = [
        procs.peer(f"peer-{i}", "--initial-peers", addr, "--max-rounds", str(rounds), "--wait-for-peers", "2")
        for i in range(2)
    ]
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
    # piped: every column whole (issue #68 item 6), one line per peer; the swarm's round is the median
    header = next(line for line in table.stdout.splitlines() if "peer id" in line)
    for column in ("status", "device", "round", "inner step", "train loss", "val loss @ round", "record age"):
        assert column in header, table.stdout
    for peer_id in ids:
        [row] = [line for line in table.stdout.splitlines() if peer_id in line]
        assert " live " in row, table.stdout
    assert "…" not in table.stdout and "swarm: median round " in table.stdout, table.stdout
    # what it does, said on stderr as it goes: no silent wait (issue #68 item 4)
    said = [line for line in table.stderr.splitlines() if line.startswith("peer status: ")]
    assert [line.split(",")[0] for line in said] == [
        "peer status: loading hivemind",
        "peer status: starting a client DHT node",
        "peer status: reading the runs and the peers' progress records",
    ], table.stderr


def status_json(addr: str, run_id: str) -> dict:
    out = run_cli("status", "--initial-peers", addr, "--run-id", run_id, "--json")
    assert out.returncode == 0, out.stderr
    [run] = json.loads(out.stdout)["runs"]
    return run


def monitor_run(base: str, run_id: str) -> dict:
    with urllib.request.urlopen(base + "api/swarm", timeout=10) as r:
        snap = json.loads(r.read())
    return next(r for r in snap["runs"] if r["run_id"] == run_id)


def test_a_killed_peer_is_shown_gone_within_one_round_deadline(procs, tmp_path):
    """kill -9 of a whole peer (its DHT and p2pd too): its record stays in the DHT until it expires,
    but `peer status` and the monitor show the peer gone once the record is older than the bound
    (protocol/liveness.py), and the swarm totals drop its throughput."""
    # Short sync deadlines, so that the bound (worst-case sync + 2 refresh intervals + 5 s) is
    # well under a minute while the record lives max(60 s, 3 worst-case syncs).
    manifest = make_manifest(
        sync={
            "matchmaking_time_s": 2.0,
            "allreduce_timeout_s": 5.0,
            "min_allreduce_timeout_s": 2.0,
            "next_chunk_timeout_s": 2.0,
        }
    )
    boot = procs.spawn(
        "bootstrap",
        bootstrap_argv(
            identity=tmp_path / "bootstrap.key",
            run=write_manifest(tmp_path, manifest),
            extra=["--monitor-port", "0", "--monitor-poll", "0.5"],
        ),
    )
    ready = boot.wait_event(lambda e: e.kind == "ready", 60)
    addr, base = ready.addresses_on("127.0.0.1")[0], ready["monitor_url"]
    survivor, victim = [procs.peer(f"peer-{i}", "--initial-peers", addr, "--wait-for-peers", "2") for i in range(2)]
    survivor_id = survivor.wait_event(lambda e: e.kind == "started", 120)["peer_id"]
    victim_id = victim.wait_event(lambda e: e.kind == "started", 120)["peer_id"]
    for p in (survivor, victim):
        p.wait_event(lambda e: e.kind == "round" and e.round >= 2, 180)

    before = {p["peer_id"]: p for p in status_json(addr, manifest.run_id)["peers"]}
    assert before[victim_id]["live"] and before[survivor_id]["live"], before
    bound = before[victim_id]["stale_after_s"]
    mon = monitor_run(base, manifest.run_id)
    assert mon["live_peers"] == 2 and {p["peer_id"] for p in mon["peers"] if p["live"]} == {victim_id, survivor_id}
    assert bound < before[victim_id]["expires_in_s"] + before[victim_id]["age_s"]  # sooner than the ttl

    victim.kill()  # SIGKILL to its process group: no last record, no goodbye
    deadline = time.monotonic() + bound + 60  # the bound, plus the status command's own start-up
    shown_gone = False
    while not shown_gone and time.monotonic() < deadline:
        run = status_json(addr, manifest.run_id)
        peers = {p["peer_id"]: p for p in run["peers"]}
        assert victim_id in peers, f"the record expired before the peer was shown gone: {run}"
        shown_gone = not peers[victim_id]["live"]
        if not shown_gone:
            time.sleep(2)
    assert shown_gone, f"the killed peer still shown live after {bound + 60:.0f} s: {run}"
    assert peers[victim_id]["age_s"] > bound and peers[victim_id]["expires_in_s"] > 0
    assert peers[survivor_id]["live"], run
    assert (run["live_peers"], run["tokens_per_s"]) == (1, peers[survivor_id]["tokens_per_s"])

    # the monitor reads the DHT on its own poll (every 0.5 s here), not when the status command did:
    # it shows the peer gone at its next poll that lands past the bound
    for _ in range(30):
        mon = monitor_run(base, manifest.run_id)
        by_id = {p["peer_id"]: p for p in mon["peers"]}
        if not by_id[victim_id]["live"]:
            break
        time.sleep(1)
    assert not by_id[victim_id]["live"] and by_id[survivor_id]["live"], mon
    assert mon["live_peers"] == 1
    assert mon["tokens_per_s"] == by_id[survivor_id]["tokens_per_s"]
    assert sum(mon["live_by_group_size"].values()) <= 1

    table = run_cli("status", "--initial-peers", addr, "--run-id", manifest.run_id)
    assert table.returncode == 0, table.stderr
    assert f"run {manifest.run_id} ({manifest.name}): 1 live peer(s), 1 gone" in table.stdout
    assert "gone" in next(line for line in table.stdout.splitlines() if victim_id in line)


def test_status_exits_69_when_the_bootstrap_node_is_unreachable(tmp_path):
    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmV7BMfCd2mABfLwHmtsM5eQxTzqNqYpgGotFMUzKJQ5Gi"
    out = run_cli("status", "--initial-peers", addr, "--wait", "0")
    assert out.returncode == 69, (out.returncode, out.stderr)
    assert "none of the initial peers answered" in out.stderr and addr in out.stderr
