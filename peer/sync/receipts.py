"""Equivocation caught (issue #51, item 3): receivers compare what each owner sent them.

An owner of pieces sends its MEAN frames to every groupmate; nothing in a single receiver's view
shows that it sent other bytes to another one (a mean 1e-5 off in one value passes every check of
peer/sync/screening.py, and splits the honest φ into one-member classes). So once a peer holds every
mean of the group, it sends each owner it exchanged with a RECEIPT (protocol/wire/allreduce.py): per
owner, a 16-byte BLAKE2b digest of the MEAN payloads it got from that owner, in piece order (its
own pieces: the payloads it sent). Every peer then holds, per owner, its own digest and one from
each groupmate whose receipt it read, over the same authenticated streams the means came on.

A receiver that refused one of an owner's means (peer/sync/screening.py ``owner_mean_problem``)
reports :data:`REFUSED` for that owner instead of a digest: its refusal is a vote, not a decision.

The verdict (:func:`verdict`), the same on every honest peer that read the same receipts:

* an owner whose pieces at least half of the reports refuse (its own report, an acceptance,
  counted), or whose digests are not all equal, has its pieces **skipped** this round (applied as
  zeros for Δ, as this peer's own values for φ), by every peer, the owner itself included, so the
  honest peers still hold one φ, and each peer carries its own Δ of those pieces into its next
  contribution (peer/sync/error_feedback.py), so the round's work there is delayed, not lost;
  an owner refused by fewer has its means applied by every peer,
  the receivers that refused them included (one receiver, honest or not, decides nothing alone);
  in a NoLoCo pair refusals are no votes (each receiver applies its own values, peer/sync/pairs.py);
* it is an **equivocator** when at least :data:`MIN_DISSENT` reporters disagree with the most
  common digest: a single differing receipt may be a lying receiver, so it costs the round's
  pieces but nobody's standing; the averager then ignores the equivocator (its contributions left
  out, its means replaced) from the next round (peer/sync/averager.py);
* a groupmate whose receipt misstates this peer's own means is a **liar** (this peer knows what it
  sent): this peer ignores its contributions;
* an owner whose Δ means are **misaligned** is skipped too (and so owns nothing for a while, as a
  refused one). Each receipt also reports, per owner, the sender's *alignment* with that owner's Δ
  means, a = Σ⟨x, m⟩ / Σ‖m‖² over the owner's pieces (x: what the sender contributed, m: the mean
  it got). For an honest weighted mean m = Σ w_i x_i / W the contributions' weighted average of a is
  exactly 1, and each one's is near 1; a mean turned away from the honest one (cosine c, same norm)
  gives about c, one scaled by s about 1/s, from every honest receiver, which no single receiver's
  check can see (each compares the mean only with its own Δ). The median over reporters (the
  owner's own report left out) is the owner's alignment; relative to the median over owners (a
  sender attack shifts every owner's alike) it must lie within :data:`ALIGNMENT_BAND`. Judged only
  in groups of :data:`ALIGNMENT_MIN_OWNERS` owners or more, each with
  :data:`ALIGNMENT_MIN_REPORTS` reports; never in a NoLoCo pair; only in blocking syncs
  (``sync.overlap = "none"``: with overlap a landing leaves part of the last mean in θ, so the next
  Δ is not the round's training alone, and honest owners' alignments in an 8-peer streaming swarm
  ranged from −2.9 to 3.4).

What this cannot do: receipts are not signed, so two colluding receivers that both misstate an
honest owner's means make it an equivocator; one receiver that sends different receipts to
different peers makes them skip different pieces (a split the re-sync rule then settles); a peer
in client mode owns no piece and reads no receipt, so it applies its own refusals alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.sync.pairs import PairTally, is_pair
from peer.sync.screening import EQUIVOCATOR_IGNORE_ROUNDS, Strikes, cap_weight
from protocol.wire import allreduce as frames
from protocol.wire.pieces import piece_view

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
REFUSED = bytes(DIGEST_BYTES)
"""What a receipt reports for an owner one of whose means its sender refused (no BLAKE2b digest is
all zeros in practice)."""
MIN_DISSENT = 2
"""Reporters that must disagree with an owner's most common digest for it to count as an equivocator."""
ALIGNMENT_BAND = (0.8, 1.5)
"""An owner's alignment relative to the median owner's: outside this, its pieces are skipped. Measured
on the round engine (8 peers, bench/byzantine.py's config): honest owners 0.99 to 1.01 in clean
rounds and 0.83 to 1.21 under the sender attacks with 2 of 8 malicious; an owner sending means at
cosine 0.72 with the honest ones 0.71 to 0.74, one scaling them by 2.5 0.40."""
ALIGNMENT_MIN_OWNERS = 4
"""Fewer owners with enough reports: no alignment verdict (the median owner is no reference)."""
ALIGNMENT_MIN_REPORTS = 3
"""Fewer reports on an owner: its alignment is not judged."""


