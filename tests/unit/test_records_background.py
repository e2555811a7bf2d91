"""SwarmView's background thread (peer/sync/membership.py): records signed and stored off the
caller's thread in the order published, the latest winning; reads asked for ahead of time and
reused; a clean stop. The DHT calls are replaced by in-memory fakes (one module under test); the
real DHT path is covered by the swarm tests."""

from __future__ import annotations

import threading
import time

import pytest

import peer.sync.membership as membership
from peer.sync.membership import SwarmView
from protocol.records import ProgressRecord


def rec(round_: int) -> ProgressRecord:
    return ProgressRecord(
        round=round_, inner_step=round_ * 10, train_loss=1.0, tokens_per_s=1.0, group_size=1, bytes_sent=0
    )


class FakeDHT:
    """Stores records in a list (in the order they are stored) and answers reads, each able to be held."""

    def __init__(self):
        self.stored: list[tuple[int, bool, str]] = []
        self.reads = 0
        self.hold_store = threading.Event()
        self.hold_store.set()
        self.hold_read = threading.Event()
        self.hold_read.set()
        self.storing = threading.Event()
        self.reading = threading.Event()

    def publish_progress(self, dht, run_id, signer, record, ttl_s, *, wait=True):
        self.storing.set()
        self.hold_store.wait(10)
        self.stored.append((record.round, wait, threading.current_thread().name))

    def read_progress(self, dht, run_id, *, max_ttl_s, prefer):
        self.reads += 1
        self.reading.set()
        self.hold_read.wait(10)
        return []


@pytest.fixture
def fake(monkeypatch):
    dht = FakeDHT()
    monkeypatch.setattr(membership.swarm_dht, "publish_progress", dht.publish_progress)
    monkeypatch.setattr(membership.swarm_dht, "read_progress", dht.read_progress)
    return dht


@pytest.fixture
def swarm():
    view = SwarmView(
        None, run_id="run", signer=type("Signer", (), {"peer_id": "me"})(), record_ttl_s=60.0, max_sync_s=5.0
    )
    yield view
    view.close()


