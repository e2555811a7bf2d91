"""The inner loop: AdamW (or Muon on the block matrices: ``inner_optimizer.kind``) on this peer's θ
over its own data shard, on this peer's device.

The batch is the run's (``batch_size_tokens``, swarm-wide); this peer reaches it by gradient
accumulation over micro-batches that fit its memory, in the precision chosen for its card
(peer/train/precision.py). Master weights, gradients and AdamW state stay fp32.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from peer.train.data import BatchSampler
from peer.train.device import probe_micro_batch
from peer.train.model import lm_loss
from peer.train.precision import FP32, Precision, autocast
from protocol.errors import BadPayload, ConfigError
from protocol.manifest import InnerOptimizerSpec

logger = logging.getLogger(__name__)


def lr_at(step: int, *, lr: float, warmup_steps: int, schedule: str, decay_steps: int, min_lr_ratio: float) -> float:
    """Inner learning rate at cumulative inner step ``step`` (0-based).

    Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio·lr`` at
    ``decay_steps`` and constant after it ('cosine'), or constant ('constant'). Indexed by the
    swarm's cumulative inner steps, so it never restarts on a sync or a join (docs/algorithms.md §6.2).
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
    """Training loss of the batch, nats per token (NaN for a step not waited for: see
    :meth:`InnerLoop.settle`)."""
    tokens: int
    seconds: float
    """Wall time of the step (only its queuing, for a step not waited for)."""
    micro_batch: int = 0
    """Sequences per micro-batch the step finished with (smaller than before after an OOM back-off)."""
    ends_round: bool = False
    """A pipeline stage after the first (peer/pipeline/peer.py): the stages calling it moved on to
    their next round, so this one's round ends with this step."""


def fused_adamw(device: torch.device) -> bool:
    """Whether the inner loop runs fused AdamW on ``device`` (CUDA; a seam for the tests)."""
    return device.type == "cuda"