class MeanDigests:
    """Running digests of the MEAN payloads each owner sent (or, for this peer, it sent), in piece order."""

    def __init__(self) -> None:
        self._hashes: dict[int, hashlib.blake2b] = {}
        self._refused: set[int] = set()
        self._dots: dict[int, list[float]] = {}

    def align(self, owner: int, mine: torch.Tensor, mean: torch.Tensor) -> None:
        """Fold one Δ piece into this peer's alignment with ``owner``: ``mine`` what it contributed,
        ``mean`` the owner's decoded mean (fp32 or bf16, one shape; float64 sums)."""
        sums = self._dots.setdefault(owner, [0.0, 0.0])
        m = mean.double()
        sums[0] += float((mine.double() * m).sum())
        sums[1] += float((m * m).sum())

    def alignments(self) -> dict[int, float]:
        """Owner index → Σ⟨x, m⟩ / Σ‖m‖² over its Δ pieces folded in (owners with a zero mean left out)."""
        return {owner: dot / sq for owner, (dot, sq) in self._dots.items() if sq > 0 and math.isfinite(dot / sq)}

    def refuse(self, owner: int) -> None:
        """Report :data:`REFUSED` for ``owner``: this peer refused one of its means."""
        self._refused.add(owner)

    def add(self, owner: int, payload: bytes) -> None:
        """Fold one MEAN frame payload of ``owner`` into its digest (call in piece order)."""
        h = self._hashes.get(owner)
        if h is None:
            h = self._hashes[owner] = hashlib.blake2b(digest_size=DIGEST_BYTES)
        h.update(payload)

    def digests(self) -> dict[int, bytes]:
        """Owner index → 16-byte digest of what it sent so far (:data:`REFUSED` for a refused one)."""
        return {owner: REFUSED if owner in self._refused else h.digest() for owner, h in self._hashes.items()}


@dataclass
class Verdict:
    """What the receipts of one all-reduce say (indices in the group)."""

    skipped: set[int] = field(default_factory=set)
    """Owners whose pieces are applied as refused this round (refused by half the reports, or their
    digests differ)."""
    refused: set[int] = field(default_factory=set)
    """Owners skipped because at least half of the reports refused their means."""
    equivocators: set[int] = field(default_factory=set)
    """Owners that at least :data:`MIN_DISSENT` reporters contradict: ignored from the next round."""
    liars: set[int] = field(default_factory=set)
    """Groupmates whose receipt misstates this peer's own means."""
    misaligned: set[int] = field(default_factory=set)
    """Owners (also in ``skipped``) whose alignment lies outside :data:`ALIGNMENT_BAND`."""


def verdict(
    me: int,
    mine: Mapping[int, bytes],
    receipts: Mapping[int, Mapping[int, bytes]],
    *,
    votes: bool = True,
    alignments: Mapping[int, Mapping[int, float]] | None = None,
) -> Verdict:
    """Compare this peer's digests with its groupmates' receipts.

    Args:
        me: this peer's index.
        mine: owner index → digest of the means this peer got from it (its own: the ones it sent).
        receipts: sender index → its receipt (owner index → digest), for every receipt read.
        votes: whether :data:`REFUSED` reports count as votes; False in a NoLoCo pair, whose
            receivers apply a refused mean as their own values alone (peer/sync/pairs.py): there a
            partner's REFUSED would let it skip every piece its honest owner reduced; nor is
            alignment judged.
        alignments: reporter index → its alignments by owner (this peer's own under ``me``);
            None: alignment is not judged.

    Returns:
        The :class:`Verdict`; owners this peer holds no digest of are not judged.
    """
    out = Verdict()
    for owner, own_digest in mine.items():
        reports = [own_digest] + [r[owner] for s, r in receipts.items() if s != me and owner in r]
        if votes and 2 * sum(d == REFUSED for d in reports) >= len(reports):
            out.skipped.add(owner)
            out.refused.add(owner)
        digests = [d for d in reports if d != REFUSED]
        counts = Counter(digests)
        if len(counts) <= 1:
            continue
        out.skipped.add(owner)
        if owner == me:
            out.liars.update(
                s for s, r in receipts.items() if s != me and r.get(owner, own_digest) not in (own_digest, REFUSED)
            )
        elif len(digests) - counts.most_common(1)[0][1] >= MIN_DISSENT:
            out.equivocators.add(owner)
    if votes and alignments is not None:
        out.misaligned = misaligned(alignments, owners=set(mine))
        out.skipped |= out.misaligned
    return out


