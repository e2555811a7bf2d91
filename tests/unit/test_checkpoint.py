import os

import pytest
import torch

from peer import checkpoint as ckpt
from peer.checkpoint import PeerState, load_checkpoint, save_checkpoint
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
