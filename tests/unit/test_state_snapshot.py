"""peer.state.snapshot: chunks, hashes and the digest that names a state; snapshots are private copies."""

from __future__ import annotations

import pytest
import torch

from peer.state.snapshot import chunk_bytes, chunk_hash, make_snapshot, plan_chunks, state_digest
from tests.unit.state_samples import CHUNK, META, SHAPES
from tests.unit.state_samples import sample_snapshot as _snapshot
from tests.unit.state_samples import sample_tensors as _tensors


def test_plan_covers_every_row_once_in_small_chunks():
    chunks = plan_chunks(SHAPES, CHUNK)
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) == 26
    assert chunks == plan_chunks(SHAPES, CHUNK)
    for index, shape in enumerate(SHAPES):
        rows = [(c.start, c.stop) for c in chunks if c.tensor == index]
        if shape.numel() == 0:
            assert rows == []
        elif len(shape) == 0:
            assert rows == [(0, 1)]
        else:
            assert rows[0][0] == 0 and rows[-1][1] == shape[0]
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_digest_is_stable_and_sensitive_to_one_ulp_and_to_meta():
    tensors = _tensors()
    a, b = _snapshot(tensors=tensors), _snapshot(tensors=[t.clone() for t in tensors])
    assert a.digest == b.digest and len(a.digest) == 16
    assert a.digest == state_digest(dict(reversed(list(META.items()))), a.chunk_hashes)  # key order is canonical
    nudged = [t.clone() for t in tensors]
    nudged[4][3, 1, 2] = torch.nextafter(nudged[4][3, 1, 2], torch.tensor(float("inf")))
    c = _snapshot(tensors=nudged)
    assert c.digest != a.digest
    assert sum(x != y for x, y in zip(a.chunk_hashes, c.chunk_hashes)) == 1  # only that chunk's hash moved
    assert _snapshot(meta={**META, "round": 13}, tensors=tensors).digest != a.digest
    assert chunk_hash(chunk_bytes(a.tensors[0], a.chunks[0])) == a.chunk_hashes[0]


def test_snapshot_is_a_private_copy():
    tensors = _tensors()
    snapshot = _snapshot(tensors=tensors)
    tensors[0].add_(1.0)
    assert not torch.equal(snapshot.tensors[0], tensors[0])


@pytest.mark.parametrize("meta, tensors, match", [
    ({**META, "extra": 1}, None, "fields"),
    ({**META, "round": -1}, None, "round"),
    ({**META, "inner_step": True}, None, "inner_step"),
    ({**META, "run_id": 5}, None, "run_id"),
    (META, [torch.zeros(2, dtype=torch.float64)], "float32"),
    (META, [torch.tensor([1.0, float("inf")])], "NaN or inf"),
])
def test_make_snapshot_rejects_what_no_joiner_could_accept(meta, tensors, match):
    with pytest.raises(ValueError, match=match):
        make_snapshot(meta, tensors if tensors is not None else _tensors(), chunk_elements=CHUNK)
