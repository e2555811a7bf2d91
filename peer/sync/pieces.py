"""The plan of one group all-reduce: pieces, their owners, codecs and seeds.

Every groupmate derives the same plan from the payload's shapes, the group and the round, so
both ends of a stream agree on what each frame carries without sending it (peer/sync/allreduce.py).
The state transfer cuts its chunks with the same :func:`plan_pieces` (peer/state/snapshot.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from protocol import codecs, groups
from protocol.manifest import CompressionSpec

PIECE_ELEMENTS = 1 << 18
"""Default piece size: 256 Ki elements (1 MiB of fp32), small enough to pipeline the phases."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``tensor`` (the whole tensor for 0-d), reduced by ``owner``."""

    index: int
    tensor: int
    start: int
    stop: int
    owner: int
    """Position in the group (not in the owner list)."""


def plan_pieces(shapes: Sequence[torch.Size], owners: Sequence[int], *, piece_elements: int = PIECE_ELEMENTS,
                split: Callable[[int], bool] = lambda index: True) -> list[Piece]:
    """Cut tensors into row pieces and deal them to ``owners`` (group positions) in contiguous runs.

    Args:
        shapes: the payload's tensor shapes, in payload order.
        owners: group positions of the peers that reduce pieces (not in client mode), ascending.
        piece_elements: target elements per piece; a piece is never smaller than one row.
        split: ``split(i)`` False keeps tensor i whole (low-rank codecs want whole matrices).

    Returns:
        Pieces in payload order; every row of every non-empty tensor is in exactly one piece.
    """
    if not owners:
        raise ValueError("a group needs at least one owner")
    raw: list[tuple[int, int, int, int]] = []  # tensor, start, stop, elements
    for index, shape in enumerate(shapes):
        numel = math.prod(shape)
        if numel == 0:
            continue
        if len(shape) == 0:
            raw.append((index, 0, 1, 1))
            continue
        rows, row_size = shape[0], numel // shape[0]
        step = rows if not split(index) else max(1, piece_elements // max(1, row_size))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            raw.append((index, start, stop, (stop - start) * row_size))
    total = sum(r[3] for r in raw)
    pieces, done = [], 0
    for i, (tensor, start, stop, numel) in enumerate(raw):
        # owner k takes the pieces whose midpoint falls in [k/n, (k+1)/n) of the elements
        mid = (done + numel / 2) / max(1, total)
        owner = owners[min(len(owners) - 1, int(mid * len(owners)))]
        pieces.append(Piece(index=i, tensor=tensor, start=start, stop=stop, owner=owner))
        done += numel
    return pieces


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    return tensor if tensor.dim() == 0 else tensor[piece.start:piece.stop]


def piece_shape(shape: Sequence[int], piece: Piece) -> tuple[int, ...]:
    """Shape of ``piece`` of a tensor shaped ``shape``."""
    return tuple(shape) if len(shape) == 0 else (piece.stop - piece.start, *shape[1:])


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


def make_group_plan(tensors: Sequence[torch.Tensor], *, group_id: bytes, peer_ids: Sequence, my_index: int,
                    owners: Sequence[int], round_: int, compression: CompressionSpec, phi_from: int | None,
                    piece_elements: int | None, uplink_bytes_per_s: float) -> GroupPlan:
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
        from peer.sync.adaptive import plan as adaptive_plan

        per_tensor[:n_delta] = adaptive_plan(list(tensors[:n_delta]), compression,
                                             uplink_bytes_per_s=uplink_bytes_per_s, group_size=n)
    piece_codecs = [per_tensor[p.tensor] or codecs.make_codec(compression, piece_shape(shapes[p.tensor], p),
                                                              role="delta" if p.tensor < n_delta else "phi")
                    for p in pieces]
    return GroupPlan(group_id=group_id, peer_ids=tuple(peer_ids), my_index=my_index, pieces=pieces,
                     codecs=piece_codecs, mean_codecs=[c.for_mean(n) for c in piece_codecs],
                     max_piece_bytes=[codecs.max_encoded_bytes(piece_shape(shapes[p.tensor], p)) for p in pieces],
                     seeds=[groups.codec_seed(round_, p.index) for p in pieces])
