"""Issue #51, item 5: identities cost weight. 20,000 records signed by 20,000 fresh identities made
every later round "no group formed" (expected group 4,096) and cost each peer ~500 MB.

Real DHT nodes on 127.0.0.1: an honest node as ``peer join`` starts it (with its record validator)
and a stock hivemind node that floods the run's progress key with records, each validly signed by
an identity of its own (tests/security/dht_attacker.py ``sybil_signers``: cheap keys from a pool of
primes). The honest node keeps at most ``dht_storage.MAX_ENTRIES_STORED`` of them, its vouched
peers' first; a read keeps at most ``MAX_RECORDS_READ``, chosen in the DHT process with this
peer's vouched peers first; the view of the swarm a peer acts on (``SwarmView.live``: group sizes,
NoLoCo partners, the start barrier) counts its trusted peers and a bounded number of newcomers.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue

from peer.net import dht as swarm_dht, dht_storage, selection
from peer.state.vouching import Ledger
from peer.sync.membership import MAX_NEWCOMERS, SwarmView, weigh
from peer.train.outer import make_outer
from protocol import keys
from protocol.presets import PRESETS
from protocol.records import ProgressRecord
from tests.security.dht_attacker import flood_records, sybil_signers, victim_and_attacker

pytestmark = pytest.mark.timeout(240)

RUN = "5b" * 8
FLOOD = 3_000
"""Sybil records stored per test here (the benchmark, bench/sybil.py, stores 20,000)."""
RECORD = ProgressRecord(
    round=4, inner_step=40, train_loss=3.0, tokens_per_s=100.0, group_size=4, bytes_sent=10, state_digest="a" * 32
)


@pytest.fixture(scope="module")
def identities():
    """``(me, friends, sybils)``: this peer, 3 honest peers it syncs with, FLOOD fresh identities."""
    signers = sybil_signers(4 + FLOOD)
    return signers[0], signers[1:4], signers[4:]


@pytest.fixture(scope="module")
def flooded(identities):
    """An honest node holding the 4 honest peers' records (each names the others as its groupmates)
    and FLOOD Sybil records tracking the same round; and the attacker's node."""
    me, friends, sybils = identities
    honest = [me, *friends]
    with victim_and_attacker() as (peer, attacker):
        key = keys.progress_key(RUN)
        for signer in honest:
            mates = tuple(s.peer_id for s in honest if s is not signer)
            swarm_dht.publish_progress(peer, RUN, signer, dataclasses.replace(RECORD, groupmates=mates), 600.0)
        # as the peer's membership does each round: a read preferring this peer and its vouched peers
        assert len(swarm_dht.read_progress(peer, RUN, prefer={s.peer_id for s in honest})) == 4
        assert flood_records(attacker.dht, key, sybils, RECORD.to_wire()) > 0
        deadline = time.monotonic() + 60
        while len(swarm_dht.read_entries(peer, key, cap=10**6)) < STORED and time.monotonic() < deadline:
            time.sleep(0.5)
        yield peer, attacker


STORED = dht_storage.MAX_ENTRIES_STORED
"""What the honest node keeps of the 4 + FLOOD records (peer/net/dht_storage.py)."""


async def _held(_dht, node, key: str) -> tuple[int, int]:  # in the DHT process
    key_id = DHTID.generate(source=key)
    return tuple(
        len(found.value) if found is not None and isinstance(found.value, DictionaryDHTValue) else 0
        for found in (node.protocol.storage.get(key_id), node.protocol.cache.get(key_id))
    )


def test_the_node_keeps_at_most_the_bound_per_key_its_vouched_peers_included(flooded, identities):
    peer, _ = flooded
    me, friends, _ = identities
    assert FLOOD > STORED
    key = keys.progress_key(RUN)
    found = swarm_dht.read_entries(peer, key, cap=10**6)
    assert len(found) == STORED  # not 4 + FLOOD: the rest were refused or displaced
    assert {me.peer_id, *(f.peer_id for f in friends)} <= {subkey for subkey, _, _ in found}
    stored, cached = peer.run_coroutine(functools.partial(_held, key=key))
    assert stored == STORED and cached <= STORED


@pytest.fixture()
def verified(monkeypatch):
    """Peer ids whose signature this process checked (every per-peer read verifies in ``read_signed``)."""
    calls: list[str] = []
    real = swarm_dht.open_record

    def counting(key, subkey, expiration, value):
        calls.append(subkey)
        return real(key, subkey, expiration, value)

    monkeypatch.setattr(swarm_dht, "open_record", counting)
    return calls


