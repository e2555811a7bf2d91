"""protocol/lifetime.py ``HelperWatch``: a helper process that dies stops the command once, with
one error naming it; a helper shut down on purpose after ``stop`` is not reported.

The helpers are real forked processes (sleepers standing in for the DHT and the averager), killed
with SIGKILL as the kernel's OOM killer does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from protocol.errors import HelperDied
from protocol.lifetime import HelperWatch, helper_died


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
    watch = HelperWatch(stop, "run the peer again", period_s=0.05).watch("peer's DHT", dht).watch(
        "peer's averager", averager).start()
    try:
        assert not stop.wait(0.3) and watch.died is None  # both alive: nothing happens
        os.kill(averager.pid, signal.SIGKILL)
        assert stop.wait(30)
        assert isinstance(watch.died, HelperDied) and watch.died.exit_code == 75
        assert str(watch.died) == (f"this peer's averager process (pid {averager.pid}) died with exit code -9 "
                                   "(killed, most often for memory); run the peer again")
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
    assert str(died) == (f"this bootstrap node's DHT process (pid {helper.pid}) died with exit code 3; "
                         "run the bootstrap node again")
    assert helper_died("DHT", sleepers(), "x") is None  # alive
    assert helper_died("DHT", mp.get_context("fork").Process(target=time.sleep), "x") is None  # never started
