"""What a run in one process reports (lab/engine_sim.py, lab/data_parallel.py, lab/pipeline.py):
its evaluation points, screening counts and result record, and the arithmetic they are made of
(bytes of a butterfly all-reduce, the fp32 weighted mean, NoLoCo's weight spread σ,
the group plan of the peers ``sim-peer-{i}``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from protocol.groups import plan_groups
from protocol.manifest import RunManifest

FP32_BYTES = 4


def butterfly_bytes(payload_elements: int, group_size: int) -> float:
    """Bytes one peer sends in a butterfly all-reduce of an fp32 payload over ``group_size`` peers.

    Each peer sends its (n−1) foreign parts once (reduce-scatter) and its averaged part to the
    n−1 others (all-gather): 2·(n−1)/n × 4 bytes × ``payload_elements``. Zero for a group of one.
    """
    if group_size < 1 or payload_elements < 0:
        raise ValueError(f"group_size = {group_size}, payload_elements = {payload_elements}: need >= 1 and >= 0")
    return 2.0 * (group_size - 1) / group_size * FP32_BYTES * payload_elements


def weighted_mean(payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Weighted mean of several peers' payloads, accumulated in fp32.

    Args:
        payloads: one list of tensors per peer, all with the same shapes.
        weights: one positive weight per peer (tokens processed in the round).

    Returns:
        New fp32 tensors shaped like ``payloads[0]``: Σ_j w_j·x_j / Σ_j w_j.
    """
    total = float(sum(weights))
    if len(payloads) != len(weights) or not payloads or total <= 0:
        raise ValueError(f"{len(payloads)} payloads with weights {list(weights)}: need as many positive weights")
    out = [torch.zeros(t.shape, dtype=torch.float32) for t in payloads[0]]
    for payload, weight in zip(payloads, weights):
        for acc, t in zip(out, payload, strict=True):
            acc.add_(t.detach().float(), alpha=float(weight) / total)
    return out


def weight_spread(replicas: Sequence[Sequence[torch.Tensor]]) -> float:
    """NoLoCo's spread σ = sqrt(Σ_i ‖φ_i − φ̄‖² / (N·P)) (arXiv 2506.10911).

    Args:
        replicas: N lists of parameter tensors (same shapes); P is their total element count.

    Returns:
        σ in the parameters' units (an RMS distance per parameter); 0 for identical replicas.
    """
    # fp64 throughout: the mean of identical fp32 replicas is then exact and σ exactly 0.
    mean = [sum(r[k].detach().double() for r in replicas) / len(replicas) for k in range(len(replicas[0]))]
    params = sum(t.numel() for t in mean)
    squares = sum(
        float(((t.detach().double() - m) ** 2).sum())
        for replica in replicas
        for t, m in zip(replica, mean, strict=True)
    )
    return math.sqrt(squares / (len(replicas) * params))


def sync_groups(manifest: RunManifest, peers: int, round_: int, *, run_id: str | None = None) -> list[list[int]]:
    """Indices of the peers that average together in round ``round_``.

    The swarm's own group plan (:func:`protocol.groups.plan_groups`) for the peer names
    ``sim-peer-{i}``, as every networked peer would draw it: DiLoCo one group of all peers,
    NoLoCo random groups (drawn from ``run_id``, default the manifest's), independent groups of one.
    """
    index = {f"sim-peer-{i}": i for i in range(peers)}
    groups = plan_groups(
        list(index),
        algorithm=manifest.sync.algorithm,
        run_id=run_id or manifest.run_id,
        round_=round_,
        group_size=manifest.noloco.group_size,
    )
    return [sorted(index[name] for name in group) for group in groups]


@dataclass
class EvalPoint:
    """Validation losses after ``round_`` rounds, in bits per byte."""

    round_: int
    tokens: int
    """Training tokens processed so far by all peers together."""
    loss_bpb: float
    """The headline loss: the one model (data-parallel, DiLoCo) or the replica mean (NoLoCo, independent)."""
    averaged_bpb: float
    """Loss of the replicas' averaged weights φ̄ (the one model for data-parallel)."""
    replica_mean_bpb: float | None
    """Mean over replicas of each replica's own loss; None where all replicas are one model."""
    sigma: float
    """Weight spread σ of the replicas' φ (0 for data-parallel)."""
    per_peer_bpb: list[float] | None = None
    """With an adversary: each honest peer's own loss (peer order); the headline is their mean."""


@dataclass
class SimulationResult:
    """One simulated run: its loss curve, bytes sent and wall time."""

    method: str
    peers: int
    seed: int
    rounds: int
    inner_steps: int
    parameters: int
    bytes_sent_per_peer: float
    """Mean over peers of the bytes each sent: :func:`butterfly_bytes` of the fp32 payload, or with a
    codec (n−1)/n × (its encoded contribution + the encoded group mean)."""
    wall_s: float
    history: list[EvalPoint] = field(default_factory=list)
    screening: dict = field(default_factory=dict)
    """What the screening did (lab/engine_sim.py ``EngineResult``; empty for data-parallel)."""
    taken_over: dict = field(default_factory=dict)
    """fake-progress: honest peer index → the rounds in which it adopted the attacker's state."""

    def to_dict(self) -> dict:
        return asdict(self)
