"""`peer doctor --initial-peers`: whether the swarm answers, can dial this machine back, and the
uplink to it, checked with a real DHT node.

Real processes, no mocks: a bootstrap node is the swarm for the reachable case; a port nothing
listens on is the unreachable one.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.integration.harness import make_manifest, write_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SOME_ID = "12D3KooWKypwB8ARFtvZsniHQMbzHYKNEM9Eaov1exVoCKYt5P8z"


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer", "doctor", "--preset", "tiny", "--device", "cpu", "--steps", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_swarm_that_does_not_answer_exits_69_saying_what_to_do():
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_ID}"
    result = doctor("--initial-peers", address)
    assert result.returncode == 69, result.stdout + result.stderr
    assert "swarm: no initial peer answered" in result.stdout
    problem = [line for line in result.stdout.splitlines() if line.startswith("problem:")]
    assert problem and "check the address" in problem[0], result.stdout
    assert "throughput:" in result.stdout  # the local checks still ran


def test_a_live_swarm_answers(procs, tmp_path):
    _, address = procs.bootstrap(write_manifest(tmp_path, make_manifest()))
    result = doctor("--initial-peers", address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "swarm: an initial peer answered" in result.stdout
    assert "dialable: reachable: 1 peer(s) of the swarm dialed this peer back at /ip4/127.0.0.1/tcp/" in result.stdout
    [uplink] = [line for line in result.stdout.splitlines() if line.startswith("uplink:")]
    assert "Mbit/s" in uplink and "MiB in" in uplink, result.stdout  # random bytes, timed to the node's answer
    assert "ok: this peer can contribute" in result.stdout
    # each check said on stderr as it starts (issue #68 item 4), in the order they run; the report on stdout
    said = [line for line in result.stderr.splitlines() if line.startswith("peer doctor: ")]
    checks = [
        "peer doctor: loading torch",
        "peer doctor: starting a DHT node on ",
        "peer doctor: asking the swarm to dial this machine back",
        "peer doctor: measuring the uplink to the swarm",
        "peer doctor: looking for the run the swarm announces",
        "peer doctor: checking the device (cpu",
        "peer doctor: building the model of run 'tiny' on cpu",
        "peer doctor: timing the inner steps: one to warm up, then 1",
    ]
    assert len(said) == len(checks) and all(map(str.startswith, said, checks)), result.stderr
    assert not any(line.startswith("peer doctor: ") for line in result.stdout.splitlines())


def test_the_json_report_carries_the_network_facts(procs, tmp_path):
    import json

    _, address = procs.bootstrap(write_manifest(tmp_path, make_manifest()))
    result = doctor("--initial-peers", address, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    facts = json.loads(result.stdout)
    assert facts["reachability"] == "reachable" and facts["uplink_mbit_s"] > 0 and facts["uplink_bytes"] >= 2**20
