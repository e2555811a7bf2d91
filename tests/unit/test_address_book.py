"""peer.state.address_book and peer.net.addresses: the peers a peer remembers, and the way back in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import time

import base58
import pytest

from peer.net import addresses
from peer.state import address_book
from peer.state.address_book import AddressBook, AddressKeeper, start_dht_remembering
from protocol.errors import BadPeerAddress, BootstrapUnreachable


def peer_id(i: int) -> str:
    """A well-formed base58 peer id (sha256 multihash) of peer ``i``."""
    return base58.b58encode(bytes([0x12, 0x20]) + hashlib.sha256(str(i).encode()).digest()).decode()


def maddr(i: int, port: int = 4000) -> str:
    return f"/ip4/127.0.0.1/tcp/{port + i}/p2p/{peer_id(i)}"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_addresses_round_trip_newest_first(tmp_path):
    path = tmp_path / "peers.json"
    book = AddressBook(path, now=Clock())
    assert book.add([maddr(1)]) == 1
    assert book.add([maddr(2), maddr(3)]) == 2
    assert book.add([maddr(1)]) == 0  # known: only seen again
    book.save()
    loaded = AddressBook.load(path)
    assert loaded.skipped == 0
    assert loaded.addresses() == [maddr(1), maddr(2), maddr(3)]
    assert loaded.addresses(exclude_peer=peer_id(2)) == [maddr(1), maddr(3)]
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]  # no temporary file left


def test_bad_entries_are_skipped_and_counted(tmp_path):
    path = tmp_path / "peers.json"
    entries = [
        {"maddr": maddr(1), "seen": 10.0},
        {"maddr": "/ip4/127.0.0.1/tcp/4000", "seen": 10.0},  # no /p2p/ id
        {"maddr": "127.0.0.1:4000", "seen": 10.0},  # not a multiaddr
        {"maddr": maddr(2), "seen": "yesterday"},  # bad time
        {"maddr": maddr(3), "seen": float("nan")},  # NaN is no time either
        "/ip4/127.0.0.1/tcp/4000/p2p/" + peer_id(4),  # not a map
        {"maddr": "/ip4/127.0.0.1/tcp/1/p2p/" + "Q" * 600, "seen": 1.0},  # too long
        {"maddr": maddr(5), "seen": 20},
    ]
    path.write_text(json.dumps({"version": 1, "addresses": entries}))
    book = AddressBook.load(path)
    assert book.skipped == 6
    assert book.addresses() == [maddr(5), maddr(1)]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe\x00",
        b'{"version": 2, "addresses": []}',
        b'["/ip4/127.0.0.1/tcp/1"]',
        b'{"version": 1, "addresses": {}}',
    ],
)
def test_an_unreadable_book_starts_empty_and_is_replaced(tmp_path, content):
    path = tmp_path / "peers.json"
    path.write_bytes(content)
    book = AddressBook.load(path)
    assert (book.skipped, book.addresses()) == (1, [])
    book.add([maddr(1)])
    book.save_if_changed()
    assert AddressBook.load(path).addresses() == [maddr(1)]


def test_an_oversized_file_is_not_read(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "addresses": [{"maddr": maddr(1), "seen": 1.0}],
                "padding": "x" * address_book.MAX_FILE_BYTES,
            }
        )
    )
    book = AddressBook.load(path)
    assert (book.skipped, book.addresses()) == (1, [])


def test_the_book_is_bounded_keeping_the_newest(tmp_path):
    book = AddressBook(tmp_path / "peers.json", now=Clock())
    for i in range(address_book.MAX_ENTRIES + 36):
        book.add([maddr(i)])
    kept = book.addresses()
    assert len(kept) == address_book.MAX_ENTRIES
    assert kept[0] == maddr(address_book.MAX_ENTRIES + 35) and maddr(0) not in kept
    book.save()
    assert len(AddressBook.load(book.path).addresses()) == address_book.MAX_ENTRIES


def test_own_and_invalid_addresses_are_not_remembered(tmp_path):
    book = AddressBook(tmp_path / "peers.json")
    assert book.add([maddr(1), maddr(2), "/ip4/1.2.3.4/tcp/5", 42], exclude_peer=peer_id(1)) == 1
    assert book.addresses() == [maddr(2)]


def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "peers.json"
    book = AddressBook(path, now=Clock())
    book.add([maddr(1)])
    book.save()
    before = path.read_bytes()
    book.add([maddr(2)])

    def broken_dump(doc, f, **kwargs):
        f.write('{"version": 1, "addr')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(address_book.json, "dump", broken_dump)
    with pytest.raises(OSError):
        book.save()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]
    book.save_if_changed()  # logs, does not raise
    assert path.read_bytes() == before


def test_seeing_a_known_address_again_does_not_rewrite_the_file_every_time(tmp_path):
    clock = Clock()
    book = AddressBook(tmp_path / "peers.json", now=clock)
    book.add([maddr(1)])
    book.save_if_changed()
    first = book.path.read_text()
    book.add([maddr(1)])
    book.save_if_changed()
    assert book.path.read_text() == first
    clock.t += address_book.RESAVE_AFTER_S
    book.add([maddr(1)])
    book.save_if_changed()
    assert book.path.read_text() != first


class Starter:
    """A stand-in for peer.net.dht_node.start_dht: the peers in ``answering`` answer, every other does not."""

    def __init__(self, answering: set[str]):
        self.answering, self.calls = answering, []

    def __call__(self, peers: list[str]):
        self.calls.append(list(peers))
        if peers and not self.answering & set(peers):
            raise BootstrapUnreachable(f"none of the initial peers answered: {', '.join(peers)}")
        return "dht"


def test_a_restarted_peer_rejoins_through_remembered_peers(tmp_path):
    book = AddressBook(tmp_path / "peers.json", now=Clock())
    book.add([maddr(2)])
    book.add([maddr(3)])  # seen later: tried first
    dead_bootstrap = maddr(1)
    start = Starter(answering={maddr(3)})
    assert start_dht_remembering(start, [dead_bootstrap], book) == "dht"
    assert start.calls == [[dead_bootstrap], [maddr(3), maddr(2)]]
    assert dead_bootstrap not in book.addresses()  # it did not answer: not remembered as seen


def test_initial_peers_that_answer_are_remembered(tmp_path):
    book = AddressBook(tmp_path / "peers.json")
    start = Starter(answering={maddr(1)})
    start_dht_remembering(start, [maddr(1)], book)
    assert start.calls == [[maddr(1)]]
    assert AddressBook.load(book.path).addresses() == [maddr(1)]


def test_when_nobody_answers_the_error_names_both_tries(tmp_path):
    book = AddressBook(tmp_path / "peers.json")
    with pytest.raises(BootstrapUnreachable) as empty:  # nothing remembered: the original error
        start_dht_remembering(Starter(set()), [maddr(1)], book)
    assert "remembered" not in str(empty.value)
    book.add([maddr(2)])
    with pytest.raises(BootstrapUnreachable) as info:
        start_dht_remembering(Starter(set()), [maddr(1)], book)
    assert maddr(1) in str(info.value) and "1 remembered peer address(es)" in str(info.value)
    assert str(book.path) in str(info.value)


def test_a_new_swarm_does_not_consult_the_book(tmp_path):
    book = AddressBook(tmp_path / "peers.json")
    book.add([maddr(2)])
    start = Starter(set())
    start_dht_remembering(start, [], book)
    assert start.calls == [[]]
    with pytest.raises(BadPeerAddress):
        start_dht_remembering(start, ["127.0.0.1:31337"], book)


def test_published_addresses_are_validated_per_peer():
    pid = peer_id(1)
    value = [maddr(1), maddr(1), maddr(2), "/ip4/1.2.3.4/tcp/5", None, "x" * 600, f"/ip4/10.0.0.1/tcp/31337/p2p/{pid}"]
    assert addresses.valid_addresses(pid, value) == [maddr(1), f"/ip4/10.0.0.1/tcp/31337/p2p/{pid}"]
    assert addresses.valid_addresses(pid, {"a": 1}) == []
    many = [f"/ip4/127.0.0.1/tcp/{5000 + i}/p2p/{pid}" for i in range(20)]
    assert len(addresses.valid_addresses(pid, many)) == addresses.MAX_ADDRESSES_PER_PEER


class FakeDHT:
    """Stores and gets values the way hivemind's DHT returns subkey dictionaries."""

    class Item:
        def __init__(self, value, expiration_time):
            self.value, self.expiration_time = value, expiration_time

    def __init__(self, maddrs: list[str]):
        self.stored: dict[str, dict[str, tuple[object, float]]] = {}
        self.maddrs = maddrs

    async def get_visible_maddrs(self, latest=False):  # as the DHT process's node answers
        return self.maddrs

    def run_coroutine(self, coro, return_future=False):
        return done(asyncio.run(coro(self, FakeDHT.Node(self))), return_future)

    class Node:
        """The DHT process's node, as ``run_coroutine`` hands it over: awaitable reads."""

        def __init__(self, dht: FakeDHT):
            self.dht = dht

        async def get_visible_maddrs(self, latest=False):
            return self.dht.maddrs

        async def get(self, key, latest=True):
            return self.dht.get(key, latest=latest)

    def store(self, key, value, expiration, subkey, return_future=False):
        self.stored.setdefault(key, {})[subkey] = (value, expiration)
        return done(True, return_future)

    def get(self, key, latest=True, return_future=False):
        found = (
            self.Item({k: self.Item(*v) for k, v in self.stored[key].items()}, time.time() + 60)
            if key in self.stored
            else None
        )
        return done(found, return_future)


