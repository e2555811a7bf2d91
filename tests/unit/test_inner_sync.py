"""The inner step's one host sync (fused AdamW, as on CUDA): non-finite steps are skipped on the
device, found at the step's end, and leave θ and AdamW as they were. Run on the CPU through the
``fused_adamw`` seam (fused AdamW runs on the CPU too)."""

import copy

import pytest
import torch

from peer.train.inner import InnerLoop
from peer.train.model import build_model
from protocol.errors import BadPayload
from protocol.presets import tiny_run
from tests.unit.samplers import Fixed

RUN = tiny_run()
SPEC = RUN.inner_optimizer


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr("peer.train.inner.fused_adamw", lambda device: True)


def batch(rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 259, (rows, RUN.data.seq_len_tokens + 1), generator=g)


def loop_of(model=None):
    return InnerLoop(model if model is not None else build_model(RUN.model), SPEC, Fixed(batch()))


class ReadsAsItGoes(InnerLoop):
    """The same fused AdamW, the loss read as soon as it is computed (the path without the skip)."""

    def _forward_backward(self, batch):
        return float(super()._forward_backward(batch))


def trained_then_gradient(value: float):
    """A loop after one step whose embedding gradient is ``value`` from now on; and the hook doing it."""
    loop = loop_of()
    loop.step(0)
    hook = loop.model.get_input_embeddings().weight.register_hook(lambda grad: torch.full_like(grad, value))
    return loop, hook


def snapshot(loop):
    return [p.detach().clone() for p in loop.params], copy.deepcopy(loop.optimizer.state_dict())


def assert_unchanged(loop, before):
    params, optimizer = before
    for p, q in zip(loop.params, params):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, equal_nan=True)  # the planted NaN stays
    after = loop.optimizer.state_dict()["state"]
    for key, state in optimizer["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(after[key][name], value, rtol=0, atol=0, equal_nan=True, msg=name)


def test_the_one_sync_step_trains_exactly_as_reading_the_loss_at_once(fused):
    model = build_model(RUN.model)
    one_sync, at_once = loop_of(copy.deepcopy(model)), ReadsAsItGoes(copy.deepcopy(model), SPEC, Fixed(batch()))
    assert one_sync.fused and at_once.fused
    for k in range(3):
        a, b = one_sync.step(k), at_once.step(k)
        assert isinstance(a.loss, float) and a.loss == b.loss
    assert all(torch.equal(p, q) for p, q in zip(one_sync.params, at_once.params))


def test_a_non_finite_loss_is_skipped_on_the_device_and_raised_at_the_step_end(fused):
    loop = loop_of()
    loop.step(0)
    with torch.no_grad():
        loop.model.get_input_embeddings().weight[:, 0] = float("nan")  # every token's embedding
    before = snapshot(loop)
    with pytest.raises(BadPayload, match="training loss is nan at inner step 1"):
        loop.step(1)
    assert_unchanged(loop, before)
    assert all(p.grad is None for p in loop.params)


def test_a_non_finite_gradient_under_a_finite_loss_is_skipped_too(fused):
    loop, hook = trained_then_gradient(float("inf"))
    before = snapshot(loop)
    with pytest.raises(BadPayload, match="gradient norm is (inf|nan) at inner step 1"):
        loop.step(1)
    assert_unchanged(loop, before)
    hook.remove()
    loop.step(2)  # trains on afterwards: the skipped step left nothing behind
    assert not all(torch.equal(p, q) for p, q in zip(loop.params, before[0]))


def test_steps_not_waited_for_train_the_same_and_settle_reads_their_losses(fused):
    model = build_model(RUN.model)
    queued, waited = loop_of(copy.deepcopy(model)), loop_of(copy.deepcopy(model))
    results = [queued.step(k, wait=False) for k in range(3)]
    assert all(r.loss != r.loss for r in results)  # NaN: not read yet
    losses = queued.settle()
    assert losses == [waited.step(k).loss for k in range(3)]
    assert queued.settle() == []
    assert all(torch.equal(p, q) for p, q in zip(queued.params, waited.params))


def test_settle_names_the_first_bad_step_and_the_others_still_trained(fused):
    loop, hook = trained_then_gradient(float("nan"))
    before = snapshot(loop)
    loop.step(1, wait=False)  # skipped on the device
    hook.remove()
    after_bad = snapshot(loop)
    loop.step(2, wait=False)  # trains
    with pytest.raises(BadPayload, match="gradient norm is nan at inner step 1"):
        loop.settle()
    torch.testing.assert_close(after_bad[0], before[0], rtol=0, atol=0)
    assert not all(torch.equal(p, q) for p, q in zip(loop.params, before[0]))
    assert int(loop.optimizer.state[loop.params[0]]["step"]) == 2  # steps 0 and 2
