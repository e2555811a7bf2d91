"""protocol.liveness: when `peer status` and the monitor call a peer live, from its record and the manifest.

The bound is checked against the rule written out here from its documentation: a live peer
republishes every H/4 inner steps and after every sync, so its record is never older than
``worst-case sync + 2 · refresh + 5 s`` with ``refresh = max(5 s, (H // 4) · batch tokens / tok/s)``.
"""

from __future__ import annotations

import time

import pytest

from bootstrap.monitor import SwarmMonitor
from peer import status as peer_status
from peer.net import dht as swarm_dht
from peer.net.dht import PeerProgress
from peer.sync.deadlines import DeadlinePolicy
from peer.sync.transport import NetworkTransport
from protocol import liveness
from protocol.presets import default_run, tiny_run
from protocol.records import ProgressRecord

FAST, SLOW = "QmVaPTddRyjLjMoZnYufWc5M5CjyGNPmFEpp5HtPKEqZFG", "QmTchctY2mrWtDteP1QWQW79B2bLycdUvtDZ3airqiax6s"


def record(tokens_per_s: float = 1000.0, round_: int = 3) -> ProgressRecord:
    return ProgressRecord(
        round=round_,
        inner_step=round_ * 5,
        train_loss=2.5,
        tokens_per_s=tokens_per_s,
        group_size=2,
        bytes_sent=10,
        state_digest="ab" * 16,
    )


def stored(manifest, rec: ProgressRecord, age_s: float, now: float) -> float:
    """The expiration a record published ``age_s`` before ``now`` carries (publisher: now − age + ttl)."""
    return now - age_s + liveness.record_ttl_s(manifest)


@pytest.mark.parametrize(
    "manifest",
    [
        default_run(),
        tiny_run(),
        tiny_run().replace(
            sync={
                "matchmaking_time_s": 0.5,
                "min_matchmaking_time_s": 0.5,
                "allreduce_timeout_s": 2.0,
                "min_allreduce_timeout_s": 1.0,
            }
        ),
    ],
)
def test_the_worst_case_sync_is_what_the_transport_allows(manifest):
    """The trainer's sync bound (two attempts at the deadlines' maxima) and the readers' are the same number."""
    transport_bound = (1 + NetworkTransport.RETRIES) * DeadlinePolicy(manifest.sync).worst_case().total_s
    assert liveness.worst_case_sync_s(manifest.sync) == pytest.approx(transport_bound)
    assert liveness.record_ttl_s(manifest) == max(60.0, 3 * transport_bound)


def test_default_run_numbers():
    m = default_run()  # matchmaking 5 s, all-reduce 60 s: one attempt ≤ 15 + 60 + 5 s
    assert liveness.worst_case_sync_s(m.sync) == 160.0
    assert liveness.record_ttl_s(m) == 480.0
    # H = 20 → a record every 5 steps of 2048 tokens: at 1024 tok/s that is 10 s.
    assert liveness.refresh_interval_s(record(1024.0), inner_steps=20, batch_size_tokens=2048) == 10.0
    assert liveness.stale_after_s(record(1024.0), m) == 160.0 + 2 * 10.0 + 5.0
    # A fast peer's refresh interval is floored; an unknown one is assumed.
    assert liveness.refresh_interval_s(record(1e9), inner_steps=20, batch_size_tokens=2048) == liveness.MIN_REFRESH_S
    assert (
        liveness.refresh_interval_s(record(0.0), inner_steps=20, batch_size_tokens=2048) == liveness.UNKNOWN_REFRESH_S
    )
    # H < 4: a record after every step.
    assert liveness.refresh_interval_s(record(100.0), inner_steps=3, batch_size_tokens=1000) == 10.0


def test_a_record_is_stale_once_older_than_the_bound():
    m, now = tiny_run(), 1_700_000_000.0
    rec = record(1000.0)
    bound = liveness.stale_after_s(rec, m)
    for age, live in ((0.0, True), (bound - 1.0, True), (bound + 1.0, False), (liveness.record_ttl_s(m) - 1, False)):
        verdict = liveness.judge(rec, stored(m, rec, age, now), now, m)
        assert (verdict.live, verdict.age_s, verdict.stale_after_s) == (live, pytest.approx(age), bound), age
        assert liveness.published_at(stored(m, rec, age, now), m) == pytest.approx(now - age)


