"""A run whose model is larger than this machine's free memory is refused in one line, exit 78, by
``peer doctor`` and by ``peer join`` before either builds the model (issue #67, item 5): real CLI
processes, a run manifest of a model of about a trillion parameters (4 TB in fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from peer.state.memory_check import host_available_bytes

HUGE_RUN = """
name = "huge"

[model]
hidden_size = 16384
num_layers = 256
num_heads = 128
num_kv_heads = 128
intermediate_size = 65536
"""


def huge_run(tmp_path: Path) -> Path:
    path = tmp_path / "huge.toml"
    path.write_text(HUGE_RUN)
    return path


def assert_refused(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode == 78, result.stdout + result.stderr
    lines = [line for line in text.splitlines() if "not enough memory for run 'huge'" in line]
    assert len(lines) == 1, text
    line = lines[0]
    assert "parameters) on this CPU peer: it needs " in line and " GiB of host RAM" in line
    assert host_available_bytes() is not None and " GiB of RAM available: " in line, line
    assert "--preset" in line and "close other programs" in line


def test_peer_doctor_refuses_a_model_larger_than_free_memory_before_building_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "peer", "doctor", "--run", str(huge_run(tmp_path)), "--device", "cpu", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_refused(result, result.stdout)
    assert "problem: not enough memory" in result.stdout
    assert "building the model" not in result.stderr  # refused before the model was built


def test_peer_join_refuses_a_model_larger_than_free_memory_before_building_it(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer",
            "join",
            "--run",
            str(huge_run(tmp_path)),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_refused(result, result.stdout + result.stderr)
    assert not list((tmp_path / "data").rglob("checkpoint.safetensors"))


def doctor_json(*flags: str) -> dict:
    command = [sys.executable, "-m", "peer", "doctor", "--device", "cpu", "--steps", "1", "--json"]  # the default run
    result = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_peer_doctor_checks_the_micro_batch_its_refusal_suggests():
    """The refusal says "a smaller --micro-batch": doctor takes it (as peer join does), sizes the
    memory need and trains its timed steps with it."""
    whole, small = doctor_json(), doctor_json("--micro-batch", "1")
    assert small["micro_batch"] == 1 and whole["micro_batch"] > 1, (whole["micro_batch"], small["micro_batch"])
    assert small["memory_host_need_gib"] < whole["memory_host_need_gib"]
