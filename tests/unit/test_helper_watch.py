"""peer/net/lifetime.py ``HelperWatch``: a helper process that dies stops the command once, with
one error naming it; a helper shut down on purpose after ``stop`` is not reported.

The helpers are real forked processes (sleepers standing in for the DHT and the averager), killed
with SIGKILL as the kernel's OOM killer does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from peer.net import lifetime
from peer.net.lifetime import HelperWatch, helper_died
from protocol.errors import HelperDied


@pytest.fixture
def sleepers():
    started = []

    def start():
        process = mp.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.join(30)


def test_a_killed_helper_sets_the_stop_event_and_is_named(sleepers):
    dht, averager = sleepers(), sleepers()
    stop = threading.Event()
    watch = (
        HelperWatch(stop, "run the peer again", period_s=0.05)
        .watch("peer's DHT", dht)
        .watch("peer's averager", averager)
        .start()
    )
    try:
        assert not stop.wait(0.3) and watch.died is None  # both alive: nothing happens
        os.kill(averager.pid, signal.SIGKILL)
        assert stop.wait(30)
        assert isinstance(watch.died, HelperDied) and watch.died.exit_code == 75
        assert str(watch.died) == (
            f"this peer's averager process (pid {averager.pid}) died with exit code -9 "
            "(killed, most often for memory); run the peer again"
        )
        assert watch.check() is not None  # asked again after the stop: the same answer
    finally:
        watch.stop()


def test_helpers_shut_down_after_stop_are_not_reported(sleepers):
    dht = sleepers()
    stop = threading.Event()
    watch = HelperWatch(stop, "again", period_s=0.05).watch("DHT", dht).start()
    watch.stop()
    dht.terminate()
    dht.join(30)
    time.sleep(0.2)
    assert not stop.is_set() and watch.died is None


def test_an_exit_that_was_not_a_kill_says_its_code_without_guessing(sleepers):
    helper = mp.get_context("fork").Process(target=os._exit, args=(3,), daemon=True)
    helper.start()
    helper.join(30)
    died = helper_died("bootstrap node's DHT", helper, "run the bootstrap node again")
    assert str(died) == (
        f"this bootstrap node's DHT process (pid {helper.pid}) died with exit code 3; run the bootstrap node again"
    )
    assert helper_died("DHT", sleepers(), "x") is None  # alive
    assert helper_died("DHT", mp.get_context("fork").Process(target=time.sleep), "x") is None  # never started


def test_a_process_started_by_a_helper_is_watched_by_pid_and_its_exit_stops_the_command():
    """What the DHT process's p2pd is to the main process: not its own child, found by name."""
    daemon = subprocess.Popen(["sleep", "120"])  # a child here, so child_named finds it by name
    try:
        assert lifetime.child_named(os.getpid(), "sleep") == daemon.pid
        assert lifetime.child_named(os.getpid(), "no-such-daemon") is None
        stop = threading.Event()
        watch = HelperWatch(stop, "run the peer again", period_s=0.05).watch_pid("peer's p2pd", daemon.pid)
        watch.watch_pid("nothing", None).start()  # no pid found: nothing watched
        try:
            assert not stop.wait(0.3)
            daemon.kill()  # not reaped yet: a zombie, which has ended all the same
            assert stop.wait(30)
            assert str(watch.died) == f"this peer's p2pd process (pid {daemon.pid}) exited; run the peer again"
        finally:
            watch.stop()
    finally:
        daemon.kill()
        daemon.wait(30)


SHARER = compile(
    "def serve():\n    raise ConnectionResetError(104, 'Connection reset by peer')\n"
    "def serve_bug():\n    raise ValueError('a bug is still reported')\n",
    os.path.join("lib", "multiprocessing", "resource_sharer.py"),
    "exec",
)


def test_only_a_handshake_cut_in_the_resource_sharer_is_kept_off_stderr(monkeypatch):
    """The sharer's thread hands what it caught to sys.excepthook (multiprocessing/resource_sharer.py)."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda exc_type, exc, tb: seen.append(exc_type))
    lifetime.quiet_handshakes_cut_by_a_dead_helper()
    lifetime.quiet_handshakes_cut_by_a_dead_helper()  # once is enough: not wrapped twice
    sharer = {}
    exec(SHARER, sharer)

    def elsewhere():
        raise ConnectionResetError(104, "Connection reset by peer")

    for target in (sharer["serve"], elsewhere, sharer["serve_bug"]):
        try:
            target()
        except Exception:
            sys.excepthook(*sys.exc_info())
    assert seen == [ConnectionResetError, ValueError]


def test_a_helper_that_dies_after_a_signal_asked_the_command_to_stop_is_no_failure(sleepers, caplog):
    """systemd's stop signals every process of the unit: the helpers may be gone before the command
    looks at them once more on its way out, which must then exit as stopped (130), not as failed
    (75); the watch was red on a fresh machine when p2pd won that race."""
    dht = sleepers()
    stop = threading.Event()
    watch = HelperWatch(stop, "run the bootstrap node again", period_s=0.05).watch("bootstrap node's DHT", dht).start()
    try:
        stop.set()  # the signal, handled first
        os.kill(dht.pid, signal.SIGKILL)
        dht.join(30)
        assert watch.check() is not None  # seen dead ...
        watch.raise_if_died()  # ... but not raised: it went with the stop asked for
        assert watch.died is None
        assert "stopping:" not in caplog.text
    finally:
        watch.stop()
