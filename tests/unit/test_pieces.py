"""peer.sync.pieces: the piece plan every groupmate derives alike."""

from __future__ import annotations

import math

import torch

from peer.sync.pieces import make_group_plan
from protocol.groups import codec_seed
from protocol.manifest import CompressionSpec
from protocol.wire.pieces import plan_pieces


def test_plan_covers_every_row_once_and_balances_owners():
    shapes = [torch.Size([1000, 64]), torch.Size([64]), torch.Size([300, 7, 3])]
    pieces = plan_pieces(shapes, owners=[0, 1, 3], piece_elements=5000)
    for index, shape in enumerate(shapes):
        rows = sorted((p.start, p.stop) for p in pieces if p.tensor == index)
        assert rows[0][0] == 0 and rows[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    load = {o: 0 for o in (0, 1, 3)}
    for p in pieces:
        shape = shapes[p.tensor]
        load[p.owner] += (p.stop - p.start) * math.prod(shape[1:])
    total = sum(load.values())
    assert max(load.values()) - min(load.values()) <= 0.1 * total
    assert 2 not in {p.owner for p in pieces}


def test_plan_keeps_unsplittable_tensors_whole():
    pieces = plan_pieces([torch.Size([1000, 64])], owners=[0, 1], piece_elements=100, split=lambda i: False)
    assert [(p.start, p.stop) for p in pieces] == [(0, 1000)]


def test_group_plan_is_the_same_on_every_groupmate_and_seeded_by_round():
    gen = torch.Generator().manual_seed(0)
    shapes = [torch.Size([300, 40]), torch.Size([40])]
    spec = CompressionSpec(codec="int8")

    def plan_of(my_index, round_=5, spec=spec):
        tensors = [torch.randn(s, generator=gen) for s in shapes]  # another peer, other values
        return make_group_plan(
            tensors,
            group_id=b"g",
            peer_ids=("a", "b", "c"),
            my_index=my_index,
            owners=[0, 2],
            round_=round_,
            compression=spec,
            phi_from=None,
            piece_elements=1000,
            uplink_bytes_per_s=1e6,
        )

    first, second = plan_of(0), plan_of(1)
    assert first.pieces == second.pieces and first.max_piece_bytes == second.max_piece_bytes
    assert {p.owner for p in first.pieces} == {0, 2} and len(first.pieces) > 2
    assert first.seeds == [codec_seed(5, p.index) for p in first.pieces] != plan_of(0, round_=6).seeds
    assert [type(c) for c in first.codecs] == [type(c) for c in second.codecs]
    # low rank wants whole matrices: nothing is split
    whole = plan_of(0, spec=CompressionSpec(codec="lowrank", rank=2))
    assert [(p.tensor, p.start, p.stop) for p in whole.pieces] == [(0, 0, 300), (1, 0, 40)]
