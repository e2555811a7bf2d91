"""Overlapping a round's sync with the next round's inner steps: the update rules, pure tensor code.

Called by the round loop (peer/round/ with peer/sync/background.py), which the benchmarks run in
one process too (lab/engine_sim.py), so they measure what the swarm runs. docs/algorithms.md §3.

Notation as in docs/algorithms.md: φ the outer parameters (identical on every peer that completed a
round with the same group), θ the inner parameters, Δ a pseudo-gradient. With overlap a round no
longer starts from φ, so each peer keeps its round's *anchor* ψ_t, the point round t started
from, and its pseudo-gradient is the round's own progress ``Δ_t = ψ_t − θ_t`` (Δ = φ − θ when
ψ = φ, as without overlap). At the end of round t a peer

1. applies the group mean of round t−1 (whose sync ran in the background during round t) to φ
   with the outer algorithm, unchanged: ``φ ← OuterOpt(φ, mean_{t−1})``; every groupmate applies
   the same bytes to the same φ, so φ stays bit-identical (the *correction*, for eager);
2. starts the background sync of round t's payload (built from φ after step 1: NoLoCo's φ half is
   then exactly the φ its outer step will be applied to);
3. starts round t+1 from ``ψ_{t+1} = next_start(...)``:

   * ``delayed`` (DiLoCoX, arXiv 2506.21263, one-step delay): ``ψ = φ − Δ_t``, i.e.
     ``θ ← φ_new + (θ_t − ψ_t)``: the new φ plus this round's local progress, which is not in φ
     yet (it reaches φ through the group mean one round later, so nothing is counted twice);
   * ``eager`` (Kale et al., arXiv 2502.12996): ``ψ = x_i``, this worker's outer parameters
     after its eager step with Δ̂_i(t) = (1/M)·Δ_i(t) + (1/M)·Σ_{j≠i} Δ_j(t−1) (docs/algorithms.md
     §3): this peer's fresh Δ at its share 1/n of the group mean stands in for its own part of
     round t's mean, and the others' Δ of round t−1 are already in φ through step 1. The paper
     keeps a per-worker outer state (x_i and its momentum) built on Δ̂_i; since the outer step is
     linear, x_i = φ + o_i, where φ and its momentum are built on the true group means (identical
     on every peer) and the offset o_i with its own momentum on this peer's ``e_i(t) = Δ_i(t)/n −
     Δ_i(t−1)/n`` (:class:`EagerState`), so φ stays identical across peers and the eager step
     lives in θ alone. With plain outer SGD (no momentum) the offset telescopes
     to −lr·Δ_i(t)/n, one outer step of φ with Δ_t/n, computed in that closed form (no state).
     NoLoCo is not in the paper: its eager start is its own outer step previewed with Δ_t/n.

The outer step of the last round's mean lands one round late; when training ends a peer waits for
the last sync and applies it (peer/round/overlapped.py ``OverlapSchedule.finish``). A sync that
fails applies the peer's own payload, as without overlap (DiLoCo paper Fig. 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import torch

from peer.train.outer import DiLoCo, OuterAlgorithm, check_finite, pseudo_gradient, step_on_copies
from protocol.specs import OVERLAP_MODES
from protocol.wire.pieces import rows_view


def round_progress(anchor: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ_t = ψ_t − θ_t: the progress of this round alone (the pseudo-gradient this peer sends).

    Args:
        anchor: ψ_t, the point the round started from, fp32 host tensors shaped like φ.
        theta: θ after the round's inner steps, same shapes (any float dtype, on the host).

    Returns:
        New fp32 tensors. Without overlap ψ_t = φ_t, so this is :func:`pseudo_gradient`.
    """
    return pseudo_gradient(anchor, theta)