def test_a_dead_peer_is_stale_well_before_its_record_expires():
    """The point of the rule: a killed peer's record lives ttl seconds; the peer is shown dead far sooner."""
    for m in (default_run(), tiny_run()):
        for tokens_per_s in (0.0, 1000.0, 1e6):
            bound = liveness.stale_after_s(record(tokens_per_s), m)
            assert liveness.worst_case_sync_s(m.sync) < bound < 0.75 * liveness.record_ttl_s(m), (m.name, bound)


def test_a_slow_peer_is_given_its_own_refresh_interval():
    """A peer that needs 100 s for H/4 inner steps is live after a silence a fast peer would not have."""
    m, now, age = default_run(), 1_700_000_000.0, 250.0
    slow, fast = record(tokens_per_s=102.4), record(tokens_per_s=10_000.0)  # 5 steps · 2048 tokens: 100 s, ~1 s
    assert liveness.judge(slow, stored(m, slow, age, now), now, m).live
    assert not liveness.judge(fast, stored(m, fast, age, now), now, m).live


def test_a_record_from_a_clock_ahead_counts_as_fresh():
    m, now = tiny_run(), 1_700_000_000.0
    verdict = liveness.judge(record(), stored(m, record(), -30.0, now), now, m)
    assert verdict.live and verdict.age_s == 0.0


def test_the_monitor_counts_only_live_peers_in_the_totals():
    m, now = tiny_run(), time.time()
    monitor = SwarmMonitor(dht=None)
    monitor._manifests[m.run_id] = m
    fresh, dead = record(1000.0), record(3000.0)
    found = {
        m.run_id: [
            PeerProgress(FAST, fresh, stored(m, fresh, 1.0, now)),
            PeerProgress(SLOW, dead, stored(m, dead, liveness.stale_after_s(dead, m) + 5, now)),
        ]
    }
    monitor.ingest({m.run_id: m.name}, found, now)
    [run] = monitor.snapshot()["runs"]
    by_id = {p["peer_id"]: p for p in run["peers"]}
    assert (by_id[FAST]["live"], by_id[SLOW]["live"]) == (True, False)
    assert by_id[SLOW]["published_at"] == pytest.approx(now - liveness.stale_after_s(dead, m) - 5)
    assert (run["live_peers"], run["tokens_per_s"], run["live_by_group_size"]) == (1, 1000.0, {"2": 1})

    # The dead peer's next record (it came back) makes it live again.
    back = record(2000.0, round_=4)
    found[m.run_id][1] = PeerProgress(SLOW, back, stored(m, back, 0.0, now + 1))
    monitor.ingest({m.run_id: m.name}, found, now + 1)
    [run] = monitor.snapshot()["runs"]
    assert (run["live_peers"], run["tokens_per_s"]) == (2, 3000.0)


def test_peer_status_shows_a_stale_peer_as_gone(monkeypatch):
    m, now = tiny_run(), time.time()
    fresh, dead = record(1000.0), record(3000.0)
    items = [
        PeerProgress(FAST, fresh, stored(m, fresh, 1.0, now)),
        PeerProgress(SLOW, dead, stored(m, dead, liveness.stale_after_s(dead, m) + 5, now)),
    ]
    monkeypatch.setattr(swarm_dht, "list_runs", lambda dht: {m.run_id: m.name})
    monkeypatch.setattr(swarm_dht, "read_progress", lambda dht, run_id, **kw: items)
    monkeypatch.setattr(swarm_dht, "fetch_manifest", lambda dht, run_id: m)
    monkeypatch.setattr(peer_status, "read_devices", lambda dht, run_id, **kw: {})
    [run] = peer_status.collect_status(None, wait_s=0)["runs"]
    by_id = {p["peer_id"]: p for p in run["peers"]}
    assert (by_id[FAST]["live"], by_id[SLOW]["live"]) == (True, False)
    assert by_id[SLOW]["age_s"] > by_id[SLOW]["stale_after_s"] == liveness.stale_after_s(dead, m)
    assert (run["live_peers"], run["tokens_per_s"]) == (1, 1000.0)

    # Without the manifest the ttl is unknown: an unexpired record counts as live (the old rule).
    from protocol.errors import ManifestNotFound

    def no_manifest(dht, run_id):
        raise ManifestNotFound("gone")

    monkeypatch.setattr(swarm_dht, "fetch_manifest", no_manifest)
    [run] = peer_status.collect_status(None, wait_s=0)["runs"]
    assert run["live_peers"] == 2 and all(p["stale_after_s"] is None for p in run["peers"])
