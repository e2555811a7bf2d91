"""SwarmView.step_now (peer/sync/membership.py): where the swarm is inside a round, extrapolated
from each peer's last record by its throughput."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from peer.net.dht import PeerProgress
from peer.sync.membership import SwarmView
from protocol.records import ProgressRecord

H, BATCH_TOKENS, TTL = 20, 1000, 60.0


def view(*records: PeerProgress) -> SwarmView:
    swarm = SwarmView.__new__(SwarmView)  # no DHT: only the records step_now reads
    swarm.peer_id, swarm.record_ttl_s = "me", TTL
    swarm.others = lambda: list(records)
    return swarm


def record(peer: str, round_: int, step: int, *, tokens_per_s: float, published_s_ago: float) -> PeerProgress:
    return PeerProgress(
        peer_id=peer,
        expiration=get_dht_time() - published_s_ago + TTL,
        record=ProgressRecord(
            round=round_,
            inner_step=round_ * H + step,
            train_loss=1.0,
            tokens_per_s=tokens_per_s,
            group_size=2,
            bytes_sent=0,
        ),
    )


def test_the_step_is_the_last_record_plus_what_the_throughput_did_since():
    # published step 5 four seconds ago at 1000 tokens/s with 1000-token batches: about step 9 now
    assert (
        view(record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=4.05)).step_now(
            3, inner_steps=H, batch_size_tokens=BATCH_TOKENS
        )
        == 9
    )
    # the furthest peer of the round counts; other rounds do not; never past the round's last step
    swarm = view(
        record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=0.0),
        record("b", 3, 8, tokens_per_s=1000.0, published_s_ago=0.0),
        record("c", 4, 0, tokens_per_s=1000.0, published_s_ago=100.0),
    )
    assert swarm.step_now(3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 8
    assert (
        view(record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=60.0)).step_now(
            3, inner_steps=H, batch_size_tokens=BATCH_TOKENS
        )
        == H - 1
    )
    # no throughput known, or no peer at the round
    assert (
        view(record("a", 3, 5, tokens_per_s=0.0, published_s_ago=30.0)).step_now(
            3, inner_steps=H, batch_size_tokens=BATCH_TOKENS
        )
        == 5
    )
    assert view().step_now(3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 0


def test_seconds_to_finish_predicts_the_last_expected_groupmate():
    swarm = view()
    # step 5 of 20 published 4 s ago at 1 step/s: about step 9 now, 11 steps (11 s) left
    slow = record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=4.0)
    fast = record("b", 3, 15, tokens_per_s=2000.0, published_s_ago=0.0)  # 5 steps at 2 steps/s: 2.5 s
    due = swarm.seconds_to_finish(3, [slow, fast], inner_steps=H, batch_size_tokens=BATCH_TOKENS)
    assert 10.5 < due < 11.5
    # a NoLoCo plan names the groupmates: only they count
    due = swarm.seconds_to_finish(3, [slow, fast], inner_steps=H, batch_size_tokens=BATCH_TOKENS, peers={"b"})
    assert 2.4 < due < 2.6
    # this peer's own record, other rounds, unknown throughput and peers past the end predict nothing
    nothing = [
        record("me", 3, 0, tokens_per_s=1000.0, published_s_ago=0.0),
        record("c", 4, 0, tokens_per_s=1000.0, published_s_ago=0.0),
        record("d", 3, 0, tokens_per_s=0.0, published_s_ago=0.0),
        record("e", 3, 18, tokens_per_s=1000.0, published_s_ago=30.0),
    ]  # hung or dead: long done
    assert swarm.seconds_to_finish(3, nothing, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 0.0


def test_a_recent_read_is_reused_only_when_asked_and_liveness_is_judged_again(monkeypatch):
    import peer.sync.membership as membership

    reads = []

    def read_progress(dht, run_id, *, max_ttl_s, prefer):
        reads.append(run_id)
        return [record("a", 3, 5, tokens_per_s=1.0, published_s_ago=0.0)]

    monkeypatch.setattr(membership.swarm_dht, "read_progress", read_progress)
    swarm = SwarmView(
        None, run_id="run", signer=type("Signer", (), {"peer_id": "me"})(), record_ttl_s=TTL, max_sync_s=5.0
    )
    assert [r.peer_id for r in swarm.others()] == ["a"] and len(reads) == 1
    assert [r.peer_id for r in swarm.others(max_age_s=60.0)] == ["a"] and len(reads) == 1  # reused
    swarm.others()
    assert len(reads) == 2  # 0 (the default): always a fresh read
    swarm._read_at -= 120.0  # that read is now two minutes old
    swarm.others(max_age_s=60.0)
    assert len(reads) == 3  # too old to reuse: read again
    monkeypatch.setattr(swarm, "stale_after_s", lambda: -TTL)  # every record is stale by now
    assert swarm.others(max_age_s=60.0) == [] and len(reads) == 3  # a reused read is judged again
