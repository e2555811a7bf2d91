"""Issue 17: "values on the next rounds' matchmaking keys stopped every group from forming".

hivemind's matchmaking (``GroupKeyManager``) declares each peer under ``f"{prefix}.0b{group bits}"``
as one entry of a dictionary (subkey: the peer id's bytes, value: looking for group, a bool) and
finds its groupmates with ``get_averagers``, which returns nothing when the value read is not a
dictionary. A DHT node keeps a plain value with a later expiration over the whole dictionary, so a
stranger who stores one under the keys of the next rounds hides every declaration and no group
forms. peer/net/validator.py ``protect_round`` (called by ``LocoAverager.set_group_bits`` each
round) makes a node of ours refuse anything but (peer id bytes → bool) under the run's matchmaking
keys for rounds r-2..r+8.

Real DHT nodes (a node of ours, a stock hivemind node as the attacker); the reads are hivemind's
own ``GroupKeyManager.get_averagers``, what matchmaking does before a group forms. The full
averager (a group actually assembling) is not started here: the read that decides whether a peer
sees its groupmates is the one exercised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils import get_dht_time

from peer.net import dht_node
from peer.net.validator import is_peer_id_bytes, matchmaking_keys, protect_round
from protocol import keys
from tests.security.dht_attacker import victim_and_attacker

pytestmark = pytest.mark.timeout(120)

RUN = "ab" * 8
PREFIX = keys.averager_prefix(RUN, "diloco")


def _key(round_: int, group_index=None, attempt: int = 0) -> str:
    return f"{PREFIX}.0b{keys.round_group_bits(round_, group_index, attempt)}"


def _run(coroutine):
    """Run ``coroutine`` to completion on a fresh event loop in a worker thread.

    Not on this thread's loop: hivemind's ``MPFuture`` remembers the loop current where it was made
    (``Attacker.store_raw``'s futures take this thread's) and, when its result comes while that loop
    is idle, runs it briefly from hivemind's background thread (``loop.run_until_complete``); a
    ``run_until_complete`` here at that moment fails with "This event loop is already running". The
    futures made inside ``coroutine`` take the worker's running loop, closed when it returns.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _declare(dht, key: str, expiration: float) -> None:
    manager = GroupKeyManager(dht, PREFIX, keys.round_group_bits(0), target_group_size=4)
    assert _run(manager.declare_averager(key, dht.peer_id, expiration))


def _averagers(dht, key: str) -> set:
    manager = GroupKeyManager(dht, PREFIX, keys.round_group_bits(0), target_group_size=4)
    return {peer for peer, _ in _run(manager.get_averagers(key, only_active=True))}


@pytest.fixture(scope="module")
def swarm():
    """A node of ours, a second honest node of ours, and a stock node as the attacker."""
    with victim_and_attacker() as (victim, attacker):
        other = dht_node.start_dht(initial_peers=[str(m) for m in victim.get_visible_maddrs()])
        try:
            yield victim, other, attacker
        finally:
            other.shutdown()


def _attack(attacker, key: str) -> list[bool]:
    """Store a plain value and junk entries under ``key``, expiring later than any declaration;
    what the victim accepted, in order."""
    far = get_dht_time() + 600
    return [
        attacker.store(key, "no groups this round", expiration=far),
        attacker.store(key, True, subkey=b"not a peer id", expiration=far),
        attacker.store(key, "not a bool", subkey=attacker.dht.peer_id.to_bytes(), expiration=far),
    ]


def test_without_protection_a_plain_value_hides_every_declaration(swarm):
    """The attack itself, on keys no node protects (what every key was before the fix)."""
    victim, other, attacker = swarm
    key = _key(900)
    expiration = get_dht_time() + 60
    _declare(victim, key, expiration)
    _declare(other, key, expiration)
    assert _averagers(victim, key) == {victim.peer_id, other.peer_id}
    assert _attack(attacker, key)[0]  # a stock-hivemind behaviour: the plain value is stored
    assert _averagers(victim, key) == set()  # every declaration hidden: no group can form


def test_the_next_rounds_matchmaking_keys_refuse_plain_values_and_junk(swarm):
    victim, other, attacker = swarm
    for node in (victim, other):
        protect_round(node, PREFIX, 5)
    for key in (_key(5), _key(6, attempt=1), _key(13), _key(7, group_index=3)):
        assert _attack(attacker, key) == [False, False, False], key
        expiration = get_dht_time() + 60
        _declare(victim, key, expiration)
        _declare(other, key, expiration)
        assert _averagers(victim, key) == {victim.peer_id, other.peer_id}, key
        assert _averagers(other, key) == {victim.peer_id, other.peer_id}, key
    # a declaration stored by the attacker for itself is a peer's declaration like any other (through
    # hivemind's own store: Attacker.store encodes a subkey once more than a declaration carries it)
    _declare(attacker.dht, _key(8), get_dht_time() + 60)
    assert attacker.dht.peer_id in _averagers(victim, _key(8))


def test_the_window_moves_with_the_round(swarm):
    victim, _, attacker = swarm
    protect_round(victim, PREFIX, 20)
    assert not attacker.store(_key(28), "junk")  # r+8: protected
    assert attacker.store(_key(10), "junk")  # left behind: no longer checked
    assert attacker.store(_key(40), "junk")  # beyond the window


def test_window_and_peer_id_bytes():
    window = matchmaking_keys(PREFIX, 0)
    assert _key(0) in window and _key(-2) in window and _key(8, 15, 1) in window
    assert _key(9) not in window and _key(0, 16) not in window
    assert len(window) == len(set(window))
    assert not is_peer_id_bytes(b"protocol.dht")
    assert not is_peer_id_bytes(b"\x12\x20" + b"x" * 31)
    assert is_peer_id_bytes(b"\x12\x20" + b"x" * 32)
    assert is_peer_id_bytes(b"\x00\x24" + b"x" * 36)
    assert not is_peer_id_bytes(True)


def test_the_averager_protects_the_round_it_is_set_to(swarm, monkeypatch):
    """``LocoAverager.set_group_bits`` (what the round loop calls before each sync) moves the
    window of its DHT node to the round in the bits (the averager process itself is not started)."""
    from hivemind.averaging import DecentralizedAverager

    from peer.sync.averager import LocoAverager

    victim, _, attacker = swarm
    set_bits = []

    def set_group_bits(self, bits, wait=True):  # hivemind's, as LocoAverager calls it: a future it waits on
        set_bits.append(bits)
        taken = concurrent.futures.Future()
        taken.set_result(None)
        return taken

    monkeypatch.setattr(DecentralizedAverager, "set_group_bits", set_group_bits)

    class Bare(LocoAverager):  # no process, nothing for hivemind's __del__ to stop
        def __del__(self):
            pass

    averager = Bare.__new__(Bare)
    averager.dht, averager.prefix = victim, PREFIX
    averager.set_group_bits(keys.round_group_bits(500, None, 1))
    assert set_bits == [keys.round_group_bits(500, None, 1)]
    assert not attacker.store(_key(508), "junk")
    assert not attacker.store(_key(500, 2, 1), "junk")
    assert attacker.store(_key(20), "junk")  # the previous window (round 20) is left behind
