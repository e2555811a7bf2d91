"""NoLoCo's loss gate: a group's mean is applied only when the φ it makes is no worse, on this peer's
own next batch, than the φ of this peer's own step alone (issue #65).

NoLoCo (arXiv 2506.10911) averages with one random partner. A pair has no majority, and what the
partner sends is bounded only loosely (peer/sync/pairs.py: norms, a piece's direction, the whole Δ's
cosine, a φ's cosine and norm): a partner can send a φ or Δ within every bound whose average is a
much worse model (bench/byzantine.py, IPM 1 of 8: the honest partner's φ 7-14 % worse than its own
trained θ after the exchange, honest exchanges at most 2.2 %). What a norm
cannot see, the loss can: as in BASIL's performance-based selection for decentralized training
(arXiv 2109.07706) and Zeno's descent score (arXiv 1805.10032), each peer scores what it is given
on data of its own and keeps its own step when the group's is clearly worse.

The data: :data:`GATE_TOKENS` tokens of the inner loop's next batches
(:class:`~peer.train.data.PeekSampler`), read ahead and then trained on as usual: this peer's own,
not yet trained on (held out from θ), new every round, and not the validation split that every
benchmark and the swarm's ``eval`` events measure.

The reference is this peer's own step alone (the outer step with its own payload as the mean, as
when no partner came), so the gate only judges what the partners changed. A refusal applies that
step instead: the round is a step alone, and the partners are not counted as holding this peer's
state (a judgement of this round's step, not of the partner: no strike, nothing remembered).

Where it applies: a blocking landing (peer/round/streamed.py ``FragmentSchedule.gated``) and a
delayed one (peer/round/overlapped.py ``OverlapSchedule._gated``: the sync of round t − 1 judged at
the end of round t, its own step rebuilt from φ and the round's start ψ = φ − Δ). Not an eager
landing (its round starts from this peer's own preview, not φ − Δ, so its own Δ is not held) nor a
streamed fragment's (a fragment is not a model the loss can judge alone).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from peer.progress import SyncReport
from peer.reporting import Reporter
from peer.round.catchup import loss_refusal, phi_loss
from peer.train.data import PeekSampler

GATE_MARGIN = 0.03
"""How much worse (relative) than this peer's own step alone the group's step may leave φ on its next
batch and still be applied: 3 %. Honest exchanges (bench/byzantine.py's clean NoLoCo runs: 8 peers,
H = 25, 10 rounds, seeds 0 and 1, 160 judgements) left φ a median 0.4 % better than a step alone,
worse in a quarter of them, at most 2.2 % worse; an ALIE partner's (1 of 8, seed 0) accepted steps
were 0.3 % and 1.3 % worse, its others 3.9 % to 5.9 % (refused)."""
GATE_TOKENS = 4096
"""Tokens of this peer's next batches the gate evaluates each φ on (whole sequences, at least one):
read ahead from as many batches as that takes, up to :data:`GATE_MAX_BATCHES`. On one batch of the
tiny preset (8 sequences of 32 tokens) an honest exchange between real peers measured 3.4 % worse
than a step alone."""
GATE_MAX_BATCHES = 8
"""The most batches the gate reads ahead (they are then trained on, in order, as ever)."""


class LossGate:
    """Judges a group's outer step against this peer's own step alone, by their losses on the next
    batch of this peer's own data.

    Args:
        sampler: the inner loop's sampler (the same object), so the batch judged is trained on next.
        loss: the mean loss in nats per token of a φ (a list of tensors, one per model parameter, any
            device) on windows (int64, (sequences, seq_len + 1), host): an evaluation copy of the
            model, never the one training (peer/round/publishing.py ``Publisher.loss_on``).
        margin: :data:`GATE_MARGIN`.
    """

    def __init__(
        self,
        *,
        sampler: PeekSampler,
        loss: Callable[[Sequence[torch.Tensor], torch.Tensor], float],
        margin: float = GATE_MARGIN,
    ):
        if not margin >= 0:
            raise ValueError(f"margin = {margin!r}: expected a fraction >= 0")
        self.sampler, self.loss, self.margin = sampler, loss, margin

    def windows(self) -> torch.Tensor:
        """The sequences judged: the first ⌈:data:`GATE_TOKENS` / seq_len⌉ of the next batches (read
        ahead, at most :data:`GATE_MAX_BATCHES`), int64 (sequences, seq_len + 1) on the host."""
        s = self.sampler
        sequences = max(1, math.ceil(GATE_TOKENS / s.seq_len))
        batches = min(GATE_MAX_BATCHES, math.ceil(sequences / s.batch_sequences))
        return torch.cat(s.peek(batches))[:sequences]

    def refusal(self, alone: Sequence[torch.Tensor], grouped: Sequence[torch.Tensor]) -> str | None:
        """Why the group's step must not be applied, or None.

        Args:
            alone: φ after this peer's own step alone (fp32, one tensor per model parameter).
            grouped: φ after the group's step, alike.

        Returns:
            None when ``grouped``'s loss is finite and at most ``alone``'s × (1 + margin); else one
            sentence with both losses, for the round's note. Neither list is modified.
        """
        windows = self.windows()
        own = self.loss(alone, windows)
        theirs = self.loss(grouped, windows)
        if loss_refusal(theirs, own, tie=False, margin=self.margin) is None:  # the adoption check's rule
            return None
        if not math.isfinite(theirs):
            return f"the group's step leaves φ with loss {theirs} on this peer's next batches"
        return (
            f"the group's step leaves φ at loss {theirs:.4f} on this peer's next batches, "
            f"{100 * (theirs / own - 1):.1f} % over its own step's {own:.4f} (margin {100 * self.margin:g} %)"
        )


def applied_alone(reporter: Reporter, report: SyncReport, problem: str) -> SyncReport:
    """A landing whose group step the gate refused (``problem``, :meth:`LossGate.refusal`): warn, and
    the report of a step alone (no groupmate agreeing or holding this peer's state, no kept rows)."""
    reporter.emit("warning", message=f"{problem}: this peer's own step applied instead")
    note = "; ".join(filter(None, [report.note, f"applied its own step alone: {problem}"]))
    return dataclasses.replace(report, agreeing=(), completed=(), note=note, kept_rows=())


def copy_loss(model: torch.nn.Module) -> Callable[[Sequence[torch.Tensor], torch.Tensor], float]:
    """A :class:`LossGate` ``loss`` on an evaluation copy of ``model`` of its own (one model's memory,
    on its device), for a peer that keeps none for evaluating φ."""
    copied = copy.deepcopy(model)
    return lambda phi, windows: phi_loss(copied, windows, phi)
