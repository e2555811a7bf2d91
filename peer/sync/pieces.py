"""The plan of one group all-reduce: pieces, their owners, codecs and seeds.

Every groupmate derives the same plan from the payload's shapes, the group and the round, so
both ends of a stream agree on what each frame carries without sending it (peer/sync/allreduce.py).
Only the codec a peer encodes with may be its own (:func:`stronger_compression`): encodings are
self-describing, and a receiver bounds only their size.
The pieces are cut by protocol/wire/pieces.py ``plan_pieces``, as the state transfer's chunks are
(peer/state/snapshot.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peer.sync.adaptive import plan as adaptive_plan
from protocol import codecs, groups
from protocol.manifest import CompressionSpec
from protocol.wire.pieces import PIECE_ELEMENTS, Piece, piece_shape, plan_pieces

STRONGER_CODEC = {"none": "int8", "fp16": "int8", "bf16": "int8", "int8": "int4"}
"""The codec a peer over its share of ``--max-gb-per-day`` sends with instead of the run's (about half
the bytes or fewer; the same pieces, so its groupmates' plans still match). The run's other codecs
have no stronger one here: 4-bit codecs, top-k and low-rank already send few bytes, and the adaptive
codec fits its own budget."""


def stronger_compression(compression: CompressionSpec) -> CompressionSpec:
    """``compression`` with the Δ codec replaced by :data:`STRONGER_CODEC`'s (φ's untouched), or
    ``compression`` itself where there is none. Error feedback, where the run keeps it, carries the
    larger error into the next round as it does the run's codec's."""
    codec = STRONGER_CODEC.get(compression.codec)
    return compression if codec is None else dataclasses.replace(compression, codec=codec)


SUSPECT_ROUNDS = 100
"""Rounds a peer names an owner in its gathered ``distrust`` list after the group's receipts skipped
that owner's pieces (refused by most reports, misaligned, or a proven equivocator): while half the
group names it, it owns no piece (:func:`trusted_owners`), so a lying owner costs one round's pieces and then
only its own contribution, which the owners' CenteredClip bounds. An honest owner named by mistake
loses nothing but its share of the reduction work."""
MAX_DISTRUST = 64
"""Peer ids read from one groupmate's gathered ``distrust`` list (the rest is ignored)."""


class Suspects:
    """The owners this peer's groups' receipts skipped, each named for :data:`SUSPECT_ROUNDS` rounds
    (peer ids as ``str``; at most :data:`MAX_DISTRUST`, the latest kept). Those proven to have
    equivocated are kept across restarts (:meth:`named_until`); the others, skipped by a majority's
    refusals or their alignment, only while this process runs."""

    def __init__(self) -> None:
        self._until: dict[str, int] = {}
        self._proven: set[str] = set()

    def add(self, peers, round_: int, *, proven=()) -> None:
        """Name ``peers`` (peer ids) from ``round_`` on; those in ``proven`` are proven equivocators."""
        proven = {str(p) for p in proven}
        for peer in peers:
            self._until.pop(str(peer), None)
            self._until[str(peer)] = round_ + SUSPECT_ROUNDS
            if str(peer) in proven:
                self._proven.add(str(peer))
        while len(self._until) > MAX_DISTRUST:
            self._proven.discard(oldest := next(iter(self._until)))
            self._until.pop(oldest)

    def named(self, round_: int) -> list[str]:
        """The peers named at ``round_``, sorted."""
        self._until = {p: r for p, r in self._until.items() if r > round_}
        self._proven &= set(self._until)
        return sorted(self._until)

    def named_until(self) -> dict[str, int]:
        """Each proven equivocator named → the first round it is no longer named, oldest first (a
        copy, kept across restarts by peer/sync/suspicion_store.py: nothing unproven is kept)."""
        return {p: r for p, r in self._until.items() if p in self._proven}


def trusted_owners(owners: Sequence[int], peer_ids: Sequence[str], distrust: Sequence[object]) -> list[int]:
    """``owners`` without those that at least half of the group name in their gathered ``distrust``
    lists (``distrust[i]``: groupmate i's, anything a peer sent; not a list of str, or past
    :data:`MAX_DISTRUST` entries, counts for nothing); every groupmate computes the same list from
    the same gathered data. All of them named: ``owners`` unchanged (someone must reduce)."""
    n = len(peer_ids)
    named: dict[str, int] = {}
    for listed in distrust:
        if isinstance(listed, list | tuple):
            for peer in {x for x in listed[:MAX_DISTRUST] if isinstance(x, str)}:
                named[peer] = named.get(peer, 0) + 1
    kept = [i for i in owners if 2 * named.get(str(peer_ids[i]), 0) < n]
    return kept or list(owners)


@dataclass(frozen=True)
class GroupPlan:
    """Everything both sides of a stream must agree on for one group."""

    group_id: bytes
    peer_ids: tuple
    """Group members in matchmaking order (hivemind PeerIDs)."""
    my_index: int
    pieces: list[Piece]
    codecs: list  # per piece: protocol.codecs.Codec used to send this peer's contribution
    mean_codecs: list  # per piece: codec for the owner's mean
    max_piece_bytes: list[int]
    seeds: list[int]


def make_group_plan(
    tensors: Sequence[torch.Tensor],
    *,
    group_id: bytes,
    peer_ids: Sequence,
    my_index: int,
    owners: Sequence[int],
    round_: int,
    compression: CompressionSpec,
    phi_from: int | None,
    piece_elements: int | None,
    uplink_bytes_per_s: float,
) -> GroupPlan:
    """Plan one group's all-reduce of ``tensors`` (this peer's payload, fp32).

    Args:
        owners: group positions of the groupmates not in client mode, ascending (at least one).
        round_: the round all groupmates are at; with the piece index it seeds the codecs
            (protocol/groups.py).
        compression: the run's codecs; low-rank and adaptive keep tensors whole.
        phi_from: index of the first tensor that is φ, not Δ (NoLoCo; ``compression.phi_codec``),
            or None.
        piece_elements: target piece size, or None for :data:`PIECE_ELEMENTS`.
        uplink_bytes_per_s: this peer's measured uplink, for the adaptive codec policy.

    Returns:
        The plan; codecs may take a while to choose (adaptive), so call this off the event loop.
    """
    shapes = [t.shape for t in tensors]
    n = len(peer_ids)
    # low-rank codecs want whole matrices; the adaptive policy may choose low rank anywhere
    whole = compression.codec in ("lowrank", "adaptive")
    pieces = plan_pieces(shapes, owners, split=lambda index: not whole, piece_elements=piece_elements or PIECE_ELEMENTS)
    n_delta = len(shapes) if phi_from is None else phi_from
    per_tensor = [None] * len(shapes)
    if compression.codec == "adaptive":
        per_tensor[:n_delta] = adaptive_plan(
            list(tensors[:n_delta]), compression, uplink_bytes_per_s=uplink_bytes_per_s, group_size=n
        )
    piece_codecs = [
        per_tensor[p.tensor]
        or codecs.make_codec(
            compression, piece_shape(shapes[p.tensor], p), role="delta" if p.tensor < n_delta else "phi"
        )
        for p in pieces
    ]
    return GroupPlan(
        group_id=group_id,
        peer_ids=tuple(peer_ids),
        my_index=my_index,
        pieces=pieces,
        codecs=piece_codecs,
        mean_codecs=[c.for_mean(n) for c in piece_codecs],
        max_piece_bytes=[codecs.max_encoded_bytes(piece_shape(shapes[p.tensor], p)) for p in pieces],
        seeds=[groups.codec_seed(round_, p.index) for p in pieces],
    )
