"""A restart's checkpoint check (peer/state/checkpoint.py ``load_checkpoint``): one finiteness test
of every tensor it takes, still refusing a non-finite or misshapen one by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peer.state.checkpoint import PeerState, encode_checkpoint, load_checkpoint, write_checkpoint
from protocol.errors import CheckpointError

NAMES = ["a.weight", "b.bias"]
SHAPES = [torch.Size([3, 2]), torch.Size([4])]


def state() -> PeerState:
    def group(k):
        return [torch.full(s, float(k + i)) for i, s in enumerate(SHAPES)]

    return PeerState(
        run_id="r",
        round=2,
        inner_step=10,
        round_step=0,
        round_tokens=0,
        names=NAMES,
        phi=group(0),
        momentum=group(1),
        theta=group(2),
        adam_exp_avg=group(3),
        adam_exp_avg_sq=group(4),
        residuals=group(5),
    )


def written(tmp_path, **replace_tensors):
    file = encode_checkpoint(state())
    path = tmp_path / "checkpoint.safetensors"
    write_checkpoint(path, dataclasses.replace(file, tensors={**file.tensors, **replace_tensors}))
    return path


def test_every_group_loads_as_written(tmp_path):
    loaded = load_checkpoint(written(tmp_path), run_id="r", names=NAMES, shapes=SHAPES)
    want = state()
    for field in ("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq", "residuals"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(loaded, field), getattr(want, field))), field


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("theta.b.bias", float("nan")),
        ("momentum.a.weight", float("inf")),
        ("adam_exp_avg_sq.b.bias", float("-inf")),
        ("residual.a.weight", float("nan")),
        ("phi.b.bias", float("nan")),
    ],
)
def test_a_non_finite_tensor_is_refused_by_name(tmp_path, key, value):
    shape = SHAPES[NAMES.index(key.split(".", 1)[1])]
    bad = torch.zeros(shape)
    bad.view(-1)[-1] = value
    with pytest.raises(CheckpointError, match=rf"tensor {key} has shape .* or non-finite values"):
        load_checkpoint(written(tmp_path, **{key: bad}), run_id="r", names=NAMES, shapes=SHAPES)


def test_finite_values_whose_sums_overflow_are_no_error(tmp_path):
    big = torch.full(SHAPES[0], 3e38)
    loaded = load_checkpoint(written(tmp_path, **{"theta.a.weight": big}), run_id="r", names=NAMES, shapes=SHAPES)
    assert torch.equal(loaded.theta[0], big)


def test_a_misshapen_tensor_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match=r"tensor momentum.b.bias has shape \(5,\) or non-finite"):
        load_checkpoint(
            written(tmp_path, **{"momentum.b.bias": torch.zeros(5)}), run_id="r", names=NAMES, shapes=SHAPES
        )
