"""BackgroundSync (peer/sync/background.py): one sync at a time in a worker thread; a dropped sync
is told to give up, so the next one does not queue behind it until its deadline."""

from __future__ import annotations

import threading

import pytest

from peer.progress import SyncReport
from peer.sync.background import BackgroundSync


def test_results_come_back_in_order_and_one_at_a_time():
    bg = BackgroundSync()
    try:
        bg.start(lambda dropped: (["mean"], SyncReport(group_size=2)), round_=3, start_digest="d")
        assert bg.in_flight and bg.round == 3
        with pytest.raises(RuntimeError, match="still in flight"):
            bg.start(lambda dropped: ([], SyncReport()), round_=4, start_digest="d")
        mean, report, round_ = bg.result(timeout_s=30)
        assert (mean, report.group_size, round_) == (["mean"], 2, 3) and not bg.in_flight
        with pytest.raises(RuntimeError, match="no sync in flight"):
            bg.result()
    finally:
        bg.shutdown()


def test_a_dropped_sync_gives_up_so_the_next_one_runs_at_once():
    bg = BackgroundSync()
    saw_flag, safety = [], threading.Event()

    def hopeless(dropped):  # waits for a group that never forms, polling its flag as the transport does
        while not dropped() and not safety.wait(0.01):
            pass
        saw_flag.append(dropped())
        return [], SyncReport(failed=True)

    try:
        bg.start(hopeless, round_=1, start_digest="a")
        bg.drop("adopted the swarm's state")
        assert not bg.in_flight
        bg.start(lambda dropped: (["mean of round 5"], SyncReport()), round_=5, start_digest="b")
        mean, _, round_ = bg.result(timeout_s=30)  # queued behind the first: it returns only if that gave up
        assert (mean, round_) == (["mean of round 5"], 5)
        assert saw_flag == [True]
    finally:
        safety.set()
        bg.shutdown()


def test_shutdown_tells_the_running_sync_to_give_up():
    bg = BackgroundSync()
    seen = []
    started = threading.Event()

    def waits(dropped):
        started.set()
        while not dropped():
            threading.Event().wait(0.01)
        seen.append("gave up")
        return [], SyncReport()

    bg.start(waits, round_=2, start_digest="a")
    started.wait(30)
    bg.shutdown(wait=True)  # returns only because the call saw its flag
    assert seen == ["gave up"]
