"""Streaming DiLoCo's rules, pure tensor code: fragments, their sync schedule and the merge.

Implements Streaming DiLoCo (Douillard et al., arXiv 2501.18512; docs/algorithms.md
§4) for ``sync.overlap = "streaming"``. The round loop (peer/round/, each fragment's sync in the
background thread of peer/sync/background.py over a subset of the averager's buffers) calls these functions.

Notation as in docs/algorithms.md: φ the outer parameters, θ the inner ones, H inner steps per round.
The model's parameters are split into P *fragments* (:func:`partition`, strided by transformer
block as in the paper: block ℓ belongs to fragment ℓ mod P). Fragment p syncs every H inner steps
at the offset t_p = ⌊p·H/P⌋ (:func:`sync_offset`): once ``s`` inner steps are done with
``s ≥ 1`` and ``s ≡ t_p (mod H)`` (peer/round/streamed.py), every peer computes
``Δ_p = φ_p − θ_p`` and starts its all-reduce; τ inner steps later the group
mean lands::

    φ_p ← OuterOpt_p(φ_p, mean Δ_p)             (the run's outer step, on fragment p's tensors and state)
    θ_p ← α·θ_p + (1 − α)·φ_p                    (:func:`merge`; the paper mixes with α = 0.5)

θ_p kept training during those τ steps; the merge keeps part of that fresh progress
(``sync.fragment_merge = "shift"``, :func:`shift`: all of it, the mix being taken of θ_p as it was
when the sync started). φ is never
touched while its fragment's sync is in flight, and groupmates apply the same mean to the same
φ_p, so they keep bit-identical φ. With τ = 0 the mean lands at the sync step itself; with P = 1,
τ = 0 and α = 0 this is DiLoCo without overlap (θ ← φ after every outer step). Peak bandwidth
drops by P: a sync carries one fragment.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from peer.train.outer import OuterAlgorithm, make_outer
from protocol.manifest import RunManifest
from protocol.wire.pieces import rows_view

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A transformer block's parameters: ``model.layers.<index>.`` in transformers' Llama (and most
decoder-only models in that library)."""


def block_of(name: str) -> int | None:
    """The transformer block a parameter belongs to (``model.layers.3.mlp.up_proj.weight`` → 3),
    or None for a parameter outside the blocks (embeddings, final norm, output head)."""
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def partition(names: Sequence[str], fragments: int) -> list[list[int]]:
    """Split a model's parameters into ``fragments`` fragments, strided by transformer block.

    Block ℓ belongs to fragment ℓ mod P (Streaming DiLoCo, arXiv 2501.18512: strided
    fragments). A parameter outside the blocks joins the fragment of the last block that precedes
    it in ``names`` order, or fragment 0 when none does: for a Llama the token embedding joins
    fragment 0 (with block 0) and the final norm and output head join the fragment of the last
    block, (L − 1) mod P. Every peer lists the same names in the same order
    (``model.named_parameters()``), so every peer draws the same fragments.

    Args:
        names: parameter names in the model's order, e.g. from ``model.named_parameters()``.
        fragments: P ≥ 1, at most the number of blocks.

    Returns:
        P lists of indices into ``names``, each ascending; together they hold every index exactly
        once, and none is empty.

    Raises:
        ValueError: P < 1, no parameter names a block, or P exceeds the number of blocks.
    """
    blocks = [block_of(n) for n in names]
    distinct = sorted({b for b in blocks if b is not None})
    if fragments < 1:
        raise ValueError(f"fragments = {fragments}: need at least 1")
    if not distinct:
        raise ValueError(
            f"no parameter of {len(names)} names a transformer block ('layers.<index>.'): "
            "cannot split the model into fragments"
        )
    if fragments > len(distinct):
        raise ValueError(
            f"fragments = {fragments}: the model has only {len(distinct)} transformer block(s); "
            "need 1 <= fragments <= blocks"
        )
    rank = {b: i for i, b in enumerate(distinct)}  # block indices need not start at 0 or be dense
    out: list[list[int]] = [[] for _ in range(fragments)]
    current = 0
    for index, block in enumerate(blocks):
        if block is not None:
            current = rank[block] % fragments
        out[current].append(index)
    return out


