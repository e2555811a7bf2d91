import os

import pytest
import torch

from peer.state import checkpoint as ckpt
from peer.state.checkpoint import PeerState, load_checkpoint, save_checkpoint
from protocol.errors import CheckpointError

NAMES = ["a.weight", "b.bias"]
SHAPES = [torch.Size([3, 2]), torch.Size([4])]


def make_state(round_=3, fill=1.0):
    t = [torch.full(s, fill) for s in SHAPES]
    return PeerState(run_id="r" * 32, round=round_, inner_step=round_ * 5 + 2, round_step=2, round_tokens=512,
                     names=NAMES, phi=t, momentum=[x * 2 for x in t], theta=[x * 3 for x in t],
                     adam_exp_avg=[x * 4 for x in t], adam_exp_avg_sq=[x * 5 for x in t], adam_step=17)


def test_round_trip(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    state = load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)
    assert (state.round, state.round_step, state.round_tokens, state.adam_step) == (3, 2, 512, 17)
    torch.testing.assert_close(state.theta[0], torch.full((3, 2), 3.0))
    torch.testing.assert_close(state.adam_exp_avg_sq[1], torch.full((4,), 5.0))


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state(round_=1))

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(CheckpointError, match="previous one is intact"):
        save_checkpoint(path, make_state(round_=2, fill=9.0))
    monkeypatch.undo()
    assert load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES).round == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left


def test_truncated_file_is_an_actionable_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)


def test_other_run_or_model_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    with pytest.raises(CheckpointError, match="belongs to run"):
        load_checkpoint(path, run_id="x" * 32, names=NAMES, shapes=SHAPES)
    with pytest.raises(CheckpointError, match="different model"):
        load_checkpoint(path, run_id="r" * 32, names=["other"], shapes=SHAPES[:1])
    assert os.path.exists(path)


WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
from peer.state.checkpoint import PeerState, save_checkpoint
shape = torch.Size([256, 256])
for i in range(10**9):
    t = [torch.full(shape, float(i))]
    save_checkpoint({path!r}, PeerState(run_id="r" * 32, round=i, inner_step=i, round_step=0, round_tokens=0,
                                        names=["w"], phi=t, momentum=t, theta=t))
    print(i, flush=True)
"""


def test_kill_9_during_writes_never_leaves_a_torn_checkpoint(tmp_path):
    """A writer process saving in a loop is SIGKILLed at random moments; every time, the file on
    disk loads and is one whole round (all tensors of the same round), never a torn one."""
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    path = tmp_path / "c.safetensors"
    rng = random.Random(0)
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root, path=str(path))],
                                stdout=subprocess.PIPE, text=True)
        for _ in range(1 + trial):  # let it finish a few writes, so a kill can land mid-write
            assert proc.stdout.readline(), "writer died"
        time_ms = rng.uniform(0, 40)
        try:
            proc.wait(timeout=time_ms / 1000)
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        state = load_checkpoint(path, run_id="r" * 32, names=["w"], shapes=[torch.Size([256, 256])])
        value = float(state.phi[0][0, 0])
        assert all(float(t.min()) == float(t.max()) == value for t in (state.phi[0], state.momentum[0], state.theta[0]))
        assert state.round == int(value)
    # the next write clears what the killed writes left behind
    save_checkpoint(path, make_state())
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
