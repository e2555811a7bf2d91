"""The inner loop: AdamW on this peer's θ over its own data shard."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from peer.train.data import BatchSampler
from peer.train.model import lm_loss
from protocol.errors import BadPayload
from protocol.manifest import InnerOptimizerSpec


def lr_at(step: int, *, lr: float, warmup_steps: int, schedule: str, decay_steps: int,
          min_lr_ratio: float) -> float:
    """Inner learning rate at cumulative inner step ``step`` (0-based).

    Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio·lr`` at
    ``decay_steps`` and constant after it ('cosine'), or constant ('constant'). Indexed by the
    swarm's cumulative inner steps, so it never restarts on a sync or a join (ALGORITHMS.md §6.2).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class StepResult:
    loss: float
    """Training loss of the batch, nats per token."""
    tokens: int
    seconds: float


class InnerLoop:
    """H steps of AdamW on θ (DiLoCo arXiv 2311.08105, Algorithm 1 lines 4-7).

    The AdamW state lives here and is never averaged or sent (paper §3). A joiner gets a fresh
    one; the learning rate comes from :func:`lr_at` at the swarm's cumulative inner step.
    """

    def __init__(self, model: torch.nn.Module, spec: InnerOptimizerSpec, sampler: BatchSampler):
        self.model, self.spec, self.sampler = model, spec, sampler
        self.params = [p for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps,
            weight_decay=spec.weight_decay,
        )

    def reset_optimizer(self) -> None:
        """Forget AdamW moments (after adopting φ from the swarm)."""
        self.optimizer.state.clear()

    def state_dict(self) -> dict[str, Any] | None:
        """AdamW's state for a checkpoint: ``exp_avg`` and ``exp_avg_sq`` (one fp32 tensor per
        parameter, shaped like it, in model.parameters() order; the live tensors, not copies) and
        ``step`` (int); None before the first step or after :meth:`reset_optimizer`."""
        state = self.optimizer.state
        if not all(p in state and "exp_avg" in state[p] for p in self.params):
            return None
        return {"exp_avg": [state[p]["exp_avg"] for p in self.params],
                "exp_avg_sq": [state[p]["exp_avg_sq"] for p in self.params],
                "step": int(state[self.params[0]]["step"])}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`state_dict` returned (copies the tensors); None leaves a fresh AdamW."""
        self.optimizer.state.clear()
        if state is None:
            return
        for p, m1, m2 in zip(self.params, state["exp_avg"], state["exp_avg_sq"], strict=True):
            self.optimizer.state[p] = {"step": torch.tensor(float(state["step"])),
                                       "exp_avg": m1.clone(), "exp_avg_sq": m2.clone()}

    def lr(self, inner_step: int) -> float:
        s = self.spec
        return lr_at(inner_step, lr=s.lr, warmup_steps=s.warmup_steps, schedule=s.schedule,
                     decay_steps=s.decay_steps, min_lr_ratio=s.min_lr_ratio)

    def step(self, inner_step: int) -> StepResult:
        """One AdamW step on a fresh batch at cumulative inner step ``inner_step``.

        Raises:
            BadPayload: the loss or gradient is not finite; θ is left unchanged by this step.
        """
        start = time.perf_counter()
        batch = self.sampler.next_batch()
        self.model.train()
        loss = lm_loss(self.model, batch)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise BadPayload(f"training loss is {loss_value} at inner step {inner_step}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.spec.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.grad_clip_norm)
            if not math.isfinite(norm.item()):
                self.optimizer.zero_grad(set_to_none=True)
                raise BadPayload(f"gradient norm is {norm.item()} at inner step {inner_step}")
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(inner_step)
        self.optimizer.step()
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return StepResult(loss=loss_value, tokens=tokens, seconds=time.perf_counter() - start)