def sync_offset(fragment: int, *, inner_steps: int, fragments: int) -> int:
    """t_p = ⌊p·H/P⌋: fragment p syncs when the inner steps done are t_p modulo H.

    Raises:
        ValueError: ``fragment`` outside [0, P), or H, P < 1.
    """
    if inner_steps < 1 or fragments < 1 or not 0 <= fragment < fragments:
        raise ValueError(
            f"fragment = {fragment}, inner_steps = {inner_steps}, fragments = {fragments}: "
            "need 0 <= fragment < fragments and inner_steps, fragments >= 1"
        )
    return fragment * inner_steps // fragments


def merge(theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor], alpha: float) -> None:
    """θ_p ← α·θ_p + (1 − α)·φ_p, in place on ``theta``: Streaming DiLoCo's merge when a fragment's
    mean arrives (arXiv 2501.18512).

    α = 1 leaves θ exactly as it is and α = 0 copies φ exactly (no rounding from the mix).

    Args:
        theta: the fragment's inner parameters (any float dtype, any device), modified in place.
        phi: the fragment's outer parameters after the outer step, fp32 host tensors shaped like ``theta``.
        alpha: α in [0, 1].

    Raises:
        ValueError: α outside [0, 1] or a shape mismatch; ``theta`` unchanged.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha!r}: need 0 <= alpha <= 1")
    for t, p in zip(theta, phi, strict=True):
        if t.shape != p.shape:
            raise ValueError(f"θ of shape {tuple(t.shape)} and φ of shape {tuple(p.shape)}: need equal shapes")
    if alpha == 1.0:
        return
    with torch.no_grad():
        for t, p in zip(theta, phi):
            src = p.to(device=t.device, dtype=t.dtype)
            if alpha == 0.0:
                t.copy_(src)
            else:
                t.mul_(alpha).add_(src, alpha=1.0 - alpha)


def shift(
    theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor], at_sync: Sequence[torch.Tensor], alpha: float
) -> None:
    """θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync), in place on ``theta``: ``sync.fragment_merge = "shift"``.

    The mix of :func:`merge` taken of θ_p^sync, the fragment as it was when its sync started (what
    its Δ_p was computed from), with the inner steps trained since then, θ_p − θ_p^sync, added back
    in full; :func:`merge` would take (1 − α) of those steps out again. Computed as
    ``(α·θ^sync + (1 − α)·φ) + (θ − θ^sync)`` in fp32, so with no step in between (θ = θ^sync, τ = 0)
    the result is bit-identical to :func:`merge`'s; α = 1 leaves θ exactly as it is.

    Args:
        theta: the fragment's inner parameters (any float dtype, any device), modified in place.
        phi: the fragment's outer parameters after the outer step, fp32 host tensors shaped like ``theta``.
        at_sync: θ_p when the sync started, fp32 tensors shaped like ``theta`` (any device; not modified).
        alpha: α in [0, 1].

    Raises:
        ValueError: α outside [0, 1] or a shape mismatch; ``theta`` unchanged.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha!r}: need 0 <= alpha <= 1")
    for t, p, s in zip(theta, phi, at_sync, strict=True):
        if not t.shape == p.shape == s.shape:
            raise ValueError(
                f"θ of shape {tuple(t.shape)}, φ of shape {tuple(p.shape)} and θ at the sync of shape "
                f"{tuple(s.shape)}: need equal shapes"
            )
    if alpha == 1.0:
        return
    with torch.no_grad():
        for t, p, s in zip(theta, phi, at_sync):
            start = s.to(device=t.device, dtype=torch.float32)
            target = p.to(device=t.device, dtype=torch.float32)
            mixed = target.clone() if alpha == 0.0 else start.mul(alpha).add_(target, alpha=1.0 - alpha)
            mixed.add_(t.to(torch.float32) - start)
            t.copy_(mixed)


