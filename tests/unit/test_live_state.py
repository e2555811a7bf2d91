"""φ and the outer state are never written in place (peer/round/state.py): every outer step, landing,
adoption and roll-back installs new tensors, so the last snapshot holds the live tensors themselves.

Two real Trainers (the tiny preset) train and sync through the in-process hub under every sync
schedule and both outer algorithms. After every snapshot a check re-hashes every snapshot still held:
a tensor written in place after it was hashed would change its digest (a joiner would refuse the
chunks it downloads), and the live state must be the last snapshot's own tensors, not a copy.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from lab.inprocess import InProcessHub
from peer.round.state import RoundState
from peer.state.snapshot import make_snapshot
from protocol.presets import tiny_run
from tests.security.test_unbounded_means import _trainers
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import run_in_threads

pytestmark = pytest.mark.timeout(300)


def manifest_for(overlap: str, algorithm: str):
    m = tiny_run().replace(name=f"live-{overlap}-{algorithm}", sync={"algorithm": algorithm})
    if overlap == "streaming":  # the tiny preset's single block: one fragment, landing a step late
        return m.replace(sync={"overlap": overlap, "fragments": 1, "fragment_delay_steps": 1})
    return m.replace(sync={"overlap": overlap}) if overlap != "none" else m


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
@pytest.mark.parametrize("overlap", ["none", "delayed", "eager", "streaming"])
def test_snapshots_hold_the_live_state_and_never_change(corpus, tmp_path, overlap, algorithm):
    problems: list[str] = []
    checks = [0]

    class Checked(deque):
        """The snapshots of one peer: each append (a round's snapshot, taken or prepared) checks."""

        state: RoundState

        def append(self, snapshot) -> None:
            super().append(snapshot)
            checks[0] += 1
            if not all(a is b for a, b in zip(self.state.live_tensors(), snapshot.tensors, strict=True)):
                problems.append(f"round {snapshot.meta['round']}: the live state is not the snapshot's tensors")
            for held in list(self):
                if make_snapshot(dict(held.meta), held.tensors).digest != held.digest:
                    problems.append(f"the snapshot of round {held.meta['round']} changed after it was hashed")

    manifest = manifest_for(overlap, algorithm)
    trainers = _trainers(corpus, manifest, InProcessHub(2), rounds=4, checkpoints=tmp_path)
    for t in trainers:
        snapshots = Checked(t.state.snapshots, maxlen=2)
        snapshots.state = t.state
        t.state.snapshots = snapshots
    phi0 = [f.clone() for f in trainers[0].phi]
    run_in_threads(trainers)
    assert not problems, problems
    assert checks[0] >= 2 * 4  # a snapshot per round and peer at least
    for t in trainers:
        synced = [e for e in t.reporter.of("round") if e.get("group_size", 0) > 1]
        assert synced, t.reporter.of("round")  # the outer steps this checks did happen
        assert not all(torch.equal(x, y) for x, y in zip(t.phi, phi0))


def test_the_state_served_is_a_copy_so_pickling_it_leaves_the_live_tensors_where_they_are():
    """hivemind's pipe pickles the tensors the averager process serves with torch's reductions, which
    move a storage into shared memory in place and free its old memory; a snapshot's tensors are the
    live φ and outer state, read meanwhile by the training, sync and checkpoint threads (a read of the
    freed memory is a segmentation fault). What the host hands the pipe must be copies."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's reductions, as hivemind's pipe has them

    from peer.state.sharing import StateSharing

    live = [torch.randn(64, 8), torch.randn(300)]
    snapshot = make_snapshot({"run_id": "ab" * 8, "round": 3, "inner_step": 30}, live, owned=True)
    where = [t.data_ptr() for t in live]
    assert [t.data_ptr() for t in snapshot.tensors] == where  # the snapshot holds the live tensors' memory
    sharing = StateSharing()
    sharing._init_state_sharing()
    sharing.set_state_provider(lambda: [snapshot])
    metadata, served, _ = sharing.get_current_state()
    assert metadata["snapshots"][0]["digest"] == snapshot.digest
    ForkingPickler(io.BytesIO()).dump(served)
    assert all(t.is_shared() for t in served)  # the copies moved, as hivemind's pipe moves them
    assert [t.data_ptr() for t in live] == where and not any(t.is_shared() for t in live)
    assert all(torch.equal(a, b) for a, b in zip(served, live))
    # asked again (a joiner, or many): the same copies, already shared, no new copy
    _, again, _ = sharing.get_current_state()
    assert all(a is b for a, b in zip(again, served))
    # the next snapshot (new tensors installed): copied once in turn, the old copies let go
    nxt = make_snapshot({"run_id": "ab" * 8, "round": 4, "inner_step": 40}, [t + 1 for t in live], owned=True)
    sharing.set_state_provider(lambda: [nxt])
    _, fresh, _ = sharing.get_current_state()
    assert [t.data_ptr() for t in fresh] != [t.data_ptr() for t in nxt.tensors]
    assert list(sharing._served) == [nxt.digest]