def test_the_flood_is_stored_and_a_read_keeps_at_most_the_cap(flooded, identities, verified):
    peer, _ = flooded
    me, friends, sybils = identities
    assert len(swarm_dht.read_entries(peer, keys.progress_key(RUN), cap=10**6)) == STORED
    assert selection.MAX_RECORDS_READ <= 500  # "a few hundred"
    found = swarm_dht.read_progress(peer, RUN, prefer={me.peer_id, *(f.peer_id for f in friends)})
    assert len(found) == selection.MAX_RECORDS_READ
    assert len(verified) == selection.MAX_RECORDS_READ  # only the kept entries crossed from the DHT process
    assert {me.peer_id, *(f.peer_id for f in friends)} <= {p.peer_id for p in found}  # vouched peers first


def test_a_read_with_a_given_subkey_returns_that_entry_alone(flooded, identities):
    peer, _ = flooded
    me, _, _ = identities
    found = swarm_dht.read_entries(peer, keys.progress_key(RUN), only=me.peer_id)
    assert [subkey for subkey, _, _ in found] == [me.peer_id]


def _view(peer, me, ledger: Ledger | None) -> SwarmView:
    view = SwarmView(peer, run_id=RUN, signer=me, record_ttl_s=600.0, max_sync_s=3600.0)  # nothing stale here
    if ledger is not None:
        view.trust(ledger)
    return view


def test_group_sizes_and_partners_come_from_trusted_peers_under_the_flood(flooded, identities):
    peer, _ = flooded
    me, friends, _ = identities
    ledger = Ledger()
    ledger.record_group(3, [friends[0].peer_id])  # one completed sync: the others are named by its record
    live = _view(peer, me, ledger).live()
    honest = {me.peer_id, *(f.peer_id for f in friends)}
    assert {r.peer_id for r in live} == honest
    manifest = PRESETS["tiny"]()
    others = [(r.peer_id, r.record.round) for r in live if r.peer_id != me.peer_id]
    diloco = make_outer(manifest.replace(sync={"algorithm": "diloco"}), shapes=[])
    assert diloco.choose_group(me.peer_id, round_=4, live=others, run_id=RUN).expected_size == 4  # not 257
    noloco_manifest = manifest.replace(sync={"algorithm": "noloco"}, noloco={"group_size": 2})
    plans = set()
    for signer in (me, *friends):  # every honest peer sees the same 4 peers, so they draw the same groups
        theirs = [(p, 4) for p in honest if p != signer.peer_id]
        choice = make_outer(noloco_manifest, shapes=[]).choose_group(signer.peer_id, round_=4, live=theirs, run_id=RUN)
        assert set(choice.members) <= honest and len(choice.members) == 2
        plans.add(tuple(sorted(choice.members)))
    assert len(plans) == 2  # two pairs, each drawn alike by both its members


def test_a_peer_without_history_admits_a_bounded_number_of_newcomers(flooded, identities):
    peer, _ = flooded
    joiner = sybil_signers(1)[0]  # no record yet, no ledger, named by no one
    live = _view(peer, joiner, Ledger()).live()
    assert len(live) == MAX_NEWCOMERS  # the newcomers every joiner of the run ranks first
    assert {r.peer_id for r in live} == {r.peer_id for r in _view(peer, joiner, Ledger()).live()}
    untrusted = _view(peer, joiner, None).live()  # a view without a ledger (a pipeline stage's): the read's cap
    assert len(untrusted) == selection.MAX_RECORDS_READ


def test_weigh_admits_few_newcomers_and_follows_signed_groupmates():
    def rec(peer_id, mates=()):
        return swarm_dht.PeerProgress(peer_id, dataclasses.replace(RECORD, groupmates=tuple(mates)), 0.0)

    records = [rec("me"), rec("a", ["b"]), rec("b", ["a", "c"]), rec("c"), rec("d"), *(rec(f"s{i}") for i in range(40))]
    # a and, through the statements, b and c are trusted; 41 strangers are a flood: none of them counts
    assert [r.peer_id for r in weigh(records, me="me", ledger={"a"}, run_id=RUN)] == ["me", "a", "b", "c"]
    # a few newcomers count (a joiner's wave)
    assert [r.peer_id for r in weigh(records[:5], me="me", ledger={"a"}, run_id=RUN)] == ["me", "a", "b", "c", "d"]
    # nothing trusted (two joiners without records): max_newcomers of them, the same for every reader of the run
    first = weigh(records, me="x", ledger=set(), run_id=RUN, max_newcomers=5)
    second = weigh(list(reversed(records)), me="y", ledger=set(), run_id=RUN, max_newcomers=5)
    assert len(first) == 5 and {r.peer_id for r in first} == {r.peer_id for r in second}
    assert {r.peer_id for r in weigh(records, me="x", ledger=set(), run_id="other", max_newcomers=5)} != {
        r.peer_id for r in first
    }  # another run ranks them otherwise
