"""What a DHT node of ours keeps per key: at most :data:`MAX_ENTRIES_STORED` entries of a value
with subkeys, in its storage and in its cache, and at most :data:`MAX_ENTRIES_MERGED` in one read.

hivemind (1.1.12) keeps every (key, subkey) it is asked to store until it expires, answers each
lookup of the key with all of them (serialized whole), and merges every answer of a read into one
dictionary (the first one it adopts is the reader's own storage's, so a read also grows its own
storage by everything the others hold) which it then caches and sends to one more node to cache.
Identities are free, so without a bound a flood of validly signed records under a run's key grows
every node's storage and every lookup's answer without limit (docs/benchmarks.md, bench/sybil.py).

The bound (:class:`BoundedLocalStorage`, installed in the DHT process by :func:`install`): a
dictionary value holds at most ``max_entries`` subkeys. A new subkey of a full dictionary takes the
place of the stored entry ranked worst by a keyed hash of its subkey (``selection.rank_of``: a
per-process key, so a writer cannot compute which entries it displaces, and different nodes keep
different ones), or is refused when it ranks worse itself; the subkeys this node's own reads prefer
(:meth:`BoundedLocalStorage.prefer`: this peer, the peers it vouches for; peer/net/dht.py
``read_entries`` tells it) and the ones this node wrote itself are never displaced and always
admitted while some entry is not preferred. An entry already stored is always updated. So an
honest peer's record survives a flood on its own node and on the nodes whose peers vouch for it;
the others keep a random ``max_entries`` of the rest (a newcomer's record among them by chance).

Only this module's :func:`install`, run in the DHT process, changes hivemind's behaviour there.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Iterable

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils.timed_storage import ValueWithExpiration

from peer.net.selection import MAX_RECORDS_READ, rank_of

logger = logging.getLogger(__name__)

MAX_ENTRIES_STORED = 4 * MAX_RECORDS_READ
"""The most subkeys a node of ours keeps under one key, in its storage and in its cache (1,024 entries
of a signed record: about 1 MB). Four times what one reader keeps (``MAX_RECORDS_READ``), so that a
few readers whose preferred peers differ each find theirs."""

MAX_ENTRIES_MERGED = 4 * MAX_ENTRIES_STORED
"""The most subkeys one read merges from the answers of the nodes it asks; entries of later answers
beyond it update the ones already merged and add none."""

MAX_PREFERRED_KEYS = 64
"""Keys whose preferred subkeys a storage remembers (the oldest told is forgotten first)."""

_NEG = bytes(range(255, -1, -1))


def _inverse(rank: bytes) -> bytes:
    """``rank`` with every byte complemented: a min-heap of it pops the highest rank first."""
    return rank.translate(_NEG)


def _copy(dictionary: DictionaryDHTValue, subkeys: Iterable | None = None) -> DictionaryDHTValue:
    """A new dictionary value with the live entries of ``dictionary`` (only ``subkeys``, if given)."""
    out = DictionaryDHTValue(dictionary.maxsize if dictionary.maxsize != float("inf") else None)
    wanted = None if subkeys is None else set(subkeys)
    for subkey, (value, expiration) in dictionary.items():
        if wanted is None or subkey in wanted:
            out.store(subkey, value, expiration)
    return out


class BoundedLocalStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage`` whose dictionary values hold at most ``max_entries`` subkeys
    (module docstring). Plain values are stored as hivemind stores them."""

    def __init__(self, maxsize: int | None = None, *, max_entries: int = MAX_ENTRIES_STORED):
        super().__init__(maxsize)
        if max_entries < 2:
            raise ValueError(f"max_entries must be at least 2, got {max_entries}")
        self.max_entries = max_entries
        self._prefer: dict[DHTID, frozenset] = {}
        self._own: dict[DHTID, dict] = {}  # subkeys this node wrote itself (its record, a run it keeps alive)
        self._heaps: dict[DHTID, list] = {}  # full dictionaries: (inverse rank, n, subkey) of unpreferred entries
        self._counter = itertools.count()

    def prefer(self, key: DHTID, subkeys: Iterable) -> None:
        """Never displace the entries of ``subkeys`` under ``key`` (at most ``max_entries // 2`` of
        them are remembered), replacing what was preferred under ``key`` before."""
        self._prefer.pop(key, None)
        self._prefer[key] = frozenset(itertools.islice(subkeys, self.max_entries // 2))
        while len(self._prefer) > MAX_PREFERRED_KEYS:
            del self._prefer[next(iter(self._prefer))]
        self._heaps.pop(key, None)  # rebuilt without the newly preferred entries when next needed

    def preferred(self, key: DHTID) -> frozenset:
        """The subkeys under ``key`` this storage never displaces: the ones its reads prefer
        (:meth:`prefer`) and the last ``max_entries // 4`` this node wrote itself (:meth:`store`)."""
        own = self._own.get(key)
        prefer = self._prefer.get(key, frozenset())
        return prefer | own.keys() if own else prefer

    def store(self, key: DHTID, value, expiration_time: float, subkey=None) -> bool:
        """hivemind's ``store``; a whole dictionary value (a cached read) is cut to ``max_entries``.
        With a subkey, this is the node's own write (hivemind's ``store_many`` stores into its own
        storage this way; other nodes' writes come through ``store_subkey``): that subkey is preferred."""
        if subkey is None and isinstance(value, DictionaryDHTValue) and len(value) > self.max_entries:
            value = self._trimmed(key, value)
        elif subkey is not None:
            own = self._own.pop(key, {})
            own.pop(subkey, None)
            own[subkey] = None
            while len(own) > self.max_entries // 4:
                del own[next(iter(own))]
            self._own[key] = own
            while len(self._own) > MAX_PREFERRED_KEYS:
                del self._own[next(iter(self._own))]
        return super().store(key, value, expiration_time, subkey=subkey)

    def store_subkey(self, key: DHTID, subkey, value: bytes, expiration_time: float) -> bool:
        """hivemind's ``store_subkey``, refused (False) for a new subkey of a full dictionary that
        ranks worse than every entry it could displace."""
        current = self.get(key)
        dictionary = current.value if current is not None else None
        added = not isinstance(dictionary, DictionaryDHTValue) or subkey not in dictionary
        if added and isinstance(dictionary, DictionaryDHTValue) and len(dictionary) >= self.max_entries:
            if not self._make_room(key, dictionary, subkey):
                return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        heap = self._heaps.get(key)
        if stored and added and heap is not None and subkey not in self.preferred(key):
            heapq.heappush(heap, (_inverse(rank_of(subkey)), next(self._counter), subkey))
        return stored

    def _make_room(self, key: DHTID, dictionary: DictionaryDHTValue, subkey) -> bool:
        """Delete the worst-ranked unpreferred entry of ``dictionary`` if ``subkey`` deserves its
        place; whether it does."""
        prefer = self.preferred(key)
        for attempt in range(2):
            heap = self._heaps.get(key)
            if heap is None or len(heap) > 2 * self.max_entries or (attempt and not heap):
                heap = [(_inverse(rank_of(s)), next(self._counter), s) for s in dictionary.data if s not in prefer]
                heapq.heapify(heap)
                self._heaps[key] = heap
                if len(self._heaps) > 2 * len(self.data) + 16:  # heaps of keys that expired
                    self._heaps = {k: h for k, h in self._heaps.items() if k in self.data}
            while heap and (heap[0][2] not in dictionary.data or heap[0][2] in prefer):
                heapq.heappop(heap)  # expired, displaced or since preferred
            if heap:
                break
        if not heap:
            return False  # every entry is preferred
        if subkey not in prefer and _inverse(rank_of(subkey)) <= heap[0][0]:
            return False
        del dictionary[heapq.heappop(heap)[2]]
        return True

    def _trimmed(self, key: DHTID, dictionary: DictionaryDHTValue) -> DictionaryDHTValue:
        prefer = self.preferred(key)
        ranked = sorted(dictionary.data, key=lambda s: (s not in prefer, rank_of(s)))
        return _copy(dictionary, ranked[: self.max_entries])


def _bounded_add_candidate(original):
    """``_SearchState.add_candidate`` that adopts a copy of the first dictionary it gets (hivemind
    adopts the object itself: the reader's own storage's, which then grows by every other answer)
    and merges at most :data:`MAX_ENTRIES_MERGED` subkeys."""

    def add_candidate(self, candidate, source_node_id):
        if candidate is not None and isinstance(candidate.value, DictionaryDHTValue) and not self.finished:
            merged = self.binary_value
            if not isinstance(merged, DictionaryDHTValue):
                candidate = ValueWithExpiration(_copy(candidate.value), candidate.expiration_time)
            elif len(merged) + len(candidate.value) > MAX_ENTRIES_MERGED:
                room = MAX_ENTRIES_MERGED - len(merged)
                new = [s for s in candidate.value.data if s not in merged.data]
                keep = itertools.chain((s for s in candidate.value.data if s in merged.data), new[: max(0, room)])
                candidate = ValueWithExpiration(_copy(candidate.value, keep), candidate.expiration_time)
        return original(self, candidate, source_node_id)

    return add_candidate


def install() -> None:
    """In the DHT process, before its node starts: every ``DHTProtocol`` made from now on stores into
    :class:`BoundedLocalStorage` (its storage and its cache), and reads merge at most
    :data:`MAX_ENTRIES_MERGED` subkeys. Idempotent."""
    from hivemind.dht import protocol
    from hivemind.dht.node import _SearchState

    if getattr(_SearchState, "_locoswarm_bounded", False):
        return
    protocol.DHTLocalStorage = BoundedLocalStorage  # DHTProtocol.create makes its storage and cache with it
    _SearchState.add_candidate = _bounded_add_candidate(_SearchState.add_candidate)
    _SearchState._locoswarm_bounded = True


def prefer(node, key: str, subkeys: Iterable) -> None:
    """In the DHT process: tell ``node``'s storage and cache which subkeys of ``key`` to keep first
    (:meth:`BoundedLocalStorage.prefer`); nothing for a node without bounded storage."""
    key_id, subkeys = DHTID.generate(source=key), frozenset(subkeys)
    for storage in (node.protocol.storage, node.protocol.cache):
        if isinstance(storage, BoundedLocalStorage):
            storage.prefer(key_id, subkeys)
