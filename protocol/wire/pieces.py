"""Row pieces of a payload: how a list of tensors is cut into pieces and dealt to owners.

Both ends of a stream cut the same payload shapes the same way, so a frame carries a piece's index
and bytes, never its bounds: the group all-reduce (peer/sync/pieces.py ``make_group_plan``, frames
of protocol/wire/allreduce.py) and the state transfer (peer/state/snapshot.py, frames of
protocol/wire/state.py) both cut with :func:`plan_pieces`. Changing it changes what peers agree on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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


def plan_pieces(
    shapes: Sequence[torch.Size],
    owners: Sequence[int],
    *,
    piece_elements: int = PIECE_ELEMENTS,
    split: Callable[[int], bool] = lambda index: True,
) -> list[Piece]:
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
    return rows_view(tensor, piece.start, piece.stop)


def rows_view(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``tensor`` (a view), or the whole tensor for 0-d."""
    return tensor if tensor.dim() == 0 else tensor[start:stop]


def piece_shape(shape: Sequence[int], piece: Piece) -> tuple[int, ...]:
    """Shape of ``piece`` of a tensor shaped ``shape``."""
    return tuple(shape) if len(shape) == 0 else (piece.stop - piece.start, *shape[1:])
