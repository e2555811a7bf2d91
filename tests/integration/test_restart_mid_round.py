"""Ctrl-C inside a round, then the same command again, while another peer trains on (issue #68 item 3):
the restart resumes at the inner step it stopped at and, the swarm having gone further in that round
meanwhile, joins the swarm's step rather than finishing its own round behind it. Real peer processes
on loopback; what is checked is what the restarted peer says and its checkpoint holds, not timings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors import safe_open

from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration

H = 1600
"""Inner steps of a round: b publishes its progress every H/4 steps and must still be in round 0 when
a is back (a 2,048-token batch of the tiny model: tens of ms a step, a round about a minute)."""


def b_step(addr: str, b_id: str, run_id: str) -> tuple[int, int, float]:
    """b's (round, cumulative inner step, tokens/s) as its last progress record says (`peer status`)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-m", "peer", "status", "--initial-peers", addr, "--json", "--run-id", run_id],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    [run] = json.loads(out.stdout)["runs"]
    [b] = [p for p in run["peers"] if p["peer_id"] == b_id] or [{"round": -1, "inner_step": -1, "tokens_per_s": 0.0}]
    return b["round"], b["inner_step"], b["tokens_per_s"]


def test_ctrl_c_mid_round_then_the_same_command_resumes_there_and_joins_the_swarms_step(procs, tmp_path):
    manifest = make_manifest(inner_optimizer={"batch_size_tokens": 2048}, sync={"inner_steps": H})
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    a, b = (procs.peer(n, "--initial-peers", addr, "--wait-for-peers", "2") for n in ("a", "b"))
    b_id = b.wait_event(lambda e: e.kind == "started", 180)["peer_id"]
    # the initial evaluation is reported after the inner step it finished in: a is inside round 0
    a.wait_event(lambda e: e.kind == "eval" and e.get("when") == "initial", 180)
    a.popen.send_signal(signal.SIGINT)
    assert a.wait(60) == 130, a.tail()
    with safe_open(a.of("stopped")[-1]["checkpoint"], framework="pt") as f:
        meta = f.metadata()
    k = int(meta["round_step"])
    assert (int(meta["round"]), int(meta["inner_step"])) == (0, k) and 0 < k < H // 4, meta

    # b trains on: wait until its record (one every H/4 steps) says it went past a's step in round 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        round_, step, tokens_per_s = b_step(addr, b_id, manifest.run_id)
        if round_ == 0 and step > k and tokens_per_s > 0:
            break
        assert round_ <= 0, "b finished round 0 before a came back: make H larger"
        time.sleep(2)
    else:
        pytest.fail(f"b published no record past inner step {k} of round 0: {b.tail()}")

    again = procs.peer("a", "--initial-peers", addr)  # the same command
    joined = again.wait_event(lambda e: e.kind == "status" and "joining it there" in e.get("message", ""), 180)
    resumed = again.of("resumed")[0]
    assert (resumed["round"], resumed["round_step"], resumed["batches_drawn"]) == (0, k, k)
    assert not again.of("adopted_state"), again.tail()  # the same round: nothing downloaded
    assert not b.of("round"), "b left round 0 before a joined it: make H larger"
    assert f"joining it there from step {k}," in joined["message"], joined
    start = again.wait_event(
        lambda e: e.kind == "status" and e.get("message", "").startswith("training from round 0, inner step "), 60
    )
    s = int(start["message"].split("inner step ")[1].split(" of ")[0])
    assert k < step <= s < H, (start, step)  # at least where b's record put b: never behind it
    assert f"inner step {s} of {H} of round 0" in joined["message"]
    again.popen.send_signal(signal.SIGINT)
    assert again.wait(60) == 130, again.tail()