def muon_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``kind = "muon"`` gives to Muon: the 2-D weight matrices of the transformer
    blocks (attention and MLP projections), in ``model.parameters()`` order. The embeddings, the
    output layer and the norms stay with AdamW (MuLoCo, arXiv 2505.23725, §3; Muon's own docs)."""
    return [p for name, p in model.named_parameters() if p.ndim == 2 and ".layers." in f".{name}"]


class MuonAdamW:
    """:class:`torch.optim.Muon` on the block matrices and AdamW on the rest, stepped as one
    optimizer: the calls the inner loop and :class:`torch.amp.GradScaler` make (``param_groups``,
    ``zero_grad``, ``step``, ``state``). Muon's param group carries ``lr_ratio``, its lr ÷ AdamW's,
    which the loop applies when it sets the step's lr.

    Args:
        adamw: AdamW over the parameters that are not block matrices.
        muon: Muon over the block matrices, its one param group holding ``lr_ratio``.
    """

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer):
        self.adamw, self.muon = adamw, muon
        self.param_groups = [*adamw.param_groups, *muon.param_groups]
        self.state = _JointState(adamw.state, muon.state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()


class _JointState:
    """Both optimizers' per-parameter state, for what the loop asks of ``optimizer.state``:
    ``clear()`` and whether any is held."""

    def __init__(self, *states: dict):
        self.states = states

    def clear(self) -> None:
        for state in self.states:
            state.clear()

    def __len__(self) -> int:
        return sum(len(state) for state in self.states)


class _Loss(torch.nn.Module):
    """The model's training loss as one module (:func:`peer.train.model.lm_loss`), so torch.compile
    takes the logits' fp32 cast and the cross-entropy into the model's graph."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, windows)


class InnerLoop:
    """H steps of AdamW on θ (DiLoCo arXiv 2311.08105, Algorithm 1 lines 4-7); with
    ``spec.kind == "muon"``, Muon on the block matrices and AdamW on the rest (:class:`MuonAdamW`).

    The optimizer state lives here and is never averaged or sent (paper §3). A joiner gets a fresh
    one; the learning rate comes from :func:`lr_at` at the swarm's cumulative inner step.

    Args:
        model: θ, fp32, already on ``device``.
        sampler: this peer's batches, int64 (batch_sequences, seq_len + 1) on the host.
        device: where θ lives (default: the model's device); batches are copied there.
        precision: autocast dtype and gradient scaler (default fp32: no autocast).
        micro_batch_sequences: sequences per forward/backward (None: the whole batch at once). A
            CUDA out-of-memory error halves it and redoes the step.
        compile: run the forward and the loss (the logits' fp32 cast and the cross-entropy, one
            graph) through :func:`torch.compile`; a compile failure at the first step falls back to
            eager with one warning.
        compile_backend: torch.compile's backend (the seam tests use to make compilation fail).
        activation_checkpointing: recompute each decoder layer's activations in the backward
            (transformers' gradient checkpointing, non-reentrant) instead of keeping them; the
            gradients are the same, the memory of a micro-batch smaller, each step about a third
            slower. Needs a transformers model (ConfigError otherwise).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: InnerOptimizerSpec,
        sampler: BatchSampler,
        *,
        device: torch.device | None = None,
        precision: Precision = FP32,
        micro_batch_sequences: int | None = None,
        compile: bool = False,
        compile_backend: Any = "inductor",
        activation_checkpointing: bool = False,
    ):
        self.model, self.spec, self.sampler = model, spec, sampler
        if activation_checkpointing:
            # transformers >= 5 names it activation checkpointing; older releases, gradient checkpointing
            # (a transformers model's methods; torch types an nn.Module's unknown attributes as Tensor | Module)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(  # type: ignore[operator]
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(  # type: ignore[operator]
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                raise ConfigError(f"--activation-checkpointing needs a transformers model, not {type(model).__name__}")
        self.activation_checkpointing = activation_checkpointing
        self.params = [p for p in model.parameters()]
        self.device = device if device is not None else self.params[0].device
        self.precision = precision
        if micro_batch_sequences is not None and micro_batch_sequences < 1:
            raise ValueError(f"micro_batch_sequences = {micro_batch_sequences}: must be >= 1")
        self.micro_batch_sequences = micro_batch_sequences
        self.oom_backoffs = 0
        """Times an out-of-memory error halved the micro-batch."""
        self.fused = fused_adamw(self.device) and spec.kind == "adamw"
        """Fused AdamW (CUDA): it skips a step on the device when told to (:meth:`step`'s one sync).
        Not with Muon, whose steps are checked on the host."""
        matrices = {id(p) for p in muon_matrices(model)} if spec.kind == "muon" else set()
        if spec.kind == "muon" and not matrices:
            raise ConfigError(
                f"inner_optimizer.kind = 'muon' needs a model with transformer blocks; "
                f"{type(model).__name__} has none: use kind = 'adamw'"
            )
        adamw = torch.optim.AdamW(
            [p for p in self.params if id(p) not in matrices],
            lr=spec.lr,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            fused=True if self.fused else None,
        )
        self.optimizer: torch.optim.Optimizer | MuonAdamW = adamw
        if matrices:
            # match_rms_adamw scales Muon's orthogonalised update to AdamW's RMS, so lr and weight
            # decay mean what they mean for AdamW; lr_ratio scales it from there
            muon = torch.optim.Muon(
                [{"params": [p for p in self.params if id(p) in matrices], "lr_ratio": spec.muon_lr_ratio}],
                lr=spec.lr * spec.muon_lr_ratio,
                weight_decay=spec.weight_decay,
                adjust_lr_fn="match_rms_adamw",
            )
            self.optimizer = MuonAdamW(adamw, muon)
        self.scaler = torch.amp.GradScaler(self.device.type) if precision.grad_scaler else None
        self._eager_loss = _Loss(model)
        self._loss = torch.compile(self._eager_loss, backend=compile_backend) if compile else self._eager_loss
        self._compile_unproven = compile
        """True until the compiled model finished a step: until then a failure falls back to eager."""
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        """Steps taken with ``wait=False`` whose loss and norm are not read yet: (inner step, loss, norm)."""
        self._hold: threading.Event | None = None
        """Set by :meth:`hold_updates`: the next update of θ and the moments waits for it."""

    @property
    def compiled(self) -> bool:
        """Whether the forward runs compiled (False after a fallback to eager)."""
        return self._loss is not self._eager_loss

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and Muon's momentum (after adopting φ from the swarm)."""
        self.optimizer.state.clear()

    def _adamw(self) -> torch.optim.Optimizer:
        return self.optimizer.adamw if isinstance(self.optimizer, MuonAdamW) else self.optimizer

    def _muon_state(self) -> dict:
        return self.optimizer.muon.state if isinstance(self.optimizer, MuonAdamW) else {}

    def state_dict(self) -> dict[str, Any] | None:
        """The inner optimizer's state for a checkpoint: ``exp_avg`` and ``exp_avg_sq`` (one fp32
        tensor per parameter, shaped like it, on θ's device, in model.parameters() order; the live
        tensors, not copies) and ``step`` (int, AdamW's); None before the first step or after
        :meth:`reset_optimizer`. With Muon a block matrix's ``exp_avg`` is Muon's momentum buffer
        and its ``exp_avg_sq`` zeros (Muon keeps no second moment), so the checkpoint's layout is
        AdamW's whatever the kind."""
        adamw, muon = self._adamw().state, self._muon_state()
        if not all(
            (p in muon and "momentum_buffer" in muon[p]) or (p in adamw and "exp_avg" in adamw[p]) for p in self.params
        ):
            return None
        first = next(p for p in self.params if p in adamw)
        return {
            "exp_avg": [muon[p]["momentum_buffer"] if p in muon else adamw[p]["exp_avg"] for p in self.params],
            "exp_avg_sq": [torch.zeros_like(p) if p in muon else adamw[p]["exp_avg_sq"] for p in self.params],
            "step": int(adamw[first]["step"]),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`state_dict` returned (copies the tensors to θ's device); None leaves a
        fresh optimizer."""
        self.optimizer.state.clear()
        if state is None:
            return
        adamw = self._adamw()
        with_adamw = {id(q) for q in adamw.param_groups[0]["params"]}
        for p, m1, m2 in zip(self.params, state["exp_avg"], state["exp_avg_sq"], strict=True):
            if id(p) not in with_adamw:  # a block matrix: Muon's momentum
                assert isinstance(self.optimizer, MuonAdamW)  # only Muon steps parameters that AdamW lacks
                self.optimizer.muon.state[p] = {"momentum_buffer": m1.detach().to(p.device, torch.float32, copy=True)}
                continue
            # fused AdamW keeps its step count on the device
            step = torch.tensor(float(state["step"]), device=p.device if self.fused else "cpu")
            adamw.state[p] = {
                "step": step,
                "exp_avg": m1.detach().to(p.device, torch.float32, copy=True),
                "exp_avg_sq": m2.detach().to(p.device, torch.float32, copy=True),
            }

    def lr(self, inner_step: int) -> float:
        s = self.spec
        return lr_at(
            inner_step,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            schedule=s.schedule,
            decay_steps=s.decay_steps,
            min_lr_ratio=s.min_lr_ratio,
        )

    def step(self, inner_step: int, *, wait: bool = True) -> StepResult:
        """One AdamW step on a fresh batch at cumulative inner step ``inner_step``.

        The batch runs in micro-batches of :attr:`micro_batch_sequences` sequences whose gradients
        add up to the whole batch's (each micro-batch's mean loss weighted by its share of the
        sequences). An out-of-memory error halves the micro-batch and redoes the step on the same
        batch: no step and no data are lost.

        With fused AdamW (CUDA) and no gradient scaler the step waits for the device once, at its
        end: the finiteness of the loss and of the gradient norm is decided on the device, where it
        makes fused AdamW skip the update (the ``found_inf`` input the gradient scaler uses), and
        only then is the loss read. Elsewhere the loss and the norm are read as they are computed.
        With ``wait=False`` (fused AdamW only; ignored elsewhere) not even that: the step returns
        once queued, with a NaN loss, so the host can queue the next ones; :meth:`settle` later reads those steps' losses and raises for
        them.

        Raises:
            BadPayload: the loss or gradient is not finite; θ and AdamW's state are left unchanged
                by this step.
            ConfigError: out of memory at one sequence per micro-batch; θ unchanged.
        """
        start = time.perf_counter()
        batch = self._next_batch(inner_step)
        self.model.train()
        loss = self._forward_backward(batch)
        self._compile_unproven = False
        on_device = self.fused and self.scaler is None and isinstance(loss, torch.Tensor)
        if not on_device:
            loss = float(loss)
            if not math.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise BadPayload(f"training loss is {loss} at inner step {inner_step}")
        # GradScaler takes a torch Optimizer; MuonAdamW has the calls it makes
        scaled = cast(torch.optim.Optimizer, self.optimizer)
        if self.scaler is not None:
            self.scaler.unscale_(scaled)
        norm = None
        if self.spec.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.grad_clip_norm)
            # with a scaler an overflow is routine: the scaler skips this update and lowers its scale
            if self.scaler is None and not on_device and not math.isfinite(norm.item()):
                self.optimizer.zero_grad(set_to_none=True)
                raise BadPayload(f"gradient norm is {norm.item()} at inner step {inner_step}")
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(inner_step) * group.get("lr_ratio", 1.0)
        held_s = self._wait_for_hold()
        if self.scaler is not None:
            self.scaler.step(scaled)
            self.scaler.update()
        elif on_device:
            loss = self._step_unless_non_finite(cast(torch.Tensor, loss), norm, inner_step, wait=wait)
        else:
            self.optimizer.step()
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return StepResult(
            loss=float(loss),
            tokens=tokens,
            seconds=time.perf_counter() - start - held_s,
            micro_batch=min(self.micro_batch_sequences or self._share(batch).shape[0], self._share(batch).shape[0]),
        )

    def hold_updates(self, until: threading.Event) -> None:
        """Make the next update of θ and AdamW's moments (the next :meth:`step`'s optimizer step,
        after its forward and backward passes) wait until ``until`` is set: another thread is
        copying them (the round loop's checkpoint, peer/round/checkpointing.py ``Checkpointing.save``). The wait is
        left out of that step's ``seconds``. The caller must make sure ``until`` gets set."""
        self._hold = until

    def _wait_for_hold(self) -> float:
        """Wait for :meth:`hold_updates`' event, once; the seconds waited."""
        if self._hold is None:
            return 0.0
        start = time.perf_counter()
        self._hold.wait()
        self._hold = None
        return time.perf_counter() - start

    def _step_unless_non_finite(
        self, loss: torch.Tensor, norm: torch.Tensor | None, inner_step: int, *, wait: bool = True
    ) -> float:
        """Fused AdamW's step, skipped on the device (parameters, moments and step count untouched)
        when the loss or the gradient norm is not finite; then the step's one host sync: the loss
        (``wait=False``: none, the step is kept for :meth:`settle` and NaN returned).

        Raises:
            BadPayload: the loss or the norm was not finite (the update was skipped).
        """
        bad = ~torch.isfinite(loss) if norm is None else ~(torch.isfinite(loss) & torch.isfinite(norm))
        # fused AdamW skips its step where found_inf is set, an attribute torch's Optimizer does not declare
        self.optimizer.found_inf = bad.float()  # type: ignore[union-attr]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[union-attr]
        if not wait:
            self._pending.append((inner_step, loss.detach(), None if norm is None else norm.detach()))
            return math.nan
        self._pending.append((inner_step, loss, norm))
        return self.settle()[-1]

    def settle(self) -> list[float]:
        """The losses of the steps not read yet (taken with ``wait=False``), in step order, read with
        one host sync; empty when there are none.

        Raises:
            BadPayload: one of them had a non-finite loss or gradient norm (the first is named); its
                update was skipped on the device, so θ and AdamW hold only the finite steps.
        """
        pending, self._pending = self._pending, []
        if not pending:
            return []
        # (loss, norm) per step, one sync; no clipping: no norm, 0 stands in
        table = torch.stack(
            [
                torch.stack([loss.float(), loss.new_zeros(()) if norm is None else norm.float()])
                for _, loss, norm in pending
            ]
        ).tolist()
        for (inner_step, _, _), (value, norm_value) in zip(pending, table):
            if not math.isfinite(value) or not math.isfinite(norm_value):
                self.optimizer.zero_grad(set_to_none=True)
                what = f"training loss is {value}" if not math.isfinite(value) else f"gradient norm is {norm_value}"
                raise BadPayload(f"{what} at inner step {inner_step}")
        return [value for value, _ in table]

    def _next_batch(self, inner_step: int) -> torch.Tensor:
        """The step's whole batch, int64 (batch_sequences, seq_len + 1) on the host (pinned on CUDA)."""
        batch = self.sampler.next_batch()
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def _forward_backward(self, batch: torch.Tensor) -> float | torch.Tensor:
        """Gradients of ``batch``'s mean loss into ``.grad``, backing off on out-of-memory errors and
        falling back to eager on a first compiled step's failure; returns the loss (nats per token),
        a 0-d tensor on the device (not read yet) or a float."""
        while True:
            out_of_memory = False
            try:
                return self._accumulate(batch)
            except torch.OutOfMemoryError:
                out_of_memory = True  # handled below, once the exception's frames (and tensors) are gone
            except Exception as exc:  # any failure of a first compiled step falls back
                if not self._compile_unproven:
                    raise
                self._fall_back_to_eager(exc)
            if out_of_memory:
                self._back_off(batch.shape[0])

    def _share(self, batch: torch.Tensor) -> torch.Tensor:
        """The rows of ``batch`` this process trains on (all of them here; a rank's share in ddp.py)."""
        return batch

    @property
    def rows_per_step(self) -> int:
        """Sequences this process trains on per step (the whole batch here; a share of it per rank)."""
        return self.sampler.batch_sequences

    def close(self) -> None:
        """Release what the loop holds beyond this process (nothing here; ranks in peer/train/ddp.py)."""

    def _accumulate(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward over ``batch`` in micro-batches; the gradients of the mean loss are
        left in ``.grad``; returns that loss, a 0-d fp32 tensor on the device (no host sync). Raises
        what the forward raises."""
        return self._accumulate_share(batch, batch.shape[0])

    def _accumulate_share(self, rows: torch.Tensor, batch_rows: int) -> torch.Tensor:
        """Forward and backward over ``rows``, a share of a batch of ``batch_rows`` sequences, in
        micro-batches: each micro-batch's mean loss is weighted by its share of the whole batch, so
        the shares' gradients add up to the whole batch's. Returns the weighted loss, a 0-d fp32
        tensor on the device (no host sync)."""
        self.optimizer.zero_grad(set_to_none=True)
        chunks = rows.split(self.micro_batch_sequences or rows.shape[0])
        total = None
        for chunk in chunks:
            chunk = chunk.to(self.device, non_blocking=True)
            with autocast(self.device.type, self.precision):
                loss = self._loss(chunk)
            if chunk.shape[0] != batch_rows:
                loss = loss * (chunk.shape[0] / batch_rows)
            total = loss.detach() if total is None else total + loss.detach()
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        assert total is not None  # split() gives at least one chunk
        return total

    def _back_off(self, rows: int) -> None:
        """Halve the micro-batch after an out-of-memory error; ConfigError at one sequence."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        current = min(self.micro_batch_sequences or rows, rows)
        if current <= 1:
            raise ConfigError(
                f"out of {self.device} memory at one sequence per micro-batch; raise --max-memory, "
                f"train a smaller run, or use --device cpu"
            )
        self.micro_batch_sequences = current // 2
        self.oom_backoffs += 1
        logger.warning(
            "out of %s memory at %d sequences per micro-batch: redoing the step at %d",
            self.device,
            current,
            self.micro_batch_sequences,
        )

    def _fall_back_to_eager(self, exc: Exception) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        logger.warning(
            "torch.compile failed (%s: %s); training eagerly",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        self._loss = self._eager_loss
        self._compile_unproven = False

    def fit_micro_batch(self, *, budget_bytes: float, margin: float = 0.1) -> int:
        """Find and set the largest micro-batch (sequences, at most the run's batch) whose forward
        and backward peak stays under ``(1 − margin)·budget_bytes`` of CUDA memory, the AdamW state
        it has yet to allocate counted in (:func:`peer.train.device.probe_micro_batch`), then evened
        out over the fewest micro-batches that fit: 64 sequences that fit 48 at a time run as 2 × 32,
        one shape for torch.compile where 48 + 16 would compile a second graph. CUDA only; θ, AdamW
        and the data position are left as they were.

        Raises:
            ConfigError: not even one sequence fits.
        """
        if self.device.type != "cuda":
            raise ValueError(f"fit_micro_batch measures CUDA memory; this loop trains on {self.device}")
        adam_bytes = 0 if self.optimizer.state else 8 * sum(p.numel() for p in self.params)

        def try_step(n: int) -> float:
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            windows = torch.zeros((n, self.sampler.seq_len + 1), dtype=torch.int64, device=self.device)
            try:
                with autocast(self.device.type, self.precision):
                    loss = lm_loss(self.model, windows)  # eager: compiling every probed size costs minutes
                loss.backward()
                torch.cuda.synchronize(self.device)
                return (torch.cuda.max_memory_allocated(self.device) + adam_bytes) / budget_bytes
            finally:
                self.optimizer.zero_grad(set_to_none=True)

        self.model.train()
        rows = self.rows_per_step
        fits = probe_micro_batch(try_step, upper=rows, margin=margin)
        chunks = -(-rows // fits)
        self.micro_batch_sequences = -(-rows // chunks)
        return self.micro_batch_sequences