def misaligned(alignments: Mapping[int, Mapping[int, float]], *, owners: set[int]) -> set[int]:
    """The ``owners`` whose alignment (the median of the reports on them, their own left out) lies
    outside :data:`ALIGNMENT_BAND` × the median of the owners' alignments; empty with fewer than
    :data:`ALIGNMENT_MIN_OWNERS` owners of :data:`ALIGNMENT_MIN_REPORTS` reports or more, or a
    median owner's alignment that is not positive.

    Args:
        alignments: reporter index → its finite alignments by owner index.
    """
    medians = owner_alignments(alignments, owners=owners)
    if len(medians) < ALIGNMENT_MIN_OWNERS:
        return set()
    reference = statistics.median(medians.values())
    if not reference > 0:
        return set()
    low, high = ALIGNMENT_BAND
    return {o for o, a in medians.items() if not low * reference <= a <= high * reference}


def owner_alignments(alignments: Mapping[int, Mapping[int, float]], *, owners: set[int]) -> dict[int, float]:
    """Each of ``owners``' alignment: the median of the finite reports on it, its own left out
    (only owners with :data:`ALIGNMENT_MIN_REPORTS` reports or more)."""
    medians = {}
    for owner in sorted(owners):
        reports = [a[owner] for r, a in alignments.items() if r != owner and owner in a and math.isfinite(a[owner])]
        if len(reports) >= ALIGNMENT_MIN_REPORTS:
            medians[owner] = statistics.median(reports)
    return medians


def distrust(stats: Any, peer_ids: Any, round_: int, *, strikes: Strikes, distrusted: Strikes) -> None:
    """After an all-reduce of ``round_``: ignore its equivocators (``stats.equivocators``, peer ids as
    ``str``) from the next round on, their means refused (:data:`EQUIVOCATOR_IGNORE_ROUNDS`, in
    ``distrusted``), and the groupmates whose receipt misstated this peer's means
    (``stats.receipt_liars``) for ``strikes.ignore_rounds`` (their contributions left out)."""
    for peer in peer_ids:
        if str(peer) in stats.equivocators:
            distrusted.ignore(peer, round_, EQUIVOCATOR_IGNORE_ROUNDS)
            logger.warning("ignoring groupmate %s from now on: it sent different means to different groupmates", peer)
        elif str(peer) in stats.receipt_liars:
            strikes.ignore(peer, round_)
            logger.warning("ignoring groupmate %s: its receipt misstated this peer's means", peer)


