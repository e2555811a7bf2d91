"""Equivocation proven (issue #65, item 1): owners seal their means, receivers compare the seals.

An owner of pieces sends its MEAN frames to every groupmate; nothing in a single receiver's view
shows that it sent other bytes to another one (a mean 1e-5 off in one value passes every check of
peer/sync/screening.py, and splits the honest φ into one-member classes). So an owner ends each
stream with a SEAL (protocol/wire/allreduce.py): its identity key's signature of the 16-byte
BLAKE2b digest of the MEAN payloads it sent there, in piece order, for this group
(protocol/signing.py ``seal_means``). A receiver checks the seal against the digest it computed
itself and the owner's peer id; a missing or bad seal fails the exchange with that owner, as a
missing mean does (nothing from the round is applied). Once a peer holds every mean it sends each
owner it exchanged with a RECEIPT: per owner the digest it got, the owner's seal of it, whether it
refused one of that owner's means (peer/sync/screening.py ``owner_mean_problem``), and its
alignment with that owner's Δ means.

The verdict (:func:`verdict`), the same on every honest peer that read the same receipts:

* **Proof, not votes.** A receipt reporting, for some owner, a digest other than this peer's must
  carry that owner's valid seal of it. If it does, the owner signed two digests for one group: a
  proof that it sent different means to different receivers; it is an **equivocator**, its pieces
  are skipped this round (applied as zeros for Δ, as this peer's own values for φ; in an eager or
  streaming sync each peer carries its own Δ of those pieces into its next contribution,
  peer/sync/error_feedback.py, while a blocking or delayed landing keeps θ's progress there) and it is
  ignored from the next round on, kept across restarts. If it does not, the report contradicts what
  this peer received and no owner signed it: its sender is a **liar**, its whole receipt is not read
  (its refusals and alignments count for nothing) and it is named in the log; the owner is not
  touched. Nothing else changes for the liar (its contributions are screened as anyone's): leaving
  it out would cost the swarm its work and gain nothing. An honest receiver only ever reports seals
  it verified, so it is never a liar.
* **Refusals are a majority vote.** An owner whose means more than half of the reports refuse (this
  peer's own report counted) is skipped this round by every peer, the owner itself included, so the
  honest peers still hold one φ; nothing is kept of it but the host's suspicion
  (peer/sync/pieces.py ``Suspects``, in memory only). A minority of refusing receivers, honest or
  not, skips nothing. In a NoLoCo pair refusals are no votes (each receiver applies its own values,
  peer/sync/pairs.py).
* An owner whose Δ means are **misaligned** is skipped too. Each receipt reports, per owner, the
  sender's *alignment* with that owner's Δ means, a = Σ⟨x, m⟩ / Σ‖m‖² over the owner's pieces (x:
  what the sender contributed, m: the mean it got). For an honest weighted mean m = Σ w_i x_i / W
  the contributions' weighted average of a is exactly 1, and each one's is near 1; a mean turned
  away from the honest one (cosine c, same norm) gives about c, one scaled by s about 1/s, from every
  honest receiver, which no single receiver's check can see. The median over reporters (the owner's
  own report and liars left out) is the owner's alignment; relative to the median over owners (a
  sender attack shifts every owner's alike) it must lie within :data:`ALIGNMENT_BAND`. Judged only
  in groups of :data:`ALIGNMENT_MIN_OWNERS` owners or more, each with
  :data:`ALIGNMENT_MIN_REPORTS` reports; never in a NoLoCo pair; only where a Δ is one round's
  training alone (blocking, delayed, eager: protocol/specs.py ``delta_is_round_progress``; a streaming
  fragment's landing leaves part of the last mean in θ).

What this cannot do: a receiver may send different receipts to different peers. A false one is
caught by the peers it was sent to and changes no verdict on an owner. But an equivocating owner and
a colluding receiver can show the proof (the colluder's sealed mean) to some honest peers only:
those skip the owner's pieces and the others apply them, a split of φ that the re-sync rule settles
(peer/round/catchup.py), at the price of the owner's standing with every peer that saw the proof. A
peer in client mode owns no piece and reads no receipt, so it applies its own refusals alone. And
the verdict is the same only on peers that read the same receipts: an owner that a receipt did not
reach in time (one next-chunk timeout) may apply what the others skip. It counts the receipts it did
not read (``AllreduceStats.unread_receipts``), and its round then claims no groupmate holds its state
(peer/round/syncing.py), so the re-sync rule compares the states instead of assuming them equal.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.sync.pairs import PairTally, is_pair
from peer.sync.screening import EQUIVOCATOR_IGNORE_ROUNDS, Strikes, cap_weight
from protocol.errors import BadPayload
from protocol.signing import PeerSigner, seal_means, verify_means
from protocol.wire import allreduce as frames
from protocol.wire.pieces import piece_view

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
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
    """Running digests of the MEAN payloads each owner sent (or, for this peer, it sent), in piece
    order, with this peer's refusals and alignments: what its RECEIPT reports."""

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
        """Report that this peer refused one of ``owner``'s means (a vote in its RECEIPT)."""
        self._refused.add(owner)

    def add(self, owner: int, payload: bytes) -> None:
        """Fold one MEAN frame payload of ``owner`` into its digest (call in piece order)."""
        h = self._hashes.get(owner)
        if h is None:
            h = self._hashes[owner] = hashlib.blake2b(digest_size=DIGEST_BYTES)
        h.update(payload)

    def digest(self, owner: int) -> bytes:
        """The 16-byte digest of what ``owner`` sent so far (of nothing, if it sent nothing)."""
        h = self._hashes.get(owner)
        return (h or hashlib.blake2b(digest_size=DIGEST_BYTES)).digest()

    def receipt(self, signatures: Mapping[int, bytes]) -> frames.Receipt:
        """This peer's report: per owner the digest of its means, ``signatures[owner]`` (the owner's
        SEAL of it), whether this peer refused one of them, and its alignments."""
        digests = {owner: h.digest() for owner, h in self._hashes.items()}
        return frames.Receipt(
            digests,
            self.alignments(),
            frozenset(self._refused & set(digests)),
            {owner: signatures.get(owner, b"") for owner in digests},
        )


