"""A compute stand-in for the rig: a peer whose inner step waits as if blocked on a card (issue #54).

The benchmark rig (bench/rig125m.py, bench/overlap_rig.py ``--standin``) starts its peers as
``python lab/standin.py join ...`` instead of ``python -m peer join ...``. This module replaces the
round engine's inner loop by :class:`StandInLoop` and then runs the product's own ``peer`` CLI:
everything else (the DHT, matchmaking, the outer step, codecs, error feedback, the all-reduce or
NoLoCo exchange, catch-up, checkpoints, records) is the product's code in a real peer process.

:class:`StandInLoop` holds the real φ, θ and Δ of the run's model (θ is the product's model, φ and
the outer state the product's round state); its step draws the batch, then waits ``step_s``
seconds without using the CPU (``threading.Event.wait``: the training thread of a GPU host is
blocked on the card for a step) and changes a slice of θ deterministically. What only a forward or
backward pass needs is not held: no gradients, no activations, no AdamW moments (on a GPU host they
sit on the card, not in the host's memory the rig measures).

The evaluation of φ is card work too (a forward pass over the validation windows: on 2 host cores
at 125M parameters it takes minutes and gigabytes of activations). :func:`install` therefore also
replaces the product's ``evaluate`` where the round engine calls it (peer/round/publishing.py's
evaluation of φ and peer/round/catchup.py's loss check of a downloaded state) by
:func:`standin_evaluate`, and the evaluation copy of the model by one on the ``meta`` device
(:func:`meta_copy`: shapes, no storage). And it gives the peer's sync work the priority a peer
training on a card gives it (peer/net/lifetime.py ``lower_background_priority``: the averager, the
DHT process with p2pd, the background sync and checkpoint threads at nice 5).

The seam: the peer's process imports the product unchanged and this module rebinds
``peer.round.engine.make_inner_loop`` (the one factory through which the round engine builds its
inner loop) before the CLI runs. Nothing in the product reads a stand-in option, so it is in no help
text and no user can turn it on; the rig's processes are the only ones started through this file.
Its one input is the environment the rig sets, read in :meth:`StandInConfig.from_env`:

* ``LOCOSWARM_STANDIN_STEP_S``: seconds per inner step; or
* ``LOCOSWARM_STANDIN_TOKENS_PER_S``: a card's tokens/s (bench/results/gpu.json, e.g. llama-125m on
  an H200: 383,782); the step time is the run's batch tokens ÷ this.

At its first inner step the stand-in writes one JSON event line, ``standin_first_step`` (``time``:
Unix seconds; ``inner_step``), to the peer's stdout, beside the peer's own events: the rig times a
joiner's catch-up from ``peer join`` to it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__":  # run as a file by the rig: the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import peer.round.catchup as catchup
import peer.round.engine as engine
import peer.round.publishing as publishing
from peer.cli import main as peer_main
from peer.net import lifetime
from peer.state import memory_check
from peer.state.memory_need import MemoryNeed, memory_need
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop, StepResult
from protocol.errors import ConfigError
from protocol.manifest import InnerOptimizerSpec

STEP_ENV = "LOCOSWARM_STANDIN_STEP_S"
RATE_ENV = "LOCOSWARM_STANDIN_TOKENS_PER_S"
CHUNKS = 64
"""θ is changed a 1/CHUNKS slice per step (each tensor's k-th contiguous slice at step k mod CHUNKS),
so a round of H ≥ 64 steps changes every element while a step's CPU work stays small."""
EVAL_LOSS = 2.0
"""What :func:`standin_evaluate` reports for any φ, nats per token: the stand-in trains nothing, so
there is no loss to measure; every φ ties (a downloaded state passes the loss check unless the
re-sync rule asks it to be strictly lower)."""
STEP_SIZE = 1e-3
"""The per-element change a step adds to its slice of θ, times the learning rate (before the spread)."""
SPREAD = 0.4
"""How far a peer's step size strays from :data:`STEP_SIZE` per (tensor, slice): a factor in
[1 − SPREAD, 1 + SPREAD] from the peer's seed. Honest peers' Δ then have about the same norm and
point about the same way (as a round of training on different batches does: screening compares
norms and directions, peer/sync/screening.py), without being equal. A piece of the all-reduce
may hold a single slice, so the factor's range bounds how far two honest peers' piece norms differ
(here at most 1.4 / 0.6 = 2.3×: the screening clips the longer to 1.5× the median, and strikes only over 3×)."""
FORWARD_SHARE = 1.0 / 3.0
"""A forward pass's share of a training step's time (forward + backward ≈ 3 forwards)."""


@dataclass(frozen=True, kw_only=True)
class StandInConfig:
    """How long a stand-in step takes: ``step_s`` seconds, or the run's batch tokens ÷
    ``tokens_per_s`` (exactly one of them is set).

    Raises:
        ValueError: neither or both set, or one not a positive finite number.
    """

    step_s: float | None = None
    """Seconds per inner step."""
    tokens_per_s: float | None = None
    """A card's inner-loop throughput, tokens/s."""

    def __post_init__(self) -> None:
        if (self.step_s is None) == (self.tokens_per_s is None):
            raise ValueError(f"set exactly one of step_s ({self.step_s}) and tokens_per_s ({self.tokens_per_s})")
        for name in ("step_s", "tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} = {value}: must be a positive number")

    def step_seconds(self, batch_tokens: int) -> float:
        """Seconds per step of a batch of ``batch_tokens`` tokens."""
        return self.step_s if self.step_s is not None else batch_tokens / float(self.tokens_per_s or 1.0)

    def to_env(self) -> dict[str, str]:
        """The environment that :meth:`from_env` reads back."""
        return {STEP_ENV: repr(self.step_s)} if self.step_s is not None else {RATE_ENV: repr(self.tokens_per_s)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StandInConfig:
        """The configuration the rig put into ``env`` (``LOCOSWARM_STANDIN_STEP_S`` or
        ``LOCOSWARM_STANDIN_TOKENS_PER_S``).

        Raises:
            ConfigError: neither or both set, or a value that is not a positive number (named).
        """
        values: dict[str, float] = {}
        for key, field in ((STEP_ENV, "step_s"), (RATE_ENV, "tokens_per_s")):
            if env.get(key):
                try:
                    values[field] = float(env[key])
                except ValueError:
                    raise ConfigError(f"{key} = {env[key]!r}: not a number; give seconds or tokens/s") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigError(f"{exc}: set {STEP_ENV} or {RATE_ENV} (one of them) to a positive number") from None


class StandInLoop(InnerLoop):
    """The inner-loop interface of :class:`peer.train.inner.InnerLoop` with forward and backward
    replaced by a wait: what the round engine, catch-up and checkpointing call (``step``,
    ``settle``, ``hold_updates``, ``state_dict`` / ``load_state_dict``, ``reset_optimizer``,
    ``sampler``, ``micro_batch_sequences``, ``close``) behaves as the real loop's.

    A step takes ``step_s`` seconds from its start (a wait for :meth:`hold_updates`' event left
    out, like a real step's optimizer step waits for it): the next batch is drawn from ``sampler``
    (the data position advances as in training), the step waits for that event, changes θ's slice
    ``inner_step mod CHUNKS`` of every tensor in place: ``θ ← θ + lr·b``, lr from
    the run's schedule at ``inner_step`` and ``b`` = :data:`STEP_SIZE` × a factor within
    ±:data:`SPREAD` of 1 that follows the sampler's seed, the tensor and the slice
    (:meth:`step_size`), and waits on an event nobody sets (no CPU used) for what is left of
    ``step_s``: the host's own work of the step runs while the card computes, as a GPU host's
    launches overlap the card's work. Δ differs between peers as it does in training, with about
    the same norm and direction (a stand-in whose peers' Δ norms differed severalfold would be
    screened as an attack by the honest peers' own checks). No gradient is made and AdamW's
    moments are never allocated (the sync needs neither): :meth:`state_dict` is
    None, the inner optimizer's state of a real loop before its first step, so a checkpoint holds
    no moments and a restore leaves a fresh optimizer; :attr:`adam_step` counts the steps. The loss
    reported is not a loss: a deterministic stand-in value, ``1 + 1 / (1 + inner_step / 100)`` nats
    per token.

    Args:
        model: θ, fp32, on ``device`` (the host here).
        spec: the run's inner optimizer (learning-rate schedule, AdamW's hyper-parameters).
        sampler: this peer's batches, int64 (batch_sequences, seq_len + 1).
        step_s: seconds each step takes (> 0).
        device: where θ lives (default: the model's device).
        on_first_step: called with the inner step once, after the first step's wait.

    Raises:
        ValueError: ``step_s`` not a positive number.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: InnerOptimizerSpec,
        sampler: BatchSampler,
        *,
        step_s: float,
        device: torch.device | None = None,
        on_first_step: Callable[[int], None] | None = None,
    ):
        if not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"step_s = {step_s}: must be a positive number of seconds")
        super().__init__(model, spec, sampler, device=device)
        self.step_s = step_s
        self.steps_taken = 0
        self._card = threading.Event()
        """Never set: a step waits on it for ``step_s``, as the training thread waits on a card."""
        self._on_first_step = on_first_step
        draw = torch.Generator().manual_seed(int(sampler.seed))
        self._factors = (1.0 + SPREAD * (2 * torch.rand(len(self.params), CHUNKS, generator=draw) - 1)).tolist()
        """:meth:`step_size`'s factor per (tensor, slice): uniform in [1 − SPREAD, 1 + SPREAD]."""
        self.adam_step = 0
        """Steps since the optimizer was last fresh (what AdamW's ``step`` would count)."""

    def step(self, inner_step: int, *, wait: bool = True) -> StepResult:
        """One stand-in step at cumulative inner step ``inner_step`` (see the class); ``wait`` is
        accepted for the interface (nothing is left pending). Returns the batch's tokens and the
        step's wall seconds (the wait for :meth:`hold_updates` left out)."""
        start = time.perf_counter()
        batch = self._next_batch(inner_step)
        held_s = self._wait_for_hold()
        lr = self.lr(inner_step)
        with torch.no_grad():
            k = inner_step % CHUNKS
            for i, p in enumerate(self.params):
                flat = p.data.view(-1)
                lo, hi = k * flat.numel() // CHUNKS, (k + 1) * flat.numel() // CHUNKS
                flat[lo:hi].add_(lr * self.step_size(i, k))
        left = self.step_s - (time.perf_counter() - start - held_s)
        if left > 0:  # the card's time: the host's work of the step above ran while it computed
            self._card.wait(left)
        self._count_step()
        self.steps_taken += 1
        if self.steps_taken == 1 and self._on_first_step is not None:
            self._on_first_step(inner_step)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return StepResult(
            loss=1.0 + 1.0 / (1.0 + inner_step / 100.0),
            tokens=tokens,
            seconds=time.perf_counter() - start - held_s,
            micro_batch=batch.shape[0],
        )

    def step_size(self, tensor: int, chunk: int) -> float:
        """``b`` of the step's change to slice ``chunk`` of tensor ``tensor`` (see the class): a
        deterministic function of this peer's seed, the tensor and the slice."""
        return STEP_SIZE * self._factors[tensor][chunk]

    def _count_step(self) -> None:
        self.adam_step += 1

    def state_dict(self) -> dict[str, Any] | None:
        """None: the stand-in holds no AdamW moments (a real loop's state before its first step)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Keep ``state``'s step count (None: a fresh optimizer); its moments are not held."""
        self.adam_step = int(state["step"]) if state is not None else 0

    def reset_optimizer(self) -> None:
        """A fresh optimizer: the step count back to 0."""
        super().reset_optimizer()
        self.adam_step = 0

    def settle(self) -> list[float]:
        """Nothing is ever pending: an empty list."""
        return []

    def fit_micro_batch(self, *, budget_bytes: float, margin: float = 0.1) -> int:
        """No card to fit: the whole batch per micro-batch (the batch's sequences)."""
        self.micro_batch_sequences = self.rows_per_step
        return self.micro_batch_sequences


def first_step_event(inner_step: int, *, fd: int = 1) -> None:
    """Write the ``standin_first_step`` event as one JSON line to ``fd`` (one ``write``, so it does
    not interleave with the peer's own lines)."""
    line = json.dumps({"event": "standin_first_step", "time": time.time(), "inner_step": inner_step}) + "\n"
    os.write(fd, line.encode())


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the ``meta`` device (shapes and
    dtypes, no storage): the evaluation copy a stand-in peer keeps, which nothing computes with."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        )
    return copy.deepcopy(model, memo)


def standin_evaluate(tokens_per_s: Callable[[], float]) -> Callable[..., float]:
    """A replacement for :func:`peer.train.model.evaluate` (same arguments): it waits a forward
    pass's time on the card, ``windows``' tokens × :data:`FORWARD_SHARE` ÷ ``tokens_per_s()``
    seconds, without using the CPU, and returns :data:`EVAL_LOSS` (nats per token)."""
    card = threading.Event()

    def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_sequences: int = 16) -> float:
        tokens = windows.shape[0] * max(1, windows.shape[1] - 1)
        card.wait(tokens * FORWARD_SHARE / tokens_per_s())
        return EVAL_LOSS

    return evaluate


def factory(
    config: StandInConfig,
    on_first_step: Callable[[int], None] | None = None,
    on_built: Callable[[StandInLoop, int], None] | None = None,
) -> Callable[..., InnerLoop]:
    """A replacement for :func:`peer.train.ddp.make_inner_loop` (same arguments) that builds a
    :class:`StandInLoop` whose step time is ``config``'s for the run's batch; ``on_built`` is
    called with the loop and its batch tokens."""

    def make(model: torch.nn.Module, spec: InnerOptimizerSpec, sampler: BatchSampler, placement: Any = None):
        tokens = sampler.batch_sequences * sampler.seq_len
        device = placement.device if placement is not None else None
        loop = StandInLoop(
            model, spec, sampler, step_s=config.step_seconds(tokens), device=device, on_first_step=on_first_step
        )
        if on_built is not None:
            on_built(loop, tokens)
        return loop

    return make


def standin_check_join(manifest: Any, device: Any, *, host_free: int | None = None) -> MemoryNeed:
    """peer/state/memory_check.py ``check_join`` for a stand-in peer: the host need of a GPU host
    (activations, gradients and AdamW's moments on the card, which the stand-in does not hold),
    checked against the host's available RAM; ``device`` (the join's DeviceConfig) is read for the
    micro-batch and activation checkpointing only.

    Raises:
        MemoryShort: the host lacks that RAM.
    """
    need = memory_need(
        manifest,
        device_type="cuda",
        micro_batch_sequences=device.micro_batch_sequences,
        activation_checkpointing=device.activation_checkpointing,
    )
    free = memory_check.host_available_bytes() if host_free is None else host_free
    memory_check.check_memory(need, host_free=free)
    return need


def install(config: StandInConfig, on_first_step: Callable[[int], None] | None = first_step_event) -> None:
    """Make the round engine build :class:`StandInLoop` in this process, evaluate φ with
    :func:`standin_evaluate` (at the card's tokens/s: ``config``'s, or the batch's tokens ÷ the step
    time) and keep its evaluation copy of the model on the ``meta`` device (:func:`meta_copy`).

    The join's memory check becomes :func:`standin_check_join` (the stand-in holds a GPU host's
    host memory, not a CPU peer's activations).

    Raises:
        RuntimeError: peer/round/engine.py no longer builds its inner loop through
            ``make_inner_loop``, or peer/round/publishing.py / catchup.py no longer evaluate through
            ``evaluate`` and copy the model through ``copy.deepcopy`` (these seams must follow them).
    """
    if not callable(getattr(engine, "make_inner_loop", None)):
        raise RuntimeError("peer/round/engine.py has no make_inner_loop to replace: update lab/standin.py's seam")
    for module in (publishing, catchup):
        if not callable(getattr(module, "evaluate", None)):
            raise RuntimeError(f"{module.__name__} has no evaluate to replace: update lab/standin.py's seam")
    if getattr(publishing, "copy", None) is not copy:
        raise RuntimeError(
            "peer/round/publishing.py no longer copies the model with copy.deepcopy: update lab/standin.py"
        )
    rate: list[float] = [config.tokens_per_s or 0.0]

    def built(loop: StandInLoop, batch_tokens: int) -> None:
        rate[0] = config.tokens_per_s or batch_tokens / loop.step_s

    def card_rate() -> float:
        if not rate[0]:
            raise RuntimeError("the stand-in evaluated before its inner loop was built: no step time to scale")
        return rate[0]

    lifetime.lower_background_priority()  # as on a host whose inner step runs on a card (peer/node.py)
    engine.make_inner_loop = factory(config, on_first_step, built)
    evaluate = standin_evaluate(card_rate)
    publishing.evaluate = evaluate
    catchup.evaluate = evaluate
    publishing.copy = SimpleNamespace(deepcopy=meta_copy)  # type: ignore[assignment]
    memory_check.check_join = standin_check_join  # type: ignore[assignment]


def main() -> None:
    """``python lab/standin.py join ...``: the product's ``peer`` CLI with the stand-in installed;
    exit 78 with one line when the stand-in's environment is bad."""
    try:
        config = StandInConfig.from_env(os.environ)
    except ConfigError as exc:
        print(f"lab/standin.py: {exc}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code) from None
    install(config)
    peer_main()


if __name__ == "__main__":
    main()
