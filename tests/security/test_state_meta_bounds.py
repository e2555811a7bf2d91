"""Issue 51, item 2: a served state's meta is bounded and agrees with the records that advertise it.

Before: a donor served a state whose meta claimed round 2^63 under a record of round r+1. The
digest binds the meta, so the download verified; the joiner adopted it, and its next snapshot
(round·H past 2^64) raised ``OverflowError`` in ``canonical_meta``: the peer exited 1. A bounded
but other round (a million rounds ahead) was adopted as it came. Now the META frame's meta is
bounded (protocol/wire/state.py), a downloaded state must be of the round its records claim
(peer/state/download.py ``check_agrees``), and whatever a download raises leaves the peer on its own
state with a warning (peer/round/catchup.py ``catch_up_once``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from peer.config import TrainerConfig
from peer.net.dht import PeerProgress
from peer.round import Trainer
from peer.state.download import validate_state
from peer.state.snapshot import StateSnapshot, make_snapshot, state_digest
from peer.train.model import build_model
from protocol.errors import BadPayload, StateDownloadFailed
from protocol.presets import tiny_run
from protocol.records import MAX_ROUND, ProgressRecord
from protocol.wire import state as frames
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.state_samples import META, RUN, SHAPES, sample_snapshot
from tests.unit.test_round_overlap import Events, Group, Transport
from tests.unit.test_state_transfer import _download, honest

pytestmark = pytest.mark.timeout(120)

HUGE = 2**63


def with_meta(snapshot: StateSnapshot, meta: dict) -> StateSnapshot:
    """``snapshot`` under another meta, its digest recomputed: what a hostile donor serves (the digest
    it publishes names this meta, so the download verifies against it)."""
    return dataclasses.replace(snapshot, meta=dict(meta), digest=state_digest(meta, snapshot.chunk_hashes))


# ---- the wire: the META frame's meta is bounded ------------------------------------------------
@pytest.mark.parametrize("field, value", [("round", HUGE), ("round", MAX_ROUND + 1), ("inner_step", 2**64 - 1)])
def test_a_meta_beyond_the_bounds_is_refused_by_the_download(field, value):
    hostile = with_meta(sample_snapshot(), {**META, field: value})
    with pytest.raises(StateDownloadFailed, match=f"state meta {field} = {value}: expected an integer in"):
        asyncio.run(_download({"mallory": honest(hostile)}, hostile))  # before: downloaded and returned


def test_an_honest_donor_keeps_the_download_going_when_the_hostile_one_is_dropped():
    snapshot = sample_snapshot()
    hostile = with_meta(snapshot, {**META, "round": HUGE})
    # the hostile donor answers for the honest digest with its own meta: dropped, the honest one delivers
    from tests.unit.test_state_transfer import serves_regardless

    result = asyncio.run(_download({"mallory": serves_regardless(hostile), "d0": honest(snapshot)}, snapshot))
    assert result.meta == snapshot.meta and "mallory" in result.failed


def test_validate_state_bounds_round_and_inner_step():
    tensors = [torch.zeros(s) for s in SHAPES]
    for field in ("round", "inner_step"):
        with pytest.raises(BadPayload, match=field):
            validate_state({**META, field: HUGE}, tensors, run_id=RUN, shapes=SHAPES[: len(SHAPES) // 2])
    assert frames.meta_problem({**META, "round": MAX_ROUND, "inner_step": 0}) is None
    with pytest.raises(ValueError, match="round"):
        make_snapshot({**META, "round": HUGE}, tensors)


# ---- adoption: a real Trainer that catches up from a hostile donor ------------------------------
class Scripted:
    """A swarm view whose records the test sets (the donor's record, nobody else)."""

    def __init__(self, peer_id: str):
        self.peer_id, self.records, self.max_sync_s = peer_id, [], 5.0

    def others(self, max_age_s=0.0):
        return list(self.records)

    def step_now(self, round_, *, inner_steps, batch_size_tokens):
        return 0

    def publish(self, record, wait=False):
        pass


def joiner(corpus, name: str) -> tuple[Trainer, Scripted, Group]:
    manifest = tiny_run().replace(name=name)
    swarm, group = Scripted("joiner"), Group(2)
    t = Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=swarm,
        transport=Transport("joiner", group),
        config=TrainerConfig(),
        reporter=Events(),
        stop_event=threading.Event(),
    )
    return t, swarm, group


def serve_hostile(t: Trainer, swarm: Scripted, group: Group, *, record_round: int, meta: dict) -> str:
    """Mallory serves the joiner's own φ (plausible: the sanity bound passes) under ``meta``, and
    publishes a record of ``record_round`` naming its digest; returns the digest."""
    tensors = [f.detach().clone() for f in [*t.phi, *t.outer.state_tensors()]]
    snapshot = with_meta(make_snapshot({**meta, "round": 0, "inner_step": 0}, tensors), meta)
    group.serve("mallory", lambda: [snapshot])
    record = ProgressRecord(
        round=record_round,
        inner_step=record_round * t.H,
        train_loss=2.0,
        tokens_per_s=100.0,
        group_size=2,
        bytes_sent=1 << 20,
        state_digest=snapshot.digest.hex(),
    )
    swarm.records = [PeerProgress(peer_id="mallory", record=record, expiration=0.0)]
    return snapshot.digest.hex()


def _stays_on_its_own_state(t: Trainer, phi0: list[torch.Tensor], digest0: str) -> dict:
    assert not t.reporter.of("adopted_state")
    assert t.pos.round == 0 and t.state_digest == digest0
    assert all(torch.equal(f, g) for f, g in zip(t.phi, phi0))
    (warning,) = t.reporter.of("warning")
    return warning


def test_a_served_meta_claiming_round_2_63_leaves_the_joiner_on_its_own_state(corpus):
    t, swarm, group = joiner(corpus, "meta-2-63")
    phi0, digest0 = [f.clone() for f in t.phi], t.state_digest
    serve_hostile(t, swarm, group, record_round=1, meta={"run_id": t.m.run_id, "round": HUGE, "inner_step": HUGE})
    assert t.catchup.resync_target() is not None  # the record of round 1 is a state to adopt
    assert not t.catchup.catch_up_once()  # before: OverflowError in canonical_meta, the peer exits 1
    warning = _stays_on_its_own_state(t, phi0, digest0)
    assert "failed, continuing from round 0" in warning["message"] and "round" in warning["message"]


@pytest.mark.parametrize("meta_round, step_offset", [(1_000_000, 0), (1, 1)])
def test_a_state_of_another_round_than_its_record_is_refused(corpus, meta_round, step_offset):
    """Bounded, but not the round (or the round's start) its record advertises: refused, not adopted."""
    t, swarm, group = joiner(corpus, f"meta-agree-{meta_round}")
    phi0, digest0 = [f.clone() for f in t.phi], t.state_digest
    step = meta_round * t.H + step_offset
    digest = serve_hostile(
        t, swarm, group, record_round=1, meta={"run_id": t.m.run_id, "round": meta_round, "inner_step": step}
    )
    assert not t.catchup.catch_up_once()  # before: adopted, the joiner at round 1,000,000
    warning = _stays_on_its_own_state(t, phi0, digest0)
    assert warning["message"].startswith("refused the state of round 1") and digest in warning["message"]
    assert digest in t.vouching.refused  # not downloaded again
