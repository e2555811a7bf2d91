"""How far one outer step may move φ: the bound a landing checks before it installs a step (issue
#51: a lying owner's mean of 1e30 left every honest φ at 1e30, then NaN, for good), from this peer's
own numbers and the receivers' screening (peer/sync/screening.py), and the norms it is made of.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from peer.train.outer import OuterAlgorithm
from protocol.errors import BadPayload
from protocol.manifest import NoLoCoSpec, OuterOptimizerSpec

HONEST_MEAN_FACTOR = 3.0
"""An honest mean's piece is within this multiple of this peer's own contribution to it: the receivers'
norm bound, peer/sync/screening.py ``OWNER_NORM_FACTOR`` (the same number; peer/train/ does not import
peer/sync/, tests/security/test_unbounded_means.py checks they agree)."""
HONEST_PHI_RATIO = 2.0
"""NoLoCo: owners leave out a partner's φ whose norm is over this multiple of their own
(peer/sync/screening.py ``PHI_MAX_NORM_RATIO``, the same number)."""
STEP_BOUND_MARGIN = 4.0
"""How far past the largest change of φ an honest mean can make (:func:`step_limit`) an outer step
may go before it is refused. The honest bound already takes the receivers' screening at its word
(every piece of the mean within 3x this peer's own contribution); 4 more covers what it does not:
the pieces this peer owns itself (its clip is to 3x the piece's median, which may be more than 3x
its own contribution), and a lossy codec's error feedback (a contribution is Δ plus the residual of
earlier rounds, a few times Δ at most). A mean of 1e30 is refused whatever the margin."""
STEP_PULL_BOUND = (1 + HONEST_PHI_RATIO) / 2
"""NoLoCo: the most an honest group's mean φ lies from this peer's own, in units of ‖φ‖: owners leave
out a partner's φ whose norm is over :data:`HONEST_PHI_RATIO` (2) times their own, so the mean of a
pair is at most (1 + 2) / 2 ‖φ‖ from either."""


def global_norm(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm of all of ``tensors`` together (any float dtype, one device each), accumulated in
    float64 without a float64 copy of any of them; NaN or inf when a value is not finite."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2 for t in tensors))


def finite_norm(tensors: Iterable[torch.Tensor]) -> float:
    """:func:`global_norm`, inf when any value is not finite (NaN included)."""
    total = global_norm(tensors)
    return float("inf") if total != total else total


def step_limit(
    outer: OuterAlgorithm, *, delta_norm: float, phi_norm: float, state_norm: float, scale: float = 1.0
) -> float:
    """The largest ‖φ_new − φ_old‖ an outer step of ``outer`` may make, from this peer's own numbers,
    :data:`STEP_BOUND_MARGIN` × the outer optimizer's own arithmetic with an honest mean:

    * an honest mean Δ̄ is within :data:`HONEST_MEAN_FACTOR` (3) × ``scale`` × ‖Δ_own‖: the receivers'
      screening refuses every piece over 3x its own contribution scaled to a full round
      (peer/sync/screening.py ``owner_mean_problem``; ``scale`` = the run's cap on a weight over
      this peer's weight);
    * DiLoCo, Nesterov: φ_new − φ_old = −lr·((1 + μ)·Δ̄ + μ²·m_old), so the change is at most
      lr·((1 + μ)·‖Δ̄‖ + μ²·‖m_old‖); heavy-ball: lr·(‖Δ̄‖ + μ·‖m_old‖). With every past mean
      within the same bound B, ‖m_old‖ ≤ B / (1 − μ) and the change is at most lr·B / (1 − μ), the
      steady-state gain of the momentum; the outer state's own norm is used instead, so a round
      whose Δ is smaller than the last ones' (the inner lr decaying) is not refused for momentum
      the earlier, accepted, rounds built;
    * NoLoCo: φ_new − φ_old = δ_new = α·δ − β·Δ̄ + γ·(φ̄ − φ): at most α·‖δ‖ + β·‖Δ̄‖ + γ·
      :data:`STEP_PULL_BOUND`·‖φ‖ (the mean φ of an honest group lies within 1.5 ‖φ‖ of this
      peer's);
    * independent (and any other): ‖Δ̄‖.

    A zero Δ_own with nothing else in the bound (this peer trained nothing since the sync's last
    start, e.g. a fragment's last sync at ``max_rounds``) leaves the explosion bound ‖φ_old‖.

    Args:
        delta_norm: ‖Δ_own‖, this peer's own payload's Δ part, of the same tensors as the step.
        phi_norm: ‖φ_old‖ of those tensors. state_norm: ‖outer state‖ of those tensors (momentum, δ).
        scale: the run's cap on a weight over this peer's weight in the sync (≥ 1; 1: not known).
    """
    mean_bound = HONEST_MEAN_FACTOR * max(scale, 1.0) * delta_norm
    spec = getattr(outer, "spec", None)
    if isinstance(spec, OuterOptimizerSpec):
        lr, mu = spec.lr, spec.momentum
        bound = (
            lr * ((1 + mu) * mean_bound + mu * mu * state_norm)
            if spec.nesterov
            else lr * (mean_bound + mu * state_norm)
        )
    elif isinstance(spec, NoLoCoSpec):
        bound = spec.momentum * state_norm + spec.lr * mean_bound + spec.pull * STEP_PULL_BOUND * phi_norm
    else:
        bound = mean_bound
    bound *= STEP_BOUND_MARGIN
    return bound if bound > 0 else phi_norm


def check_step_bound(
    outer: OuterAlgorithm,
    old_phi: Sequence[torch.Tensor],
    new_phi: Sequence[torch.Tensor],
    own_delta: Sequence[torch.Tensor] | float,
    *,
    old_state: Sequence[torch.Tensor] = (),
    scale: float = 1.0,
    what: str = "the outer step",
) -> None:
    """Refuse an outer step whose change of φ is more than :func:`step_limit` allows (issue #51: a
    lying owner's mean of 1e30 left every honest φ at 1e30, then NaN, for good).

    Args:
        outer: the algorithm that made the step (its spec: lr, momentum).
        old_phi, new_phi: φ (or a fragment's φ) before and after the step, same shapes.
        own_delta: this peer's own Δ for those tensors (its payload's Δ part), or its norm.
        old_state: the outer state (momentum, δ) of those tensors before the step.
        scale: the run's cap on a weight over this peer's weight in the sync.
        what: names the step in the message.

    Raises:
        BadPayload: the change exceeds the bound (or is not finite); nothing is changed here, the
            caller leaves φ and the outer state as they were.
    """
    delta_norm = float(own_delta) if isinstance(own_delta, (int, float)) else finite_norm(own_delta)
    with torch.no_grad():
        # one difference at a time: no second copy of φ
        change = finite_norm(n.detach() - o.detach() for n, o in zip(new_phi, old_phi, strict=True))
    limit = step_limit(
        outer, delta_norm=delta_norm, phi_norm=finite_norm(old_phi), state_norm=finite_norm(old_state), scale=scale
    )
    if not change <= limit:
        raise BadPayload(
            f"{what} would change φ by {change:.4g}, over its bound {limit:.4g} "
            f"({STEP_BOUND_MARGIN:g}x what an honest mean can, from this peer's own Δ of norm "
            f"{delta_norm:.4g}); refused, φ left unchanged"
        )