def eager_mean(payload: Sequence[torch.Tensor], *, n_delta: int, share: float) -> list[torch.Tensor]:
    """The stand-in for the group mean that eager's preview step applies: this peer's payload with
    its Δ part scaled by ``share`` (its weight in the group mean, 1/n for n equal peers) and any φ
    part (NoLoCo) unchanged, so NoLoCo's pull term is zero until the partners' φ arrive.

    Args:
        payload: this peer's payload (``OuterAlgorithm.payload``), fp32.
        n_delta: how many leading tensors are Δ (``phi_from`` or the whole payload).
        share: in (0, 1].

    Raises:
        ValueError: ``share`` outside (0, 1].
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share = {share!r}: need 0 < share <= 1")
    return [t * share if i < n_delta else t.clone() for i, t in enumerate(payload)]


def preview_step(
    outer: OuterAlgorithm, phi: Sequence[torch.Tensor], mean: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """What ``outer.apply(φ, mean)`` would make of φ, out of place (DiLoCo's ``preview``, else on copies):
    φ and the outer state are unchanged.

    Args:
        outer: the run's outer algorithm (peer/train/outer.py).
        phi: fp32 outer parameters (read only).
        mean: a payload-shaped fp32 stand-in for the group mean.

    Returns:
        New fp32 tensors shaped like ``phi``.

    Raises:
        BadPayload: ``mean`` has the wrong count, shapes or non-finite values; nothing changed.
    """
    preview = getattr(outer, "preview", None)  # DiLoCo's: the same arithmetic without copying φ and its state
    return preview(phi, mean) if preview is not None else step_on_copies(outer, phi, outer.state_tensors(), mean)[0]


class EagerState:
    """This peer's own part of eager's per-worker outer state, for DiLoCo with outer momentum.

    Kale et al. (arXiv 2502.12996) give every worker i its own outer parameters x_i and outer
    optimizer state, stepped with Δ̂_i(t) = Δ_i(t)/M + Σ_{j≠i} Δ_j(t−1)/M = mean(t−1) + e_i(t),
    e_i(t) = Δ_i(t)/M − Δ_i(t−1)/M. SGD with (Nesterov or heavy-ball) momentum is linear in its
    gradients and its state, so x_i = φ + o_i and m_i = m + w_i: φ and its momentum m take the
    group means (every peer the same bytes, φ bit-identical across peers) and the offset o_i with
    its momentum w_i take e_i, by the same outer step (:class:`~peer.train.outer.DiLoCo`). Round
    t+1 starts from x_i(t) = φ + o_i. Without momentum o_i telescopes to −lr·Δ_i(t)/M, which
    :func:`next_start` computes directly; this state is needed only with momentum.

    Holds three fp32 host tensors per parameter (o, w and the last Δ/M) from the first eager round.
    A fresh state (o = w = 0, no last Δ) is a worker that just started from φ: what a peer is after
    adopting the swarm's state, after a restart (the state is not checkpointed) and after a round
    whose Δ was discarded (:meth:`reset`).
    """

    def __init__(self) -> None:
        self.offset: list[torch.Tensor] | None = None
        """o_i = x_i − φ, fp32 shaped like φ (None: zeros)."""
        self.momentum: list[torch.Tensor] | None = None
        """w_i: this peer's part of its outer momentum, fp32 shaped like φ (None: zeros)."""
        self.last: list[torch.Tensor] | None = None
        """Δ_i(t−1)/M as this peer counted its share of the last group mean (None: none yet)."""

    def reset(self) -> None:
        """Forget the offset and its momentum: the next round starts from φ plus one fresh step."""
        self.offset = self.momentum = self.last = None

    def start(
        self, outer: DiLoCo, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], *, share: float
    ) -> list[torch.Tensor]:
        """x_i(t) = φ + o_i(t), after one outer step of (o_i, w_i) with e_i(t) (the eager update of
        Kale et al., its outer state split as in the class docstring).

        Args:
            outer: the run's DiLoCo outer step (its lr, μ and Nesterov flag; its state is not read).
            phi: φ after round t−1's mean, fp32 host tensors.
            delta: Δ_i(t), this round's progress, shaped like ``phi``.
            share: this peer's weight in the group mean, in (0, 1] (1/M).

        Returns:
            New fp32 tensors shaped like ``phi``.

        Raises:
            ValueError: ``share`` outside (0, 1].
            BadPayload: e_i, the stepped offset or the start point is not finite; the state is
                left unchanged.
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share = {share!r}: need 0 < share <= 1")
        own = [d.detach().float() * share for d in delta]
        step = own if self.last is None else [a - b for a, b in zip(own, self.last, strict=True)]
        if self.offset is None or self.momentum is None:  # a fresh worker: zero offset and momentum
            self.offset = self.momentum = [torch.zeros_like(t) for t in own]
        offset, momentum = step_on_copies(outer, self.offset, self.momentum, step)
        start = [p + o for p, o in zip(phi, offset, strict=True)]
        check_finite(start, "the eager start point")
        self.offset, self.momentum, self.last = offset, momentum, own
        return start


def _per_worker_state(outer: OuterAlgorithm) -> TypeGuard[DiLoCo]:
    """Whether eager needs :class:`EagerState`: DiLoCo with outer momentum."""
    return isinstance(outer, DiLoCo) and outer.spec.momentum != 0.0


def keep_skipped_progress(
    start: Sequence[torch.Tensor],
    anchor: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    phi: Sequence[torch.Tensor],
    phi_before: Sequence[torch.Tensor],
    kept_rows: Sequence[tuple[int, int, int]],
) -> list[torch.Tensor]:
    """θ's start for the next round of a ``delayed`` sync whose landing applied none of this peer's Δ
    on ``kept_rows`` (the receipts skipped their owner: the mean there is zeros; ``SyncReport.kept_rows``).

    Everywhere else θ starts at ψ = ``start`` (:func:`next_start`). On those rows it keeps its own
    progress of the landed round, which the group did not apply: θ as the round ended (ψ_t − Δ_t,
    ``anchor − delta``) plus the outer step's change of φ (``phi − phi_before``), i.e. ψ minus the
    landed round's Δ there. The anchor stays ψ, so the next round's Δ = ψ − θ holds that progress
    again and it reaches φ through the next mean: the delayed analogue of a blocking landing's kept
    rows (peer/train/streaming.py ``land``); nothing is carried in the error feedback.

    Args:
        start: ψ, fp32 host tensors shaped like φ (read only).
        anchor, delta: ψ_t, where the round that just ended started, and its progress Δ_t (read only).
        phi, phi_before: φ after and before the landing's outer step (read only).
        kept_rows: (tensor index, first row, stop row); the whole tensor for 0-d.

    Returns:
        ``start``'s tensors, a new copy of each one with kept rows (those rows replaced).
    """
    out = list(start)
    with torch.no_grad():
        for t, lo, hi in kept_rows:
            if out[t] is start[t]:
                out[t] = start[t].clone()
            theta = rows_view(anchor[t], lo, hi) - rows_view(delta[t], lo, hi)
            rows_view(out[t], lo, hi).copy_(theta + (rows_view(phi[t], lo, hi) - rows_view(phi_before[t], lo, hi)))
    return out


def next_start(
    mode: str,
    outer: OuterAlgorithm,
    phi: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    payload: Sequence[torch.Tensor],
    *,
    share: float,
    eager: EagerState | None = None,
) -> list[torch.Tensor]:
    """ψ_{t+1}, where round t+1's inner steps start (call after φ took round t−1's mean).

    Implements the one-step delay of DiLoCoX (arXiv 2506.21263) for ``delayed`` and the eager
    update of arXiv 2502.12996 for ``eager`` (see the module docstring for the equations).

    Args:
        mode: ``sync.overlap``: 'none', 'delayed' or 'eager'.
        outer: the run's outer algorithm; only read (its state is restored after eager's preview).
        phi: φ after round t−1's mean, fp32 host tensors.
        delta: Δ_t = ψ_t − θ_t, this round's progress, shaped like ``phi``.
        payload: this peer's payload of round t (``outer.payload(φ, Δ_t)``).
        share: this peer's share of the group mean (1 / expected group size).
        eager: this peer's :class:`EagerState`, required for ``eager`` with DiLoCo and outer
            momentum (stepped in place), else unused.

    Returns:
        New fp32 tensors shaped like ``phi`` ('none': a copy of φ).

    Raises:
        ValueError: unknown ``mode``; ``eager`` missing where it is required.
        BadPayload: Δ or the preview is not finite; φ, the outer state and ``eager`` unchanged.
    """
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap = {mode!r}: allowed {OVERLAP_MODES}")
    if mode == "none":
        return [p.clone() for p in phi]
    check_finite(delta, "this round's progress")
    if mode == "delayed":
        return [p - d for p, d in zip(phi, delta, strict=True)]
    if _per_worker_state(outer):
        if eager is None:
            raise ValueError("eager with outer momentum needs this peer's EagerState (the paper's per-worker state)")
        return eager.start(outer, phi, delta, share=share)
    n_delta = outer.phi_from(len(phi))
    start = preview_step(
        outer, phi, eager_mean(payload, n_delta=len(payload) if n_delta is None else n_delta, share=share)
    )
    check_finite(start, "the eager start point")
    return start
