"""The bound on what a DHT node of ours keeps per key (peer/net/dht_storage.py): a flood of subkeys
fills at most ``max_entries`` places, never displaces the subkeys the node's reads prefer, and keeps
the best-ranked of the rest; a read merges at most ``MAX_ENTRIES_MERGED`` subkeys and never writes
into the node's own storage."""

from __future__ import annotations

import asyncio

from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from peer.net import dht_storage
from peer.net.dht_storage import BoundedLocalStorage
from peer.net.selection import rank_of

KEY = DHTID.generate(source="run.progress")


def _flood(storage: BoundedLocalStorage, names, expiration: float) -> int:
    """Other nodes' writes (hivemind's ``rpc_store`` stores each entry with ``store_subkey``)."""
    return sum(storage.store_subkey(KEY, name, b"record", expiration) for name in names)


def test_a_flood_fills_at_most_max_entries_and_keeps_the_best_ranked():
    storage = BoundedLocalStorage(max_entries=50)
    expiration = get_dht_time() + 600
    names = [f"sybil{i}" for i in range(2_000)]
    assert _flood(storage, names, expiration) < 2_000  # some were refused
    kept = set(storage.get(KEY).value.data)
    assert len(kept) == 50
    assert kept == set(sorted(names, key=rank_of)[:50])  # the keyed hash decides, not the order of arrival


def test_preferred_subkeys_are_never_displaced_and_always_admitted():
    storage = BoundedLocalStorage(max_entries=50)
    expiration = get_dht_time() + 600
    storage.store_subkey(KEY, "me", b"mine", expiration)
    storage.prefer(KEY, ["me", "friend"])
    _flood(storage, [f"sybil{i}" for i in range(2_000)], expiration + 1e5)  # later expirations do not help
    assert storage.store_subkey(KEY, "friend", b"theirs", expiration)  # admitted into a full dictionary
    value = storage.get(KEY).value
    assert len(value) == 50 and {"me", "friend"} <= set(value.data)
    assert storage.store_subkey(KEY, "me", b"mine, newer", expiration + 10)  # an update is always accepted
    assert storage.get(KEY).value.get("me").value == b"mine, newer"


def test_the_nodes_own_writes_are_kept_like_preferred_ones():
    storage = BoundedLocalStorage(max_entries=50)
    expiration = get_dht_time() + 600
    names = sorted((f"sybil{i}" for i in range(2_000)), key=rank_of)
    _flood(storage, names[:50], expiration)
    worst = names[-1]
    assert not storage.store_subkey(KEY, worst, b"a stranger's", expiration)  # another node's write: refused
    assert storage.store(KEY, b"announcement", expiration, subkey=worst)  # this node's own write: admitted
    _flood(storage, names[50:], expiration)
    assert worst in storage.get(KEY).value.data


def test_an_unpreferred_subkey_ranked_worse_than_every_entry_is_refused():
    storage = BoundedLocalStorage(max_entries=10)
    expiration = get_dht_time() + 600
    names = sorted((f"s{i}" for i in range(100)), key=rank_of)
    _flood(storage, names[:10], expiration)
    assert not storage.store_subkey(KEY, names[-1], b"x", expiration)
    assert not storage.store_subkey(KEY, names[10], b"x", expiration)  # worse than the worst kept, if only just
    assert set(storage.get(KEY).value.data) == set(names[:10])


def test_a_whole_dictionary_stored_at_once_is_cut_to_the_bound():
    storage = BoundedLocalStorage(max_entries=20)
    storage.prefer(KEY, ["me"])
    expiration = get_dht_time() + 600
    merged = DictionaryDHTValue()
    for name in ["me", *(f"sybil{i}" for i in range(500))]:
        merged.store(name, b"record", expiration)
    assert storage.store(KEY, merged, expiration)  # what hivemind's cache does with a read's result
    kept = storage.get(KEY).value
    assert len(kept) == 20 and "me" in kept.data


def test_a_read_merges_a_bounded_number_of_subkeys_and_leaves_local_storage_alone(monkeypatch):
    monkeypatch.setattr(dht_storage, "MAX_ENTRIES_MERGED", 300)
    expiration = get_dht_time() + 600

    def answer(prefix: str, count: int) -> ValueWithExpiration:
        value = DictionaryDHTValue()
        for i in range(count):
            value.store(f"{prefix}{i}", b"record", expiration)
        return ValueWithExpiration(value, expiration)

    class Search(_SearchState):
        add_candidate = dht_storage._bounded_add_candidate(_SearchState.add_candidate)

    async def main():
        local = answer("own", 100)  # the reader's own storage's dictionary
        search = Search(KEY, float("inf"))
        search.add_candidate(local, source_node_id=None)
        for node in range(5):
            search.add_candidate(answer(f"node{node}-", 1_000), source_node_id=None)
        assert len(local.value) == 100  # hivemind merged the others into it
        assert len(search.binary_value) == 300
        assert {f"own{i}" for i in range(100)} <= set(search.binary_value.data)
        search.future.cancel()

    asyncio.run(main())
