"""A group's all-reduce as the network computes it, in one process (the in-process hub's rules).

:func:`screened_means` deals a group's pieces with peer/sync/pieces.py's plan and aggregates them
with the network's own functions (peer/sync/robust.py ``piece_mean``, peer/sync/screening.py's
screening, receivers' check and strikes); :class:`GroupHooks` are where a lab adversary
(lab/adversary.py) forges what a malicious peer sends. lab/inprocess.py's hub calls them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peer.sync.pairs import PairTally, is_pair, keeps_own, partner_problem, receiver_problem, whole_partner_problem
from peer.sync.pieces import Suspects, make_group_plan, trusted_owners
from peer.sync.receipts import MeanDigests, misaligned
from peer.sync.robust import piece_mean
from peer.sync.screening import SmallPieces, Strikes, cap_weight, reference_rms, small_piece
from protocol.manifest import CompressionSpec
from protocol.records import ProgressRecord
from protocol.wire.pieces import Piece, piece_view


@dataclass(frozen=True)
class PieceRules:
    """How an :class:`InProcessHub` aggregates a group as the network's all-reduce does (the run's
    settings a NetworkTransport is built with, peer/node.py).

    Args:
        compression: the run's codecs: whether tensors are cut into row pieces (low rank and
            adaptive keep them whole), and each contribution and mean goes through its codec's
            encode and decode as on the wire (an owner's own rows exact, as in the network).
        piece_elements: target piece size (None: protocol/wire/pieces.py ``PIECE_ELEMENTS``).
        max_weight: the token cap on one contribution (peer/sync/screening.py ``round_token_cap``);
            None: no cap.
        whole_delta: whether a pair's receiver judges its owner's whole Δ (peer/sync/pairs.py
            ``PairTally``) and a group's receipts judge the owners' alignments
            (peer/sync/receipts.py ``misaligned``), as a NetworkTransport does where a Δ is one
            round's training alone (protocol/specs.py ``delta_is_round_progress``).
    """

    compression: CompressionSpec = field(default_factory=CompressionSpec)
    piece_elements: int | None = None
    max_weight: float | None = None
    whole_delta: bool = True
    uplink_bytes_per_s: float = 1e9
    """Every member's uplink as the adaptive codec's plan reads it (peer/sync/adaptive.py), bytes/s."""


class GroupHooks(Protocol):
    """What a lab adversary (lab/adversary.py) may change in an :class:`InProcessHub`; every hook
    returns its input unchanged for an honest peer."""

    def contribution(
        self, peer_id: str, payload: list[torch.Tensor], weight: float, phi_from: int | None
    ) -> tuple[list[torch.Tensor], float]:
        """What ``peer_id`` sends into its group instead of ``payload`` (fp32 copies, Δ then φ from
        ``phi_from``) and the token weight it claims instead of ``weight``."""
        ...

    def owner_mean(self, owner: str, receiver: str, piece: Piece, mean: torch.Tensor, phi: bool) -> torch.Tensor:
        """The mean of ``piece`` that ``owner`` sends ``receiver`` instead of ``mean`` (the fp32 mean it
        computed; ``phi``: a piece of φ, NoLoCo)."""
        ...

    def records(self, peer_id: str, record: ProgressRecord, hub: Any) -> list[tuple[str, ProgressRecord]]:
        """The (peer id, record) pairs published when ``peer_id`` publishes ``record``."""
        ...

    def served(self, peer_id: str, snapshots: list[Any]) -> list[Any]:
        """The snapshots ``peer_id`` serves instead of ``snapshots`` (its round loop's; empty for an
        identity without a round loop)."""
        ...


@dataclass
class MemberOutcome:
    """One member's side of a group aggregated by :func:`screened_means`."""

    mean: list[torch.Tensor] | None
    """What it applies (fp32, the payload's shapes), or None: some piece's mean did not reach it valid."""
    error: str = ""
    """Why ``mean`` is None."""
    excluded: int = 0
    """Senders it, as an owner, left out of its means (ignored, non-finite, φ far off)."""
    partial_pieces: int = 0
    """Pieces it owns or received whose mean left out a sender."""
    refused: dict[str, str] = field(default_factory=dict)
    """Owners whose mean of some piece it refused (``owner_mean_problem``), with the first reason."""
    refused_pieces: int = 0
    bytes_sent: int = 0
    """Encoded bytes it sends as the wire would carry them (no frame headers): its contribution to
    each piece another member owns, and the mean of each piece it owns to every other member."""
    bytes_received: int = 0
    """Encoded bytes it receives: every other member's contribution to its pieces, the other owners' means."""
    decoded: list[tuple[Piece, torch.Tensor]] = field(default_factory=list)
    """With a lossy codec: each piece it contributed to another owner (or to its own, a structured
    codec's) as that owner decoded it (fp32): its error-feedback residual there is its contribution
    minus this (GroupAllreduce._encode_contribution stages the same)."""
    carried: list[tuple[Piece, torch.Tensor]] = field(default_factory=list)
    """The Δ pieces the receipts skipped, each with this member's contribution to it (fp32): what it
    adds to its next contribution (peer/sync/error_feedback.py, as the network's residuals carry it)."""


def screened_means(
    ids: Sequence[str],
    payloads: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    *,
    round_: int,
    key: Hashable,
    rules: PieceRules,
    phi_from: int | None,
    strikes: dict[str, Strikes],
    hooks: GroupHooks | None = None,
    suspects: dict[str, Suspects] | None = None,
) -> list[MemberOutcome]:
    """A group's all-reduce as peer/sync/allreduce.py computes it, in one process.

    The plan is peer/sync/pieces.py ``make_group_plan`` over ``ids`` (every member an owner, pieces
    dealt in contiguous runs). For each piece its owner, as ``GroupAllreduce._reduce_my_pieces``:
    leaves out the senders its ``strikes`` ignore at ``round_`` and, for the rest of the group, a
    sender whose contribution holds NaN or inf or (a φ piece of NoLoCo) fails
    peer/sync/pairs.py ``partner_problem`` against its own, and in a NoLoCo pair, for this piece
    only, a partner's Δ that fails it; caps the claimed weights (``cap_weight``) and
    takes ``piece_mean`` (clip to the median, fp32 sum in member order). A mean that is not finite
    fails the piece for everyone. The owner applies its own mean; every other member receives the
    mean the owner sends it (``hooks.owner_mean``: a lying owner may forge it, per receiver) and
    checks it as ``GroupAllreduce._checked_mean`` does (``receiver_problem`` against its own
    contribution, with its claimed weight, the count included, the cap, the φ checks, the
    floor from its payload's ``reference_rms`` and in a pair the owner's contribution the mean
    implies, its whole Δ judged once every mean is in, ``PairTally``); a refused φ piece, or any of a pair, is applied as the member's own values, a
    refused Δ piece of a larger group is a vote, as in the receipts (peer/sync/receipts.py
    ``verdict``): an owner refused by more than half of the group's n reports has its pieces applied
    by every member as refused (Δ: zeros, each member's contribution there in its ``carried``; φ:
    the member's own values), as is an owner whose
    receivers got different means of a piece (their receipts' digests would differ), any other's
    means as received (an owner whose Δ means its receivers' alignments find out of line, receipts.py
    ``misaligned``, skipped too); a received mean that is not finite fails that member's sync (its decode
    check). Afterwards each member's :class:`~peer.sync.screening.Strikes` records the
    senders it clipped or dropped as an owner and the owners it refused with a strike, as
    ``LocoAverager._strike`` does.

    Args:
        ids: the members in group order; ``payloads[i]`` (fp32, Δ then φ from ``phi_from``) and
            ``weights[i]`` (claimed tokens) are member i's, as sent.
        key: the group's key (its plan's group id is derived from it).
        strikes: per member id, its strikes (created when missing); updated in place.
        suspects: per member id, the owners it names in its gathered ``distrust`` list (created
            when missing; updated in place): the owners the votes skipped, which own no piece while
            half of the group names them (peer/sync/pieces.py ``trusted_owners``), as in the network.

    Returns:
        One :class:`MemberOutcome` per member, in ``ids`` order.
    """
    n, pair = len(ids), is_pair(phi_from, len(ids))
    suspects = {} if suspects is None else suspects
    named = [suspects.setdefault(m, Suspects()).named(round_) for m in ids]
    plan = make_group_plan(
        payloads[0],
        group_id=repr(key).encode(),
        peer_ids=list(ids),
        my_index=0,
        owners=trusted_owners(range(n), ids, named),
        round_=round_,
        compression=rules.compression,
        phi_from=phi_from,
        piece_elements=rules.piece_elements,
        uplink_bytes_per_s=rules.uplink_bytes_per_s,
    )
    book = [strikes.setdefault(p, Strikes()) for p in ids]
    ignored = [{ids.index(p) for p in book[o].ignored(round_) if p in ids} - {o} for o in range(n)]
    excluded: list[set[int]] = [set(x) for x in ignored]
    offenders: list[set[int]] = [set() for _ in range(n)]
    struck: list[set[int]] = [set() for _ in range(n)]
    refusers: list[set[int]] = [set() for _ in range(n)]  # per owner: the members that refused a mean of it
    tallies: dict[tuple[int, int], PairTally] = {}  # a pair: per (receiver, owner), the owner's whole Δ
    smalls: dict[tuple[int, int], SmallPieces] = {}  # a group: per (receiver, owner), its small Δ pieces
    equivocal: set[int] = set()  # owners whose receivers got different means of a piece
    firsts: dict[int, torch.Tensor] = {}  # per piece: the mean its first receiver got
    digests = [MeanDigests() for _ in range(n)]  # each member's alignments with each owner
    out = [MemberOutcome(mean=[torch.zeros(t.shape, dtype=torch.float32) for t in payloads[0]]) for _ in range(n)]
    split = len(payloads[0]) if phi_from is None else phi_from
    references = [
        {True: reference_rms(p[:split]), False: reference_rms(p[split:])} for p in payloads
    ]  # the floor of each receiver's norm bound, Δ and φ apart
    failed = ""
    away: list[set[int]] = [set() for _ in range(n)]  # a pair's owner: partners left out of every Δ piece
    for o in range(n) if pair and rules.whole_delta else ():
        mine = [p for p in plan.pieces if p.owner == o and p.tensor < split]
        ours = [piece_view(payloads[o][p.tensor], p).float() for p in mine]
        for s_ in [s_ for s_ in range(n) if s_ != o and s_ not in excluded[o]] if mine else ():
            theirs = [piece_view(payloads[s_][p.tensor], p).float() for p in mine]
            if not all(bool(torch.isfinite(t).all()) for t in theirs + ours):
                continue  # a non-finite contribution is excluded below
            w_o, w_s = (cap_weight(float(weights[m]), rules.max_weight) for m in (o, s_))
            if (found := whole_partner_problem(theirs, ours, weight=w_o, partner_weight=w_s)) is not None:
                away[o].add(s_)
                if found[1]:
                    offenders[o].add(s_)
    for piece in plan.pieces:
        o, delta = piece.owner, phi_from is None or piece.tensor < phi_from
        views = [piece_view(p[piece.tensor], piece).float() for p in payloads]
        codec, seed = plan.codecs[piece.index], plan.seeds[piece.index]
        shape = tuple(views[o].shape)
        sizes = (codec.encoded_size(shape), plan.mean_codecs[piece.index].encoded_size(shape))
        for m in range(n):
            out[m].bytes_sent += sizes[1] * (n - 1) if m == o else sizes[0]
            out[m].bytes_received += sizes[0] * (n - 1) if m == o else sizes[1]
        for s_ in range(n) if codec.lossy else ():  # what the owner decodes (its own rows stay exact)
            if (s_ != o or codec.structured) and bool(torch.isfinite(views[s_]).all()):
                views[s_] = codec.roundtrip(views[s_], seed=seed)[1]
                out[s_].decoded.append((piece, views[s_]))
        for s_ in range(n):
            if s_ not in excluded[o] and not torch.isfinite(views[s_]).all():
                excluded[o].add(s_)  # a sender's BadPayload (a strike), or the owner's own piece
                if s_ != o:
                    offenders[o].add(s_)
        left_out = set(away[o]) if delta else set()  # a pair's Δ its owner leaves out (this piece or whole)
        if phi_from is not None and o not in excluded[o]:
            for s_ in [s_ for s_ in range(n) if s_ != o and s_ not in excluded[o]]:
                w_o, w_s = (cap_weight(float(weights[m]), rules.max_weight) for m in (o, s_))
                scale = w_o / w_s
                found = partner_problem(
                    views[s_], views[o], phi=not delta, pair=pair, scale=scale, reference_rms=references[o][delta]
                )
                if found is not None:
                    (left_out if delta else excluded[o]).add(s_)
                    if found[1]:
                        offenders[o].add(s_)
        included = [s_ not in excluded[o] and s_ not in left_out for s_ in range(n)]
        senders = [s_ for s_ in range(n) if included[s_]]
        if not senders:
            failed = failed or f"piece {piece.index}: no contribution to average"
            continue
        parts = [(cap_weight(float(weights[s_]), rules.max_weight), views[s_]) for s_ in senders]
        mean, clipped = piece_mean(parts)
        if plan.mean_codecs[piece.index].lossy and bool(torch.isfinite(mean).all()):  # the MEAN frame's codec
            mean = plan.mean_codecs[piece.index].roundtrip(mean, seed=seed)[1]
        offenders[o].update(senders[c] for c in clipped)
        if not torch.isfinite(mean).all():
            failed = failed or f"the mean of piece {piece.index} is not finite"
            continue
        partial = not all(included)
        for r in range(n):
            target = piece_view(out[r].mean[piece.tensor], piece)  # type: ignore[index]
            out[r].partial_pieces += partial
            if r == o:
                target.copy_(mean)
                continue
            sent = hooks.owner_mean(ids[o], ids[r], piece, mean, not delta) if hooks is not None else mean
            if not torch.isfinite(sent).all():
                out[r].error = out[r].error or f"owner {ids[o]}: piece {piece.index} holds NaN or inf"
                continue
            target.copy_(sent)  # the receipts' verdict below may replace it
            if delta and not pair:  # the alignment r reports on o in its receipt
                digests[r].align(o, views[r], sent)
            first = firsts.setdefault(piece.index, sent)
            if first is not sent and not torch.equal(first, sent):
                equivocal.add(o)  # receivers got different means: their receipts' digests differ
            problem = receiver_problem(
                sent,
                views[r],
                weight=float(weights[r]),
                included=len(senders),
                max_weight=rules.max_weight,
                phi=not delta,
                included_self=included[r],
                reference_rms=references[r][delta],
                pair=pair,
                tally=tallies.setdefault((r, o), PairTally()) if pair and delta else None,
            )
            if problem is None:
                if delta and not pair and small_piece(sent):  # judged with o's other small pieces
                    smalls.setdefault((r, o), SmallPieces()).add(
                        sent, views[r], included=len(senders), included_self=included[r]
                    )
                continue
            if not keeps_own(not delta, pair):
                refusers[o].add(r)
            else:  # φ (NoLoCo) or a pair: this member's own values at once, as GroupAllreduce._checked_mean
                target.copy_(views[r])
            out[r].refused_pieces += 1
            out[r].refused.setdefault(ids[o], str(problem))
            if problem.strike:
                struck[r].add(o)
    for (r, o), small in smalls.items():  # each owner's small Δ pieces together, in every schedule
        refusal = small.problem(
            weight=float(weights[r]), max_weight=rules.max_weight, reference_rms=references[r][True]
        )
        if refusal is not None:
            refusers[o].add(r)
            out[r].refused_pieces += small.pieces
            out[r].refused.setdefault(ids[o], str(refusal))
            if refusal.strike:
                struck[r].add(o)
    for (r, o), tally in tallies.items() if rules.whole_delta else ():  # a pair's whole Δ, at the receipts
        w_r, w_o = (cap_weight(float(weights[m]), rules.max_weight) for m in (r, o))
        if (found := tally.problem(w_r, w_o)) is not None and ids[o] not in out[r].refused:
            out[r].refused[ids[o]] = f"the partner's contribution it implies fails: {found[0]}"
            out[r].refused_pieces += tally.pieces
            if found[1]:
                struck[r].add(o)
    # the receipts' verdict (peer/sync/receipts.py): an owner refused by most of the group's reports
    # (its own an acceptance) is skipped by every member, the others' means are applied by all
    skipped = {o for o in range(n) if 2 * len(refusers[o]) > n} | equivocal
    if not pair and rules.whole_delta:  # a blocking sync's Δ (receipts.py: alignments)
        skipped |= misaligned({r: digests[r].alignments() for r in range(n)}, owners={p.owner for p in plan.pieces})
    for member in ids:
        suspects[member].add([ids[o] for o in skipped], round_)
    for piece in plan.pieces:
        delta = phi_from is None or piece.tensor < phi_from
        for r in range(n):
            # a pair's owner refused on one piece is trusted on none (as GroupAllreduce._judge_receipts)
            caught = pair and ids[piece.owner] in out[r].refused
            if (held := out[r].mean) is not None and (piece.owner in skipped or caught):
                target = piece_view(held[piece.tensor], piece)
                own = piece_view(payloads[r][piece.tensor], piece).float()
                target.copy_(torch.zeros_like(target) if delta and not pair else own)
                if delta and not pair:
                    out[r].carried.append((piece, own.clone()))
    for m in range(n):
        out[m].excluded = len(excluded[m])
        book[m].record(round_, [ids[x] for x in sorted(offenders[m] | struck[m])])
        if failed or out[m].error:
            out[m].mean, out[m].error = None, failed or out[m].error
    return out
