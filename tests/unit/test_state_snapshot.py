"""peer.state.snapshot: chunks, hashes and the digest that names a state; snapshots are private copies."""

from __future__ import annotations

import pytest
import torch

from peer.state.snapshot import (
    chunk_bytes,
    chunk_hash,
    make_snapshot,
    make_snapshot_from,
    plan_chunks,
    seal_tensor,
    state_digest,
)
from tests.unit.state_samples import CHUNK, META, SHAPES, sample_snapshot as _snapshot, sample_tensors as _tensors


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


@pytest.mark.parametrize(
    "meta, tensors, match",
    [
        ({**META, "extra": 1}, None, "fields"),
        ({**META, "round": -1}, None, "round"),
        ({**META, "inner_step": True}, None, "inner_step"),
        ({**META, "run_id": 5}, None, "run_id"),
        (META, [torch.zeros(2, dtype=torch.float64)], "float32"),
        (META, [torch.tensor([1.0, float("inf")])], "NaN or inf"),
    ],
)
def test_make_snapshot_rejects_what_no_joiner_could_accept(meta, tensors, match):
    with pytest.raises(ValueError, match=match):
        make_snapshot(meta, tensors if tensors is not None else _tensors(), chunk_elements=CHUNK)


def test_a_snapshot_made_from_sealed_tensors_is_the_one_made_from_scratch():
    tensors = _tensors()
    before = _snapshot(tensors=tensors)
    changed = [t.clone() for t in tensors]
    for index in (1, 4):
        changed[index].mul_(1.5).add_(0.25)
    sealed = [seal_tensor(changed[i], index=i, shapes=SHAPES, chunk_elements=CHUNK) for i in (4, 1)]
    kept = changed[1].clone()
    changed[1].add_(1.0)  # sealed tensors are private copies
    meta = {**META, "round": META["round"] + 1}
    derived = make_snapshot_from(before, meta, sealed)
    changed[1] = kept
    scratch = make_snapshot(meta, changed, chunk_elements=CHUNK)
    assert derived.digest == scratch.digest and derived.chunk_hashes == scratch.chunk_hashes
    assert derived.chunks == scratch.chunks
    for a, b in zip(derived.tensors, scratch.tensors):
        assert torch.equal(a, b)
    assert derived.tensors[0] is before.tensors[0] and derived.tensors[4] is sealed[0].tensor  # shared, not copied
    assert make_snapshot_from(before, META, []).digest == before.digest
    assert make_snapshot_from(before, meta, []).digest != before.digest  # the meta is in the digest


def test_sealing_refuses_what_a_snapshot_refuses_and_tensors_that_do_not_fit():
    tensors = _tensors()
    before = _snapshot(tensors=tensors)
    with pytest.raises(ValueError, match="NaN or inf"):
        seal_tensor(torch.full_like(tensors[1], float("nan")), index=1, shapes=SHAPES, chunk_elements=CHUNK)
    with pytest.raises(ValueError, match="float32"):
        seal_tensor(tensors[1].double(), index=1, shapes=SHAPES, chunk_elements=CHUNK)
    with pytest.raises(ValueError, match="shape"):
        seal_tensor(tensors[1], index=4, shapes=SHAPES, chunk_elements=CHUNK)
    with pytest.raises(ValueError, match="tensors"):
        seal_tensor(tensors[1], index=len(SHAPES), shapes=SHAPES, chunk_elements=CHUNK)
    coarse = seal_tensor(tensors[0], index=0, shapes=SHAPES, chunk_elements=10 * CHUNK)
    with pytest.raises(ValueError, match="chunk"):
        make_snapshot_from(before, META, [coarse])  # hashed with another chunk size
    with pytest.raises(ValueError, match="round"):
        make_snapshot_from(before, {**META, "round": -1}, [])


def test_a_snapshot_given_its_verified_hashes_is_the_one_hashed_afresh():
    """A verified download's hashes make the same snapshot without a hashing pass; hashes that do
    not fit the state's chunks are refused."""
    tensors = _tensors()
    hashed = make_snapshot(META, tensors, chunk_elements=CHUNK)
    given = make_snapshot(META, tensors, chunk_elements=CHUNK, owned=True, chunk_hashes=list(hashed.chunk_hashes))
    assert given.digest == hashed.digest and given.chunk_hashes == hashed.chunk_hashes
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(given.tensors, tensors))  # owned: not copied
    with pytest.raises(ValueError, match="chunk hashes given"):
        make_snapshot(META, tensors, chunk_elements=CHUNK, chunk_hashes=hashed.chunk_hashes[:-1])
    with pytest.raises(ValueError, match="chunk hashes given"):
        make_snapshot(META, tensors, chunk_elements=CHUNK, chunk_hashes=[b"x"] * len(hashed.chunk_hashes))