Sealed = Callable[[int, bytes, bytes], bool]
"""``sealed(owner, digest, signature)``: whether ``signature`` is ``owner``'s valid SEAL of ``digest``
in this group (protocol/signing.py ``verify_means`` with the owner's key)."""


@dataclass
class Verdict:
    """What the receipts of one all-reduce say (indices in the group)."""

    skipped: set[int] = field(default_factory=set)
    """Owners whose pieces are applied as refused this round (refused by a majority of the reports,
    proven equivocators, or misaligned)."""
    refused: set[int] = field(default_factory=set)
    """Owners skipped because more than half of the reports refused their means."""
    equivocators: set[int] = field(default_factory=set)
    """Owners proven to have sent different means to different receivers: a report carries the
    owner's valid SEAL of another digest than the one it sealed for this peer. Ignored from the next
    round on."""
    liars: set[int] = field(default_factory=set)
    """Groupmates whose receipt reports a digest of some owner that differs from this peer's and
    that the owner never sealed: their receipt is not read."""
    misaligned: set[int] = field(default_factory=set)
    """Owners (also in ``skipped``) whose alignment lies outside :data:`ALIGNMENT_BAND`."""


def verdict(
    me: int,
    mine: frames.Receipt,
    receipts: Mapping[int, frames.Receipt],
    *,
    sealed: Sealed,
    votes: bool = True,
    alignments: Mapping[int, Mapping[int, float]] | None = None,
) -> Verdict:
    """Compare this peer's report with its groupmates' receipts.

    Args:
        me: this peer's index.
        mine: this peer's own report (:meth:`MeanDigests.receipt`): per owner, the digest of the
            means it got (its own: the ones it sent) and whether it refused one.
        receipts: sender index → its receipt, for every receipt read.
        sealed: checks an owner's SEAL of a digest (:data:`Sealed`).
        votes: whether refusals count as votes; False in a NoLoCo pair, whose receivers apply a
            refused mean as their own values alone (peer/sync/pairs.py): there a partner's refusal
            would let it skip every piece its honest owner reduced; nor is alignment judged.
        alignments: reporter index → its alignments by owner (this peer's own under ``me``);
            None: alignment is not judged.

    Returns:
        The :class:`Verdict`; owners this peer holds no digest of are not judged. A liar's receipt
        counts for nothing: neither its refusals nor its alignments.
    """
    out = Verdict()
    for sender, receipt in receipts.items():
        if sender != me and any(
            owner in mine.digests
            and digest != mine.digests[owner]
            and not sealed(owner, digest, receipt.signatures.get(owner, b""))
            for owner, digest in receipt.digests.items()
        ):
            out.liars.add(sender)
    trusted = [r for s, r in receipts.items() if s != me and s not in out.liars]
    for owner, own in mine.digests.items():
        reports = [owner in mine.refused] + [owner in r.refused for r in trusted if owner in r.digests]
        if votes and 2 * sum(reports) > len(reports):
            out.skipped.add(owner)
            out.refused.add(owner)
        # every differing digest of a trusted report carries the owner's own SEAL: a proof
        if owner != me and any(r.digests.get(owner, own) != own for r in trusted):
            out.skipped.add(owner)
            out.equivocators.add(owner)
    if votes and alignments is not None:
        judged = {s: a for s, a in alignments.items() if s not in out.liars}
        out.misaligned = misaligned(judged, owners=set(mine.digests))
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


