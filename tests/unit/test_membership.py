"""SwarmView.step_now (peer/sync/membership.py): where the swarm is inside a round, extrapolated
from each peer's last record by its throughput."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from peer.sync.membership import SwarmView
from protocol.dht import PeerProgress
from protocol.records import ProgressRecord

H, BATCH_TOKENS, TTL = 20, 1000, 60.0


def view(*records: PeerProgress) -> SwarmView:
    swarm = SwarmView.__new__(SwarmView)  # no DHT: only the records step_now reads
    swarm.peer_id, swarm.record_ttl_s = "me", TTL
    swarm.others = lambda: list(records)
    return swarm


def record(peer: str, round_: int, step: int, *, tokens_per_s: float, published_s_ago: float) -> PeerProgress:
    return PeerProgress(peer_id=peer, expiration=get_dht_time() - published_s_ago + TTL,
                        record=ProgressRecord(round=round_, inner_step=round_ * H + step, train_loss=1.0,
                                              tokens_per_s=tokens_per_s, group_size=2, bytes_sent=0))


def test_the_step_is_the_last_record_plus_what_the_throughput_did_since():
    # published step 5 four seconds ago at 1000 tokens/s with 1000-token batches: about step 9 now
    assert view(record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=4.05)).step_now(
        3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 9
    # the furthest peer of the round counts; other rounds do not; never past the round's last step
    swarm = view(record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=0.0),
                 record("b", 3, 8, tokens_per_s=1000.0, published_s_ago=0.0),
                 record("c", 4, 0, tokens_per_s=1000.0, published_s_ago=100.0))
    assert swarm.step_now(3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 8
    assert view(record("a", 3, 5, tokens_per_s=1000.0, published_s_ago=60.0)).step_now(
        3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == H - 1
    # no throughput known, or no peer at the round
    assert view(record("a", 3, 5, tokens_per_s=0.0, published_s_ago=30.0)).step_now(
        3, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 5
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
    nothing = [record("me", 3, 0, tokens_per_s=1000.0, published_s_ago=0.0),
               record("c", 4, 0, tokens_per_s=1000.0, published_s_ago=0.0),
               record("d", 3, 0, tokens_per_s=0.0, published_s_ago=0.0),
               record("e", 3, 18, tokens_per_s=1000.0, published_s_ago=30.0)]  # hung or dead: long done
    assert swarm.seconds_to_finish(3, nothing, inner_steps=H, batch_size_tokens=BATCH_TOKENS) == 0.0
