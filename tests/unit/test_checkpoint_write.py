"""peer/state/checkpoint.py writes through a private directory beside the file: writers sharing a
directory (in-process peers of one test, a checkpoint and a φ export) never remove each other's
file under way, and what a killed process left is removed by the next write."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch
from safetensors.torch import load_file

from peer.state.checkpoint import CheckpointFile, export_phi, write_checkpoint


def file_of(value: float, n: int = 2_000_000) -> CheckpointFile:
    return CheckpointFile(tensors={"x": torch.full((n,), value)}, metadata={"v": str(value)}, live=frozenset())


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_writers_sharing_a_directory_each_land_their_file(tmp_path):
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(5):
                write_checkpoint(tmp_path / f"peer{i}.ckpt", file_of(float(i)))
                export_phi(
                    tmp_path / f"export{i}", names=["x"], phi=[torch.full((1000,), float(i))], run_id="r", round_=1
                )
        except BaseException as exc:  # reported below
            errors.append(exc)

    (tmp_path / "export0").mkdir()
    (tmp_path / "export1").mkdir()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert torch.equal(load_file(str(tmp_path / f"peer{i}.ckpt"))["x"], torch.full((2_000_000,), float(i)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export0", "export1", "peer0.ckpt", "peer1.ckpt"]


def test_a_killed_writers_leftovers_go_and_a_live_ones_stay(tmp_path):
    dead = tmp_path / f".peer.ckpt.tmp{dead_pid()}"
    dead.mkdir()
    (dead / "peer.ckpt").write_bytes(b"torn")
    old_style = tmp_path / ".tmpAbC123"
    old_style.write_bytes(b"torn")
    live = tmp_path / f".other.ckpt.tmp{os.getppid()}"  # a live process's write under way
    live.mkdir()
    write_checkpoint(tmp_path / "peer.ckpt", file_of(1.0, n=10))
    assert not dead.exists() and not old_style.exists()
    assert live.is_dir()
    assert load_file(str(tmp_path / "peer.ckpt"))["x"].tolist() == [1.0] * 10


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_private_directory(tmp_path, monkeypatch):
    import peer.state.checkpoint as checkpoint

    path = tmp_path / "peer.ckpt"
    write_checkpoint(path, file_of(1.0, n=10))

    def broken(f, t):  # the disk fills up in the middle of the tensor data
        f.write(b"\0" * 16)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("peer.state.safetensors_stream._write_one", broken)
    try:
        write_checkpoint(path, file_of(2.0, n=10))
    except checkpoint.CheckpointError as exc:
        assert "No space left on device" in str(exc) and "previous one is intact" in str(exc)
    else:
        raise AssertionError("the failed write raised nothing")
    assert load_file(str(path))["x"].tolist() == [1.0] * 10
    assert [p.name for p in tmp_path.iterdir()] == ["peer.ckpt"]