class ReceiptExchange:
    """The receipts half of :class:`peer.sync.allreduce.GroupAllreduce` (its state: ``_digests``,
    ``_receipts``, ``_receipt_writers``, ``_serving``, ``_changed``, ``plan``, ``tensors``, ``results``,
    ``stats``, ``timeout``, ``phi_from``, ``compensate``, ``stage``, ``_write``)."""

    _digests: MeanDigests
    _tallies: dict[int, PairTally]
    weight: float
    max_weight: float | None
    whole_delta: bool
    _receipts: dict[int, frames.Receipt]
    _receipt_writers: dict[int, asyncio.StreamWriter]
    _serving: set[int]
    _changed: asyncio.Condition
    plan: Any
    tensors: list[torch.Tensor]
    results: dict[int, torch.Tensor]
    stats: Any
    timeout: float
    phi_from: int | None
    compensate: Callable[[Any, torch.Tensor], torch.Tensor]
    stage: Callable[[Any, torch.Tensor, torch.Tensor | None], None]

    def _write(self, writer: asyncio.StreamWriter, payload: bytes) -> None:
        raise NotImplementedError

    async def _exchange_receipts(self, *, send: bool) -> None:
        """Write this peer's RECEIPT to every owner it exchanged with (when it holds every mean) and
        close those streams; then wait, at most one next-chunk timeout, for the senders' receipts."""
        receipt = frames.encode_receipt(self._digests.digests(), self._digests.alignments())
        for writer in self._receipt_writers.values():
            try:
                if send:
                    self._write(writer, receipt)
                    await asyncio.wait_for(writer.drain(), self.timeout)
            except (TimeoutError, ConnectionError) as exc:
                logger.debug("could not send a receipt: %r", exc)
            finally:
                writer.close()
        self._receipt_writers.clear()
        deadline = time.monotonic() + self.timeout
        async with self._changed:
            while self._serving and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    break

    def _judge_receipts(self) -> None:
        """Apply the receipts' verdict (peer/sync/receipts.py): the pieces of owners whose means
        differ between receivers become refused ones (a Δ piece's contribution staged whole as its
        residual), as do those of owners refused by half the reports or misaligned, and in a NoLoCo
        pair every piece of an owner this peer refused one of (its own values); equivocators and
        liars go into the stats."""
        votes = not is_pair(self.phi_from, len(self.plan.peer_ids))  # a pair's refusals are no votes
        me, receipts = self.plan.my_index, self._receipts
        alignments = {s: r.alignments for s, r in receipts.items() if s != me} | {me: self._digests.alignments()}
        digests = {s: r.digests for s, r in receipts.items()}
        # alignments only in a blocking sync: there Δ is the round's training alone; an overlapped
        # landing leaves part of the last mean in θ, and honest fragment means then need not align
        judged = alignments if self.whole_delta else None
        found = verdict(me, self._digests.digests(), digests, votes=votes, alignments=judged)
        ids = self.plan.peer_ids
        self.stats.equivocators = {str(ids[o]) for o in found.equivocators}
        self.stats.receipt_liars = {str(ids[s]) for s in found.liars}
        self.stats.skipped_owners = {str(ids[o]) for o in found.skipped}
        if not votes and self.whole_delta:  # a pair: the whole Δ its owner implies (pairs.py PairTally)
            weight = cap_weight(self.weight, self.max_weight)
            for owner, tally in self._tallies.items():
                partner = tally.partner_weight or self.max_weight or weight
                if (problem := tally.problem(weight, partner)) is None or str(ids[owner]) in self.stats.refused:
                    continue
                self.stats.refused[str(ids[owner])] = f"the partner's contribution it implies fails: {problem[0]}"
                self.stats.refused_pieces += tally.pieces
                if problem[1]:
                    self.stats.struck_owners.add(str(ids[owner]))
                logger.warning(
                    "all-reduce %s: refused the Δ of owner %d (%s): %s; applying this peer's own values",
                    self.plan.group_id.hex()[:8],
                    owner,
                    ids[owner],
                    problem[0],
                )
        # a pair's owner this peer refused on one piece is trusted on none (peer/sync/pairs.py): its
        # small pieces go unjudged, and an owner of Δ pieces only is refused without a strike
        caught = set() if votes else {o for o in range(len(ids)) if str(ids[o]) in self.stats.refused}
        for piece in self.plan.pieces:
            if piece.owner in found.skipped or piece.owner in caught:
                delta = self.phi_from is None or piece.tensor < self.phi_from
                own = piece_view(self.tensors[piece.tensor], piece)
                self.results[piece.index] = torch.zeros_like(own) if delta and votes else own.clone()
                if delta and votes:  # this peer's Δ there goes out again next sync (error feedback)
                    self.stage(piece, self.compensate(piece, own.float()), None)
        if equivocal := found.skipped - found.refused - found.misaligned:
            logger.warning(
                "all-reduce %s: owners %s sent different means to different groupmates; their pieces "
                "are applied as refused this round (equivocators: %s)",
                self.plan.group_id.hex()[:8],
                sorted(str(ids[o]) for o in equivocal),
                sorted(self.stats.equivocators) or "none",
            )
        if found.refused:
            logger.warning(
                "all-reduce %s: half of the group or more refused the means of owners %s; their pieces "
                "are applied as refused this round",
                self.plan.group_id.hex()[:8],
                sorted(str(ids[o]) for o in found.refused),
            )
        if found.misaligned:
            medians = owner_alignments(alignments, owners=set(self._digests.digests()))
            logger.warning(
                "all-reduce %s: the Δ means of owners %s are out of line with what the group contributed "
                "(their receivers' alignments %s, against the owners' median %.3g and the band %s); their "
                "pieces are applied as refused this round",
                self.plan.group_id.hex()[:8],
                sorted(str(ids[o]) for o in found.misaligned),
                ", ".join(f"{medians[o]:.3g}" for o in sorted(found.misaligned)),
                statistics.median(medians.values()),
                ALIGNMENT_BAND,
            )