def land(
    theta: Sequence[torch.Tensor],
    phi: Sequence[torch.Tensor],
    *,
    alpha: float,
    rule: str,
    at_sync: Sequence[torch.Tensor] | None,
    kept_rows: Sequence[tuple[int, int, int]] = (),
    phi_before: Sequence[torch.Tensor] | None = None,
) -> None:
    """A fragment's mean enters θ_p by the run's ``sync.fragment_merge`` ``rule``: 'mix'
    (:func:`merge`) or 'shift' (:func:`shift`, which needs ``at_sync``).

    ``kept_rows`` (tensor, first row, stop row; the whole tensor for 0-d): rows where the group
    applied no mean of this peer's Δ (``SyncReport.kept_rows``). There θ_p keeps its own progress,
    the rule's result plus θ_p − φ_p^before (with α = 0: θ_p plus the outer step's change of φ_p), so
    the next Δ_p = φ_p − θ_p holds it again;
    ``phi_before``: φ_p before this landing's outer step (needed with ``kept_rows``).

    Raises:
        ValueError: an unknown rule, 'shift' without ``at_sync``, ``kept_rows`` without
            ``phi_before``, or what :func:`merge` and :func:`shift` raise; ``theta`` unchanged.
    """
    if kept_rows and phi_before is None:
        raise ValueError("kept rows need φ as it was before the outer step")
    progress = []  # (a view of θ's kept rows, θ − φ_before there): the rule below writes θ in place
    with torch.no_grad():
        for t, start, stop in kept_rows:
            rows = rows_view(theta[t], start, stop)
            before = rows_view(phi_before[t], start, stop).to(device=rows.device, dtype=torch.float32)  # type: ignore[index]
            progress.append((rows, rows.to(torch.float32) - before))
    if rule == "mix":
        merge(theta, phi, alpha)
    elif rule == "shift":
        if at_sync is None:
            raise ValueError("fragment_merge = 'shift' needs θ as it was when the sync started")
        shift(theta, phi, at_sync, alpha)
    else:
        raise ValueError(f"fragment_merge = {rule!r}: need 'mix' or 'shift'")
    with torch.no_grad():
        for rows, own in progress:
            rows.copy_(rows.to(torch.float32) + own)


def payload_indices(fragment: Sequence[int], *, phi_from: int | None) -> list[int]:
    """The payload tensors a fragment's sync carries: its Δ tensors, then with NoLoCo (whose payload
    is Δ followed by φ, ``phi_from`` = the parameter count) its φ tensors.

    Args:
        fragment: the fragment's parameter indices, ascending (:func:`partition`).
        phi_from: ``OuterAlgorithm.phi_from(n_params)``: None when the payload is Δ only.

    Returns:
        Indices into the payload, ascending (what ``NetworkTransport.average`` takes as ``tensors``).
    """
    return list(fragment) if phi_from is None else [*fragment, *(phi_from + k for k in fragment)]


def fragment_outers(
    outer: OuterAlgorithm, manifest: RunManifest, fragments: Sequence[Sequence[int]], shapes: Sequence[torch.Size]
) -> list[OuterAlgorithm]:
    """One outer algorithm per fragment, each stepping its fragment's tensors with its slice of
    ``outer``'s state: the slice is ``outer``'s own state tensors (the same objects), so whatever
    reads or replaces ``outer.state_tensors()`` in place (snapshots, checkpoints, an adopted state)
    sees and sets every fragment's outer state.

    Args:
        outer: the run's outer algorithm over the whole model (its state: one tensor per parameter).
        manifest: the run (which algorithm and its settings).
        fragments: :func:`partition`'s index lists.
        shapes: every parameter's shape.

    Raises:
        ValueError: ``outer`` keeps a state that is not one tensor per parameter.
    """
    state = outer.state_tensors()
    if len(state) != len(shapes):
        raise ValueError(
            f"the outer algorithm keeps {len(state)} state tensors for {len(shapes)} parameters: "
            "cannot slice it into fragments"
        )
    out: list[OuterAlgorithm] = []
    for index in fragments:
        part = make_outer(manifest, [shapes[k] for k in index])
        part.momentum = [state[k] for k in index]
        out.append(part)
    return out
