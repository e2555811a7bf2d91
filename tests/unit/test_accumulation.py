"""The inner loop on a peer's device: gradient accumulation over micro-batches, the out-of-memory
back-off, the fp16 scaler and bf16 paths on the CPU, and the compile fallback (peer/train/inner.py)."""

import copy
import logging

import pytest
import torch

from peer.train.inner import InnerLoop
from peer.train.model import build_model
from peer.train.precision import BF16, FP16
from protocol.errors import ConfigError
from protocol.presets import tiny_run
from tests.unit.samplers import Fixed

RUN = tiny_run()
SPEC = RUN.inner_optimizer


def batch(rows=8, seed=0):
    return torch.randint(0, 256, (rows, RUN.data.seq_len_tokens + 1), generator=torch.Generator().manual_seed(seed))


def grads(loop):
    return [p.grad.clone() for p in loop.params]


@pytest.mark.parametrize("micro", [1, 3, 4, 7])
def test_accumulated_gradients_equal_one_big_batch(micro):
    whole = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()))
    split = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()), micro_batch_sequences=micro)
    a, b = whole.step(0), split.step(0)
    assert a.loss == pytest.approx(b.loss, abs=1e-6)
    assert b.micro_batch == micro and a.micro_batch == 8
    for g, h in zip(grads(whole), grads(split)):  # clipped alike: the norms agree too
        torch.testing.assert_close(h, g, atol=1e-6, rtol=1e-6)
    for p, q in zip(whole.params, split.params):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6)


class OutOfMemoryAbove(InnerLoop):
    """Raises CUDA's out-of-memory error in a step whose micro-batch exceeds ``fits`` sequences."""

    fits = 2

    def _accumulate(self, windows):
        if (self.micro_batch_sequences or windows.shape[0]) > self.fits:
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.params:  # a partial backward left gradients behind when memory ran out
                p.grad = torch.ones_like(p)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return super()._accumulate(windows)


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_step(caplog):
    sampler = Fixed(batch(), batch(seed=1))
    loop = OutOfMemoryAbove(build_model(RUN.model), SPEC, sampler)
    reference = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch(), batch(seed=1)))
    with caplog.at_level(logging.WARNING, logger="peer.train.inner"):
        result = loop.step(0)
    assert result.micro_batch == 2 and loop.oom_backoffs == 2  # 8 → 4 → 2
    assert sampler.batches_drawn == 1  # the same batch, redone: no data skipped
    assert "redoing the step at 4" in caplog.text and "redoing the step at 2" in caplog.text
    ref = reference.step(0)
    assert result.loss == pytest.approx(ref.loss, abs=1e-6)
    for p, q in zip(loop.params, reference.params):  # the injected partial gradients did not leak in
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert loop.step(1).micro_batch == 2 and loop.oom_backoffs == 2  # stays at what fits


def test_out_of_memory_at_one_sequence_is_a_config_error_and_leaves_theta():
    loop = OutOfMemoryAbove(build_model(RUN.model), SPEC, Fixed(batch()))
    loop.fits = 0
    before = [p.detach().clone() for p in loop.params]
    with pytest.raises(ConfigError, match="one sequence per micro-batch"):
        loop.step(0)
    assert all(torch.equal(p, q) for p, q in zip(loop.params, before))


@pytest.mark.parametrize("fits,micro", [(8, 8), (7, 4), (5, 4), (4, 4), (3, 3), (1, 1)])
def test_the_probed_micro_batch_is_evened_out_over_the_fewest_micro_batches(monkeypatch, fits, micro):
    # 8 sequences that fit 7 at a time run as 2 × 4: one shape for torch.compile, not 7 + 1
    monkeypatch.setattr("peer.train.inner.probe_micro_batch", lambda try_step, *, upper, margin: fits)
    loop = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()))
    loop.device = torch.device("cuda")  # the probe is faked: nothing touches CUDA
    assert loop.fit_micro_batch(budget_bytes=1.0) == micro == loop.micro_batch_sequences


def test_fp16_with_a_gradient_scaler_trains_on_cpu():
    loop = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()), precision=FP16, micro_batch_sequences=4)
    assert loop.scaler is not None and loop.scaler.is_enabled()
    losses = [loop.step(k).loss for k in range(8)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in loop.params)  # master weights fp32
    assert loop.state_dict()["exp_avg"][0].dtype == torch.float32


def test_fp16_overflow_skips_the_update_instead_of_failing():
    loop = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()), precision=FP16)
    loop.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # scaled gradients overflow fp32
    before = [p.detach().clone() for p in loop.params]
    loop.step(0)
    assert all(torch.equal(p, q) for p, q in zip(loop.params, before))
    assert loop.scaler.get_scale() < 2.0**127


def test_bf16_autocast_on_cpu_stays_close_to_fp32():
    fp32 = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()))
    bf16 = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch()), precision=BF16)
    assert bf16.scaler is None
    a, b = fp32.step(0), bf16.step(0)
    assert b.loss == pytest.approx(a.loss, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in bf16.params)


def failing_backend(graph_module, example_inputs):
    raise RuntimeError("no C++ compiler on this machine (injected)")


def test_a_compile_failure_falls_back_to_eager_with_one_warning(caplog):
    import torch._dynamo

    torch._dynamo.reset()
    model = build_model(RUN.model)
    eager = InnerLoop(copy.deepcopy(model), SPEC, Fixed(batch()))
    loop = InnerLoop(model, SPEC, Fixed(batch()), compile=True, compile_backend=failing_backend)
    assert loop.compiled
    with caplog.at_level(logging.WARNING, logger="peer.train.inner"):
        result = loop.step(0)
        loop.step(1)
    assert not loop.compiled
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "torch.compile failed" in caplog.records[0].message and len(caplog.records) == 1
    assert result.loss == pytest.approx(eager.step(0).loss, abs=1e-6)


def test_activation_checkpointing_gives_the_same_step_and_keeps_less():
    """Recomputed activations: the same loss, gradients and update as kept ones; fewer tensors saved
    for the backward (counted with saved-tensor hooks, the CPU stand-in for a card's memory)."""
    kept = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch(), batch(seed=1)))
    recomputed = InnerLoop(build_model(RUN.model), SPEC, Fixed(batch(), batch(seed=1)), activation_checkpointing=True)
    assert recomputed.activation_checkpointing
    assert any(getattr(m, "gradient_checkpointing", False) for m in recomputed.model.modules())
    for step in range(2):
        a, b = kept.step(step), recomputed.step(step)
        assert a.loss == pytest.approx(b.loss, abs=1e-6)
    for p, q in zip(kept.params, recomputed.params):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6)

    def saved_bytes(loop):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loop.model.train()
            from peer.train.model import lm_loss

            lm_loss(loop.model, batch()).backward()
        return total

    assert saved_bytes(recomputed) < saved_bytes(kept)


def test_activation_checkpointing_needs_a_transformers_model():
    with pytest.raises(ConfigError, match="--activation-checkpointing needs a transformers model"):
        InnerLoop(torch.nn.Linear(2, 2), SPEC, Fixed(batch()), activation_checkpointing=True)
