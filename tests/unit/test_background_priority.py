"""The sync's priority beside a card's training thread (peer/net/lifetime.py)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from peer.net import lifetime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def niceness_in_a_new_thread(before=lambda: None) -> int:
    seen: list[int] = []

    def run() -> None:
        before()
        seen.append(os.nice(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def restore(monkeypatch):
    monkeypatch.setattr(lifetime, "_background_nice", 0)


def test_nothing_changes_until_a_peer_on_an_accelerator_asks(restore):
    base = os.nice(0)
    assert niceness_in_a_new_thread(lifetime.yield_to_training) == base


def test_background_threads_yield_and_the_calling_thread_does_not(restore):
    base = os.nice(0)
    lifetime.lower_background_priority(7)
    assert niceness_in_a_new_thread(lifetime.yield_to_training) == max(base, 7)
    assert os.nice(0) == base  # niceness is per thread: the training thread keeps its own
    # a thread already nicer than asked stays where it is
    assert niceness_in_a_new_thread(lambda: (os.nice(12 - os.nice(0)), lifetime.yield_to_training())) == max(12, base)


@pytest.mark.parametrize("bad", [-1, 20])
def test_a_niceness_out_of_range_is_refused_by_name(restore, bad):
    with pytest.raises(ValueError, match=f"nice = {bad}"):
        lifetime.lower_background_priority(bad)
