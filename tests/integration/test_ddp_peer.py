"""A peer on two devices (`peer join --device cpu,cpu`: two CPU ranks over gloo, peer/train/ddp.py)
is one peer of the swarm: it trains exactly as a one-device peer with the same micro-batches, and
its rank process dies with it.

Real processes, no mocks. The two-rank peer and a one-device peer with ``--micro-batch 4`` (half
of the tiny run's 8 sequences, the share of each rank) run alone, one after the other, with the
same identity (so the same data order) and one torch thread per rank: their checkpoints (θ, φ,
outer momentum, AdamW state) must be equal bit for bit (tests/unit/test_ddp.py says why the
arithmetic is the same).
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peer.launch import Child, peer_argv, stop_all
from peer.net import lifetime

# each test starts one or two whole peers (DHT, corpus, a spawned rank): minutes on a loaded 2-core box
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


def spawn_children(pid: int) -> list[int]:
    """Rank processes below ``pid``: children started by multiprocessing's spawn method."""
    found = []
    for child in lifetime.children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(child)
        except OSError:
            pass
    return found


def running(pid: int) -> bool:
    stat = lifetime.proc_stat(pid)
    return stat is not None and stat[1] != "Z"


def peer(tmp_path: Path, name: str, *args: str) -> Child:
    child = Child(
        name,
        peer_argv(data_dir=tmp_path / name, extra=["--preset", "tiny", "--eval-every", "0", *args]),
        log_path=tmp_path / f"{name}.log",
        cwd=tmp_path,
    )
    return child.start()


def checkpoint(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    [path] = (tmp_path / name / "runs").glob("*/checkpoint.safetensors")
    return load_file(str(path))


def test_two_ranks_train_as_one_device_with_half_the_batch_per_micro_batch(tmp_path):
    children = []
    try:
        two = peer(tmp_path, "two", "--device", "cpu,cpu", "--threads", "2", "--max-rounds", "2")
        children.append(two)
        started = two.wait_event(lambda e: e.kind == "started", 900)
        assert started["ranks"] == 2 and started["device"] == "cpu,cpu"
        assert two.wait(900) == 0, two.tail()
        assert two.last("stopped")["rounds_completed"] == 2

        (tmp_path / "one").mkdir()
        for key in ("identity.key", "owner.key"):  # the same peer id, so the same data order
            if (tmp_path / "two" / key).exists():
                shutil.copy2(tmp_path / "two" / key, tmp_path / "one" / key)
        one = peer(tmp_path, "one", "--device", "cpu", "--micro-batch", "4", "--threads", "1", "--max-rounds", "2")
        children.append(one)
        assert one.wait(900) == 0, one.tail()
    finally:
        stop_all(children, 20.0)
    a, b = checkpoint(tmp_path, "two"), checkpoint(tmp_path, "one")
    assert a.keys() == b.keys() and any("adam" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == [], f"the two-rank peer's checkpoint differs from the one-device peer's in {different}"


def test_the_rank_process_dies_with_the_peer(tmp_path):
    two = peer(tmp_path, "killed", "--device", "cpu,cpu", "--threads", "2")
    try:
        two.wait_event(lambda e: e.kind == "round", 900)
        ranks = spawn_children(two.popen.pid)
        assert len(ranks) == 1, f"expected one spawned rank process, found {ranks}"
        two.send(signal.SIGKILL)
        assert two.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while running(ranks[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(ranks[0]), "the rank process outlived its killed peer"
    finally:
        stop_all([two], 20.0)


def test_a_stopped_peer_stops_its_ranks(tmp_path):
    two = peer(tmp_path, "stopped", "--device", "cpu,cpu", "--threads", "2")
    try:
        two.wait_event(lambda e: e.kind == "round", 900)
        ranks = spawn_children(two.popen.pid)
        two.send(signal.SIGINT)
        assert two.wait(60) == 130, two.tail()
        assert "Traceback" not in (tmp_path / "stopped.log").read_text(errors="replace")
        assert not any(running(pid) for pid in ranks)
    finally:
        stop_all([two], 20.0)