def settle(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_without_the_thread_everything_happens_on_the_callers_thread(fake, swarm):
    swarm.publish(rec(1))
    assert fake.stored == [(1, False, threading.current_thread().name)]
    assert swarm.prefetch() is False and fake.reads == 0
    swarm.live(max_age_s=1.0)
    assert fake.reads == 1  # nothing prefetched, nothing read before: a read now


def test_a_published_record_is_stored_by_the_thread_and_a_newer_one_replaces_a_queued_one(fake, swarm):
    swarm.start_background()
    fake.hold_store.clear()
    swarm.publish(rec(1))  # returns at once; the thread is now storing it
    assert fake.storing.wait(10)
    swarm.publish(rec(2))  # queued behind the store in progress
    swarm.publish(rec(3))  # replaces 2: only the latest says where this peer is
    fake.hold_store.set()
    assert settle(lambda: len(fake.stored) == 2)
    assert [(r, w) for r, w, _ in fake.stored] == [(1, False), (3, False)]
    assert {name for _, _, name in fake.stored} == {"locoswarm-records"}


def test_a_waited_publish_is_never_overtaken_by_an_older_queued_record(fake, swarm):
    swarm.start_background()
    fake.hold_store.clear()
    swarm.publish(rec(1))
    assert fake.storing.wait(10)
    swarm.publish(rec(2))  # queued
    done = threading.Thread(target=swarm.publish, args=(rec(3),), kwargs={"wait": True})
    done.start()  # waits for the store in progress, then stores 3
    time.sleep(0.1)
    fake.hold_store.set()
    done.join(10)
    assert not done.is_alive()
    time.sleep(0.2)
    rounds = [r for r, _, _ in fake.stored]
    # 2 is dropped, or stored before 3 when the thread got the lock first: 3 is last in the DHT
    assert rounds in ([1, 3], [1, 2, 3]) and fake.stored[-1][1] is True


def test_close_stores_the_queued_record_and_later_publishes_store_at_once(fake, swarm):
    swarm.start_background()
    fake.hold_store.clear()
    swarm.publish(rec(1))
    assert fake.storing.wait(10)
    swarm.publish(rec(2))
    fake.hold_store.set()
    swarm.close()
    assert [r for r, _, _ in fake.stored] == [1, 2]
    assert not any(t.name == "locoswarm-records" for t in threading.enumerate())
    swarm.publish(rec(3))
    assert fake.stored[-1] == (3, False, threading.current_thread().name)
    assert swarm.prefetch() is False


def test_a_prefetched_read_is_reused_and_one_in_progress_is_waited_for(fake, swarm):
    swarm.start_background()
    fake.hold_read.clear()
    assert swarm.prefetch() is True
    assert fake.reading.wait(10)
    assert swarm.prefetch() is True and fake.reads == 1  # one read in progress: not asked twice
    result = []
    reader = threading.Thread(target=lambda: result.append(swarm.live(max_age_s=1.0)))
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive()  # waiting for the prefetched read, not reading again
    fake.hold_read.set()
    reader.join(10)
    assert result == [[]] and fake.reads == 1
    assert swarm.live(max_age_s=1.0) == [] and fake.reads == 1  # still fresh: reused
    swarm.live()
    assert fake.reads == 2  # 0 (the default) always reads


def test_a_prefetch_older_than_the_age_asked_for_is_not_used(fake, swarm):
    swarm.start_background()
    assert swarm.prefetch() and settle(lambda: swarm._prefetch_since is None)
    swarm._read_at -= 5.0  # that read is now five seconds old
    swarm.live(max_age_s=1.0)
    assert fake.reads == 2


class Prefetching:
    """The round loop's side (peer/round/records.py ``RecordReads.after_step``, with the inner step
    the schedule reads the records at: the round's end, or streaming's first fragment sync) over a
    fake view."""

    def __init__(self, *, H: int, offsets: list[int] | None = None, background: bool = True):
        import types

        from peer.round.records import RecordReads
        from peer.round.streamed import StreamingSchedule

        self.asked: list[tuple[int, int]] = []
        pos = types.SimpleNamespace(round=3, step=0, step_s=0.0)
        swarm = types.SimpleNamespace(prefetch=lambda: self.asked.append((pos.round, pos.step)) or background)
        self.reads, self.pos, self.H = RecordReads(swarm), pos, H
        self.schedule = types.SimpleNamespace(
            state=types.SimpleNamespace(H=H, pos=pos), choice=None, offset=offsets or [], synced=set()
        )

        def needed_at() -> int:
            return StreamingSchedule.records_needed_at(self.schedule) if offsets else H

        def step(step_s: float) -> None:
            pos.step_s = step_s
            self.reads.after_step(pos, needed_at())

        self.step = step

    def run_round(self, step_s: float) -> None:
        for step in range(1, self.H + 1):
            self.pos.step = step
            self.step(step_s)
            for p, offset in enumerate(self.schedule.offset):
                if offset == step:  # the fragment's sync starts: the round's group choice is made
                    self.schedule.synced.add(p)
                    self.schedule.choice = (self.pos.round, None, [])


def test_the_round_loop_asks_for_the_records_once_a_round_just_before_it_reads_them():
    from peer.round.records import RECORDS_PREFETCH_S

    loop = Prefetching(H=50)
    loop.run_round(0.1)  # 0.5 s before the round's end: 5 steps ahead
    assert loop.asked == [(3, 50 - int(RECORDS_PREFETCH_S / 0.1))]
    loop.pos.round = 4
    loop.run_round(2.0)  # steps longer than the lead: never (the loop reads itself)
    assert loop.asked == [(3, 45)] and loop.reads.prefetched == (3, 50)
    streaming = Prefetching(H=50, offsets=[0, 25])
    streaming.run_round(0.1)  # streaming reads at the round's first fragment sync
    assert streaming.asked == [(3, 20), (3, 45)]  # and again at the round's end, for the re-sync rule
    assert streaming.reads.prefetched == (3, 50)
    alone = Prefetching(H=50, background=False)
    alone.run_round(0.1)  # no background thread: asked, not marked, so read fresh
    assert alone.reads.prefetched is None


def test_a_round_training_past_h_keeps_a_read_young_enough_for_its_end(monkeypatch):
    """Past H (a round that trains on while its sync is out) the round's end comes when the sync lands:
    a read is asked for again whenever the last one asked is RECORDS_REUSE_S − RECORDS_PREFETCH_S old,
    so the end reuses one instead of reading on the training thread."""
    import types

    import peer.round.records as round_module
    from peer.round.records import RECORDS_PREFETCH_S, RECORDS_REUSE_S

    clock = [100.0]
    monkeypatch.setattr(round_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    loop = Prefetching(H=50)
    for step in range(1, 50 + 31):  # 30 steps past H, 0.1 s each
        loop.pos.step = step
        loop.step(0.1)
        clock[0] += 0.1
    every = RECORDS_REUSE_S - RECORDS_PREFETCH_S
    asked = [s for _, s in loop.asked]
    assert asked[0] == 45 and all(s > 50 for s in asked[1:])  # before the end as always, then past it
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert len(asked) >= 3 and all(round(g * 0.1, 6) >= every for g in gaps)  # at most one per interval
    assert max(gaps) * 0.1 <= every + 0.1 + 1e-9  # and never let the last one age past it
    assert loop.reads.prefetched == (3, 50)


def test_an_ask_made_too_early_is_renewed_so_the_round_end_finds_a_young_read(monkeypatch):
    """Steps that were fast when the read was asked for and slow afterwards (cores shared with other
    processes: one step can take four times another) would leave the round's end a read older than
    RECORDS_REUSE_S, read again on the training thread: once asked, a read is asked for again
    whenever the last one asked is RECORDS_REUSE_S − RECORDS_PREFETCH_S old."""
    import types

    import peer.round.records as round_module
    from peer.round.records import RECORDS_PREFETCH_S, RECORDS_REUSE_S

    clock = [100.0]
    monkeypatch.setattr(round_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    loop = Prefetching(H=50)
    asked_at = []
    for step in range(1, 50 + 1):
        loop.pos.step = step
        before = len(loop.asked)
        loop.step(0.01)  # the round's mean step time says 10 ms: asked at once
        if len(loop.asked) > before:
            asked_at.append(clock[0])
        clock[0] += 0.01 if step < 5 else 0.1  # then the steps take 100 ms each
    end = clock[0]
    every = RECORDS_REUSE_S - RECORDS_PREFETCH_S
    assert loop.asked[0] == (3, 1) and len(asked_at) >= 4  # asked early, then again and again
    assert all(b - a >= every - 1e-9 for a, b in zip(asked_at, asked_at[1:]))  # at most one per interval
    assert end - asked_at[-1] <= every + 0.1 + 1e-9  # the end finds one young enough to reuse
    assert end - asked_at[-1] < RECORDS_REUSE_S
    assert loop.reads.prefetched == (3, 50)


def test_a_young_read_is_reused_without_waiting_for_a_newer_one_in_progress(fake, swarm):
    """The round loop asks again while its last read is still young enough (the ask is renewed every
    RECORDS_REUSE_S − RECORDS_PREFETCH_S): the round's end takes the read it has instead of waiting
    for the one in progress."""
    swarm.start_background()
    assert swarm.prefetch() and settle(lambda: swarm._prefetch_since is None)
    assert fake.reads == 1
    fake.hold_read.clear()
    fake.reading.clear()
    assert swarm.prefetch() and fake.reading.wait(10)  # a second read, held in progress
    result = []
    reader = threading.Thread(target=lambda: result.append(swarm.live(max_age_s=5.0)))
    reader.start()
    reader.join(5)
    assert not reader.is_alive() and result == [[]]  # the first read, not waited for the second
    assert fake.reads == 2
    fake.hold_read.set()