def distrust(stats: Any, peer_ids: Any, round_: int, *, distrusted: Strikes) -> None:
    """After an all-reduce of ``round_``: ignore its equivocators (``stats.equivocators``, peer ids as
    ``str``) from the next round on, their means refused (:data:`EQUIVOCATOR_IGNORE_ROUNDS`, in
    ``distrusted``): the owner's two seals prove it. A groupmate whose receipt reported a digest its
    owner never sealed (``stats.receipt_liars``) is not struck: its receipts are not read in any
    round they lie in, and its contributions are screened as anyone's, so leaving it out would only
    cost the swarm its work; nor could this peer show anyone else the lie (the stream is
    authenticated, the receipt not signed)."""
    for peer in peer_ids:
        if str(peer) in stats.equivocators:
            distrusted.ignore(peer, round_, EQUIVOCATOR_IGNORE_ROUNDS)
            logger.warning("ignoring groupmate %s from now on: it sent different means to different groupmates", peer)


class ReceiptExchange:
    """The receipts half of :class:`peer.sync.allreduce.GroupAllreduce` (its state: ``_digests``,
    ``_receipts``, ``_receipt_writers``, ``_serving``, ``_changed``, ``plan``, ``my_pieces``, ``tensors``, ``results``,
    ``stats``, ``timeout``, ``phi_from``, ``compensate``, ``stage``, ``_write``)."""

    _digests: MeanDigests
    _seals: dict[int, tuple[bytes, bytes]]
    """Owner index → (its public key, its SEAL signature of the digest of the means it sent this peer)."""
    signer: PeerSigner
    peer_key: Callable[[Any], str]
    _unheard: frozenset[int]
    """Groupmates whose receipts are not read (those ignored from the start of the exchange)."""
    _tallies: dict[int, PairTally]
    weight: float
    max_weight: float | None
    whole_delta: bool
    carry_skipped: bool
    _receipts: dict[int, frames.Receipt]
    _receipt_writers: dict[int, asyncio.StreamWriter]
    _serving: set[int]
    _changed: asyncio.Condition
    plan: Any
    my_pieces: list[Any]
    tensors: list[torch.Tensor]
    results: dict[int, torch.Tensor]
    stats: Any
    timeout: float
    phi_from: int | None
    compensate: Callable[[Any, torch.Tensor], torch.Tensor]
    stage: Callable[[Any, torch.Tensor, torch.Tensor | None], None]

    def _write(self, writer: asyncio.StreamWriter, payload: bytes) -> None:
        raise NotImplementedError

    def _own_seal(self) -> bytes:
        """Owner: the SEAL frame of the means this peer sent (call once every mean is made)."""
        me = self.plan.my_index
        signature = seal_means(self.signer, self.plan.group_id, self._digests.digest(me))
        self._seals[me] = (self.signer.public_der, signature)
        return frames.encode_seal(self.signer.public_der, signature)

    def _take_seal(self, owner: int, payload: bytes) -> None:
        """Sender: check ``owner``'s SEAL frame against the digest of the means it sent this peer.

        Raises:
            BadPayload: not a SEAL, or not ``owner``'s valid signature of that digest (the owner's
                means are then not applied: the exchange with it failed).
        """
        key, signature = frames.parse_seal(payload)
        digest = self._digests.digest(owner)
        if not verify_means(key, self.peer_key(self.plan.peer_ids[owner]), self.plan.group_id, digest, signature):
            raise BadPayload(f"owner {owner}'s SEAL is not its signature of the means it sent")
        self._seals[owner] = (key, signature)

    def _sealed(self, owner: int, digest: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is ``owner``'s valid SEAL of ``digest`` in this group (its key as
        this peer received it with its own SEAL)."""
        if owner not in self._seals:
            return False
        key = self._seals[owner][0]
        return verify_means(key, self.peer_key(self.plan.peer_ids[owner]), self.plan.group_id, digest, signature)

    async def _exchange_receipts(self, *, send: bool) -> None:
        """Write this peer's RECEIPT to every owner it exchanged with (when it holds every mean) and
        close those streams; then wait, at most one next-chunk timeout, for the senders' receipts."""
        mine = self._digests.receipt({owner: seal[1] for owner, seal in self._seals.items()})
        receipt = frames.encode_receipt(mine.digests, mine.alignments, refused=mine.refused, signatures=mine.signatures)
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
        """Apply the receipts' verdict (peer/sync/receipts.py): the pieces of owners proven to have
        sealed different means for different receivers become refused ones (a Δ piece's
        contribution staged whole as its residual), as do those of owners refused by more than half
        of the reports or misaligned, and in a NoLoCo
        pair every piece of an owner this peer refused one of (its own values); equivocators and
        liars go into the stats."""
        votes = not is_pair(self.phi_from, len(self.plan.peer_ids))  # a pair's refusals are no votes
        me = self.plan.my_index
        receipts = {s: r for s, r in self._receipts.items() if s not in self._unheard}
        mine = self._digests.receipt({owner: seal[1] for owner, seal in self._seals.items()})
        alignments = {s: r.alignments for s, r in receipts.items() if s != me} | {me: mine.alignments}
        # alignments only where Δ is the round's training alone (not streaming: a fragment's landing
        # leaves part of the last mean in θ, and honest fragment means then need not align)
        judged = alignments if self.whole_delta else None
        found = verdict(me, mine, receipts, sealed=self._sealed, votes=votes, alignments=judged)
        ids = self.plan.peer_ids
        if self.my_pieces:  # an owner hears every sender; a verdict
            # from fewer receipts than a groupmate read may differ from its verdict
            self.stats.unread_receipts = sum(s not in receipts for s in range(len(ids)) if s != me)
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
                if delta and votes:  # this peer's Δ there goes out again: carried, or kept in θ by a
                    # blocking landing (its residual then stays as it was)
                    compensated = self.compensate(piece, own.float())
                    self.stage(piece, compensated, None if self.carry_skipped else own.float())
                    if not self.carry_skipped:
                        self.stats.kept_rows.append((piece.tensor, piece.start, piece.stop))
        if found.equivocators:
            logger.warning(
                "all-reduce %s: owners %s signed different means for different groupmates (proven by their "
                "own seals); their pieces are applied as refused this round",
                self.plan.group_id.hex()[:8],
                sorted(self.stats.equivocators),
            )
        if found.liars:
            logger.warning(
                "all-reduce %s: the receipts of groupmates %s report means their owners never signed; not read",
                self.plan.group_id.hex()[:8],
                sorted(self.stats.receipt_liars),
            )
        if found.refused:
            logger.warning(
                "all-reduce %s: more than half of the group refused the means of owners %s; their pieces "
                "are applied as refused this round",
                self.plan.group_id.hex()[:8],
                sorted(str(ids[o]) for o in found.refused),
            )
        if found.misaligned:
            medians = owner_alignments(alignments, owners=set(mine.digests))
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
