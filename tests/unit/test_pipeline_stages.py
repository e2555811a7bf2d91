"""Pipeline stages (issue #19): chained stages compute the unsplit model, loss and gradients alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peer.pipeline.stages import PipelineStage, build_stage, stage_layers, stage_parameter_names
from peer.train.model import build_model, lm_loss
from protocol.presets import tiny_run

SPEC = dataclasses.replace(tiny_run().model, num_layers=4)


def _windows(batch: int = 3, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 259, (batch, seq + 1), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("num_layers, stages", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (10, 4), (7, 3), (256, 7)])
def test_stage_layers_partition_contiguously_with_sizes_differing_by_at_most_one(num_layers, stages):
    layers = stage_layers(num_layers, stages)
    assert len(layers) == stages
    assert [i for r in layers for i in r] == list(range(num_layers))
    sizes = [len(r) for r in layers]
    assert max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes  # extras go first
    assert sizes[-1] == num_layers // stages  # the last stage (output layer) never holds an extra


def test_stage_layers_rule_and_bad_values_named():
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ValueError, match=r"stages = 0: must be in \[1, 4\]"):
        stage_layers(4, 0)
    with pytest.raises(ValueError, match=r"stages = 5: must be in \[1, 4\]"):
        stage_layers(4, 5)
    with pytest.raises(ValueError, match=r"num_layers = 0"):
        stage_layers(0, 1)
    with pytest.raises(ValueError, match=r"stage index = 2: must be in \[0, 1\]"):
        build_stage(SPEC, 2, 2)
    with pytest.raises(ValueError, match=r"stage index = -1"):
        stage_parameter_names(4, 2, -1)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_chained_stages_match_the_unsplit_model_in_loss_and_every_gradient(stages):
    windows = _windows()
    full = build_model(SPEC)
    expected = lm_loss(full, windows)
    expected.backward()

    parts = [build_stage(SPEC, stages, k) for k in range(stages)]
    # As peers would: each boundary is a detached tensor, and the gradient wrt it is sent back.
    inputs, outputs = [windows[:, :-1]], []
    for stage in parts:
        outputs.append(stage(inputs[-1]))
        inputs.append(outputs[-1].detach().requires_grad_())
    loss = parts[-1].loss(outputs[-1], windows[:, 1:])
    loss.backward()
    for k in reversed(range(stages - 1)):
        outputs[k].backward(inputs[k + 1].grad)

    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    full_grads = {n: p.grad for n, p in full.named_parameters()}
    stage_grads = {n: p.grad for stage in parts for n, p in stage.named_parameters()}
    assert stage_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(stage_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_bf16_hidden_states_are_cast_and_give_a_finite_loss():
    windows = _windows()
    first, middle, last = (build_stage(SPEC, 3, k) for k in range(3))
    hidden = first(windows[:, :-1]).to(torch.bfloat16)
    out = middle(hidden)
    assert out.dtype == torch.float32 and out.shape == (3, 12, SPEC.hidden_size)
    logits = last(out.to(torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (3, 12, 259)
    assert torch.isfinite(last.loss(logits, windows[:, 1:]))
    with pytest.raises(ValueError, match=r"stage 0 takes int64 token ids"):
        first(hidden)
    with pytest.raises(ValueError, match=r"stage 1 takes float hidden states \(batch, seq, 32\)"):
        middle(windows[:, :-1])
    with pytest.raises(ValueError, match=r"not on stage 1"):
        middle.loss(logits, windows[:, 1:])


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stage_parameters_partition_the_full_model_by_name_and_equal_it_at_init(stages):
    full = dict(build_model(SPEC).named_parameters())
    seen: list[str] = []
    for k in range(stages):
        stage = build_stage(SPEC, stages, k)
        assert isinstance(stage, PipelineStage)
        assert (stage.index, stage.stages, stage.is_first, stage.is_last) == (k, stages, k == 0, k == stages - 1)
        assert stage.layers == stage_layers(SPEC.num_layers, stages)[k]
        names = [n for n, _ in stage.named_parameters()]
        assert names == stage_parameter_names(SPEC.num_layers, stages, k)
        assert stage.state_dict().keys() == set(names)  # rotary buffers are not persistent
        for name, param in stage.named_parameters():
            assert param.dtype == torch.float32
            torch.testing.assert_close(param, full[name], atol=0, rtol=0, msg=name)
        seen += names
    assert sorted(seen) == sorted(full) and len(seen) == len(set(seen))