def done(value, as_future: bool):
    """``value``, or a future that holds it, as hivemind's DHT calls return them."""
    if not as_future:
        return value
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def test_the_keeper_publishes_this_peer_and_remembers_the_others(tmp_path):
    from peer.net.identity import ensure_identity
    from protocol.signing import PeerSigner

    me, other, liar = (PeerSigner.from_identity(ensure_identity(tmp_path / f"{i}.key")) for i in range(3))

    def at(signer, port):
        return f"/ip4/127.0.0.1/tcp/{port}/p2p/{signer.peer_id}"

    dht = FakeDHT([at(me, 4001)])
    run_id = "ab" * 16
    key = addresses.addresses_key(run_id)
    expiration = time.time() + 60
    dht.stored[key] = {
        other.peer_id: (other.seal(key, expiration, [at(other, 4002)]), expiration),
        liar.peer_id: (liar.seal(key, expiration, ["bogus", at(other, 4004)]), expiration),  # another's address
        peer_id(5): ([maddr(5)], expiration),  # unsigned
        peer_id(6): (liar.seal(key, expiration, [maddr(6)]), expiration),  # signed by another peer than its id
    }
    book = AddressBook(tmp_path / "peers.json")
    AddressKeeper(dht, book, run_id=run_id, signer=me).refresh()
    assert addresses.read_addresses(dht, run_id)[me.peer_id] == [at(me, 4001)]
    # not its own, nor the liar's entry for another peer, nor the unsigned or wrongly signed ones
    assert AddressBook.load(book.path).addresses() == [at(other, 4002)]

    client = FakeDHT([maddr(9)])
    AddressKeeper(client, AddressBook(tmp_path / "client.json"), run_id=run_id, signer=other, publish=False).refresh()
    assert client.stored == {}
