"""Outer algorithms: pure tensor code, shared by the network and any in-process transport.

An outer algorithm turns this peer's pseudo-gradient and its group's mean into a new φ. It
never communicates; a transport computes the group mean (see ``peer.transport``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from protocol.errors import BadPayload
from protocol.manifest import OuterOptimizerSpec


def pseudo_gradient(phi: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ (gradient sign convention, DiLoCo arXiv 2311.08105 Algorithm 1 line 8).

    Args:
        phi: outer parameters at the start of the round, fp32, one tensor per parameter.
        theta: inner parameters after H inner steps, same shapes.

    Returns:
        New fp32 tensors shaped like ``phi``.
    """
    return [p.detach().float() - t.detach().float() for p, t in zip(phi, theta, strict=True)]


def check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raise BadPayload if any element of ``tensors`` is NaN or ±inf."""
    for index, tensor in enumerate(tensors):
        if not torch.isfinite(tensor).all():
            raise BadPayload(f"{what}: tensor {index} of shape {tuple(tensor.shape)} holds NaN or inf")


class OuterAlgorithm(Protocol):
    """What the trainer needs from an outer algorithm."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors that a joiner must copy with φ (e.g. outer momentum), fp32."""
        ...

    def apply(self, phi: Sequence[torch.Tensor], mean_delta: Sequence[torch.Tensor]) -> None:
        """Update ``phi`` in place from the group's mean pseudo-gradient."""
        ...


class DiLoCo:
    """DiLoCo's outer optimizer: SGD with Nesterov (or heavy-ball) momentum on φ.

    Implements DiLoCo (arXiv 2311.08105, Algorithm 1, line 12: ``φ ← OuterOpt(φ, Δ̄)``) with
    the update of ``torch.optim.SGD(lr, momentum=μ, nesterov=True, dampening=0)``::

        m ← μ·m + Δ̄
        φ ← φ − lr·(Δ̄ + μ·m)     (Nesterov)      or      φ ← φ − lr·m     (heavy-ball)

    Args:
        shapes: the parameter shapes; momentum buffers are fp32 zeros of these shapes.
        spec: outer lr, momentum μ and the Nesterov flag from the run manifest.
    """

    def __init__(self, shapes: Sequence[torch.Size], spec: OuterOptimizerSpec):
        self.spec = spec
        self.momentum = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum

    def apply(self, phi: Sequence[torch.Tensor], mean_delta: Sequence[torch.Tensor]) -> None:
        """One outer step, in place on ``phi`` and the momentum buffers.

        Args:
            phi: fp32 outer parameters, modified in place.
            mean_delta: fp32 group-mean pseudo-gradient Δ̄, shaped like ``phi``.

        Raises:
            BadPayload: Δ̄ holds NaN or inf, or its shapes differ from φ's; φ and the momentum
                are left unchanged.
        """
        if len(mean_delta) != len(phi):
            raise BadPayload(f"mean pseudo-gradient has {len(mean_delta)} tensors, φ has {len(phi)}")
        for index, (p, d) in enumerate(zip(phi, mean_delta)):
            if p.shape != d.shape:
                raise BadPayload(f"mean pseudo-gradient tensor {index} has shape {tuple(d.shape)}, "
                                 f"φ has {tuple(p.shape)}")
        check_finite(mean_delta, "mean pseudo-gradient")
        lr, mu = self.spec.lr, self.spec.momentum
        with torch.no_grad():
            for p, d, m in zip(phi, mean_delta, self.momentum):
                m.mul_(mu).add_(d)
                step = d.add(m, alpha=mu) if self.spec.nesterov else m
                p.sub_(step, alpha=lr)
