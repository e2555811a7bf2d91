"""Pipeline stages in one process (issue #19): S stages × R replicas of one model, each stage's
replicas running the run's outer algorithm among themselves, against the unpipelined swarm of R
peers at equal tokens (lab/engine_sim.py).

What it runs is what peers serving stages would run, minus the network: the stage split of
peer/pipeline/stages.py, micro-batches routed to a replica of the next stage by
peer/pipeline/routing.py's :class:`~peer.pipeline.routing.Router` (``pipeline.routing``), the
activations and their gradients cast to ``pipeline.activation_dtype`` at every stage boundary as on
the wire, one AdamW per replica (the run's inner optimizer and schedule, the gradient clipped per
stage: a stage cannot see the others' gradients), and every H inner steps the outer step of each
stage's groups (``sync.algorithm``: DiLoCo one group of the stage's R replicas, NoLoCo random
pairs, with the trainer's own outer objects) on that stage's parameters only (DiLoCoX arXiv
2506.21263's per-stage sync; its dual optimizer policy: each replica keeps only its stage's inner
and outer state). Stage-0 replica r reads the data shard of simulated peer r (``sim-peer-r``), so
the pipeline and the unpipelined swarm train on the same batches.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lab.sim_results import EvalPoint, sync_groups, weight_spread, weighted_mean
from peer.pipeline.routing import Router
from peer.pipeline.stages import PipelineStage, stage_parameter_names
from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch, validation_bits_per_byte
from peer.train.inner import lr_at
from peer.train.model import build_model, evaluate
from peer.train.outer import make_outer
from peer.train.overlap import round_progress
from protocol.manifest import RunManifest
from protocol.wire.pipeline import DTYPE_BY_NAME


@dataclass
class PipelineResult:
    """One simulated pipelined run."""

    stages: int
    replicas_per_stage: int
    routing: str
    seed: int
    rounds: int
    activation_bytes_per_token: float
    """Bytes that crossed stage boundaries per training token: activations forward, their gradients
    back and the int32 targets that travel with them (tensor bytes, no frame headers)."""
    history: list[EvalPoint]


class PipelineSimulation:
    """S = ``manifest.pipeline.stages`` stages × ``replicas`` replicas in this process.

    Args:
        manifest: the run (``pipeline``, ``sync``, ``inner_optimizer``, ``outer_optimizer``, ``data``).
        corpus: the loaded corpus; stage-0 replica r samples ``corpus.train`` as ``sim-peer-r``.
        replicas: R, peers serving each stage (S × R peers in all).
        seed: salts the data shards as lab/engine_sim.py's peers do (``peer_seed(f"sim-peer-{r}", seed)``).

    Raises:
        ValueError: ``replicas`` < 1, or stages the model cannot be split into.
    """

    def __init__(self, manifest: RunManifest, corpus: Corpus, *, replicas: int, seed: int = 0):
        if replicas < 1:
            raise ValueError(f"replicas = {replicas}: need at least one per stage")
        self.m, self.replicas, self.seed = manifest, replicas, seed
        self.S = manifest.pipeline.stages
        self.tokenizer = corpus.tokenizer
        base = build_model(manifest.model, corpus.tokenizer)
        self._eval_model = copy.deepcopy(base)
        self.stages = [[PipelineStage(copy.deepcopy(base), self.S, k) for _ in range(replicas)] for k in range(self.S)]
        self.names = [stage_parameter_names(manifest.model.num_layers, self.S, k) for k in range(self.S)]
        spec = manifest.inner_optimizer
        self.optimizers = [
            [
                torch.optim.AdamW(
                    list(stage.parameters()),
                    lr=spec.lr,
                    betas=(spec.beta1, spec.beta2),
                    eps=spec.eps,
                    weight_decay=spec.weight_decay,
                )
                for stage in row
            ]
            for row in self.stages
        ]
        self.outers = [
            [make_outer(manifest, [p.shape for p in stage.parameters()]) for stage in row] for row in self.stages
        ]
        self.phis = [[[p.detach().clone() for p in stage.parameters()] for stage in row] for row in self.stages]
        self.samplers = [
            BatchSampler(
                corpus.train,
                seq_len=manifest.data.seq_len_tokens,
                batch_sequences=manifest.batch_sequences,
                seed=peer_seed(f"sim-peer-{r}", seed),
            )
            for r in range(replicas)
        ]
        self.ids = [[f"stage-{k}-replica-{r}" for r in range(replicas)] for k in range(self.S)]
        self.routers = [Router(manifest.pipeline.routing, run_id=manifest.run_id, stage=k) for k in range(self.S)]
        self.wire = DTYPE_BY_NAME[manifest.pipeline.activation_dtype]
        self.inner_step = self.round_ = self.tokens = 0
        self.boundary_bytes = 0

    def _route(self, micro_batch: int) -> list[int]:
        """The replica of each stage micro-batch ``micro_batch`` passes through (stage 0: its reader),
        each choice counted as a call in flight (:meth:`Router.started`): a step's micro-batches are
        all sent before any comes back, as from concurrent stage-0 replicas."""
        path = [micro_batch]
        for k in range(1, self.S):
            chosen = self.routers[k].order(self.ids[k], step=self.inner_step, micro_batch=micro_batch)[0]
            self.routers[k].started(chosen)
            path.append(self.ids[k].index(chosen))
        return path

    def _micro_batch(self, windows: torch.Tensor, path: Sequence[int]) -> None:
        """Forward ``windows`` (int64, (B, T + 1)) through the stages of ``path`` and back; gradients
        accumulate in the replicas' ``.grad``. Each boundary carries wire-dtype tensors, as a call does."""
        inputs, targets = windows[:, :-1], windows[:, 1:]
        received, outputs = [], []
        x = inputs
        for k, r in enumerate(path):
            if k > 0:
                x = x.detach().to(self.wire).requires_grad_(True)
                received.append(x)
                self.boundary_bytes += 2 * x.numel() * x.element_size() + targets.numel() * 4
            out = self.stages[k][r](x)
            outputs.append(out)
            x = out
        self.stages[-1][path[-1]].loss(x, targets).backward()
        for k in range(self.S - 2, -1, -1):
            grad = received[k].grad  # d loss / d (stage k+1's input), in the wire dtype
            outputs[k].backward(grad.to(outputs[k].dtype))

    def step(self) -> None:
        """One inner step of every replica: each stage-0 replica's batch as one micro-batch, routed;
        each replica steps on the mean gradient of the micro-batches it served (none: no step)."""
        for row in self.optimizers:
            for opt in row:
                opt.zero_grad(set_to_none=True)
        served = [[0] * self.replicas for _ in range(self.S)]
        paths = [self._route(r) for r in range(self.replicas)]
        for r, path in enumerate(paths):
            windows = self.samplers[r].next_batch()
            start = time.perf_counter()
            self._micro_batch(windows, path)
            seconds = time.perf_counter() - start
            self.tokens += windows.shape[0] * (windows.shape[1] - 1)
            for k, j in enumerate(path):
                served[k][j] += 1
                if k > 0:
                    self.routers[k].finished(self.ids[k][j], seconds)
        spec = self.m.inner_optimizer
        lr = lr_at(
            self.inner_step,
            lr=spec.lr,
            warmup_steps=spec.warmup_steps,
            schedule=spec.schedule,
            decay_steps=spec.decay_steps,
            min_lr_ratio=spec.min_lr_ratio,
        )
        for k in range(self.S):
            for j, (stage, opt) in enumerate(zip(self.stages[k], self.optimizers[k])):
                if not served[k][j]:
                    continue
                params = list(stage.parameters())
                if served[k][j] > 1:
                    for p in params:
                        if p.grad is not None:
                            p.grad.div_(served[k][j])
                if spec.grad_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, spec.grad_clip_norm)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
        self.inner_step += 1

    def run_round(self) -> None:
        """H inner steps, then each stage's outer step among its groups of replicas (the swarm's
        group plan per stage): Δ = φ − θ, the group's mean payload, ``apply`` on φ, θ ← φ."""
        for _ in range(self.m.sync.inner_steps):
            self.step()
        for k in range(self.S):
            thetas = [list(stage.parameters()) for stage in self.stages[k]]
            payloads = [
                outer.payload(phi, round_progress(phi, theta))
                for outer, phi, theta in zip(self.outers[k], self.phis[k], thetas)
            ]
            for group in sync_groups(self.m, self.replicas, self.round_):
                mean = weighted_mean([payloads[j] for j in group], [1.0] * len(group))
                for j in group:
                    self.outers[k][j].apply(self.phis[k][j], mean)
            with torch.no_grad():
                for theta, phi in zip(thetas, self.phis[k]):
                    for t, p in zip(theta, phi):
                        t.copy_(p)
        self.round_ += 1

    def evaluate(self, windows: torch.Tensor) -> EvalPoint:
        """Validation loss (bits per byte) of the model made of each stage's replica-averaged φ;
        σ is the largest weight spread among the stages' replicas (0 when they agree)."""
        params = dict(self._eval_model.named_parameters())
        with torch.no_grad():
            for k in range(self.S):
                for name, value in zip(self.names[k], weighted_mean(self.phis[k], [1.0] * self.replicas)):
                    params[name].copy_(value)
        loss = validation_bits_per_byte(evaluate(self._eval_model, windows), windows, self.tokenizer)
        sigma = max(weight_spread(self.phis[k]) for k in range(self.S)) if self.replicas > 1 else 0.0
        return EvalPoint(self.round_, self.tokens, loss, loss, None, sigma)


def run_pipeline(
    manifest: RunManifest, corpus: Corpus, *, replicas: int, rounds: int, seed: int = 0, eval_every_rounds: int = 1
) -> PipelineResult:
    """Train ``rounds`` rounds of the pipeline and evaluate every ``eval_every_rounds`` (round 0 and
    the last always)."""
    windows = validation_batch(corpus, manifest.data)
    sim = PipelineSimulation(manifest, corpus, replicas=replicas, seed=seed)
    history = [sim.evaluate(windows)]
    for r in range(1, rounds + 1):
        sim.run_round()
        if r % max(1, eval_every_rounds) == 0 or r == rounds:
            history.append(sim.evaluate(windows))
    return PipelineResult(
        stages=sim.S,
        replicas_per_stage=replicas,
        routing=manifest.pipeline.routing,
        seed=seed,
        rounds=rounds,
        activation_bytes_per_token=sim.boundary_bytes / max(1, sim.tokens),
        history=history,
    )
