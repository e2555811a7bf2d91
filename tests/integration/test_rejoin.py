"""A restarted peer remembers the swarm: with its bootstrap node gone, it rejoins through the address
of a peer it saw before (``<data-dir>/peers.json``), not through its --initial-peers."""

from __future__ import annotations

import signal
import time

import pytest

from peer.state.address_book import FILE_NAME, AddressBook
from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


def test_a_restarted_peer_rejoins_through_a_remembered_peer(procs, tmp_path):
    # Rounds of a few seconds: peer-b, alone while peer-a restarts, must not race through the
    # states peer-a is downloading from it faster than peer-a can fetch one.
    manifest = make_manifest(sync={"inner_steps": 20})
    boot, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    a = procs.peer("peer-a", "--initial-peers", addr, "--wait-for-peers", "2")
    b = procs.peer("peer-b", "--initial-peers", addr, "--wait-for-peers", "2")
    a_id = a.wait_event(lambda e: e.kind == "started", 120)["peer_id"]
    b_started = b.wait_event(lambda e: e.kind == "started", 120)
    a.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 180)

    book = tmp_path / "peer-a" / FILE_NAME
    wait_until(
        lambda: set(b_started.maddrs) <= set(AddressBook.load(book).addresses()),
        90,
        f"peer-a remembers peer-b's addresses {b_started.maddrs} in {book}",
    )
    assert addr in AddressBook.load(book).addresses()  # the initial peer that answered, too

    boot.kill()  # the bootstrap node and its p2pd are gone for good
    a.send(signal.SIGINT)
    assert a.wait(60) == 130, a.tail()
    a.kill()  # nothing of its DHT may linger: the restart reuses its identity

    # Same data dir, same argv: the dead bootstrap node is its only --initial-peers.
    a.start()
    rejoined = a.wait_event(lambda e: e.start == 2 and e.kind == "started", 120)
    assert rejoined["peer_id"] == a_id
    a.wait_event(lambda e: e.start == 2 and e.kind == "round" and e["group_size"] == 2, 180)
    assert "trying" in (tmp_path / "peer-a.log").read_text()  # it said it fell back to remembered peers
    assert b.alive
