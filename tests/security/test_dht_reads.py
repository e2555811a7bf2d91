"""Issue 17, item 5: a bad DHT value neither hangs nor crashes a peer's reads; it is skipped.

A real hivemind DHT on loopback (the peer's own node, as ``peer join`` starts it) and a stock
hivemind node that stores what it likes in the peer's storage. Each read must come back, within the
test's timeout, with the honest values and without the bad ones.
"""

from __future__ import annotations

import dataclasses

import pytest

from peer.net import addresses, dht as swarm_dht
from peer.net.identity import ensure_identity
from protocol import keys
from protocol.errors import ManifestError, ManifestNotFound
from protocol.manifest import RunManifest
from protocol.records import ProgressRecord
from protocol.signing import PeerSigner
from tests.security.dht_attacker import victim_and_attacker

pytestmark = pytest.mark.timeout(90)

HONEST = ProgressRecord(round=3, inner_step=30, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10)
NOT_MSGPACK = b"\xc1\xc1\xc1"  # 0xc1 is never used in msgpack


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    identity = ensure_identity(tmp_path_factory.mktemp("peer") / "identity.key")
    with victim_and_attacker(identity) as (peer, attacker):
        peer.signer = PeerSigner.from_identity(identity)
        yield peer, attacker


def _honest_record(peer, run_id: str) -> None:
    assert swarm_dht.publish_progress(peer, run_id, peer.signer, HONEST, ttl_s=60)


def test_a_record_that_is_not_msgpack_is_skipped(swarm):
    peer, attacker = swarm
    run_id = "a" * 32
    _honest_record(peer, run_id)
    assert attacker.store_raw(keys.progress_key(run_id), NOT_MSGPACK, subkey="fake")
    records = swarm_dht.read_progress(peer, run_id, timeout_s=20)
    assert [(r.peer_id, r.record) for r in records] == [(peer.signer.peer_id, HONEST)]


def test_a_round_of_2_63_is_ignored(swarm):
    peer, attacker = swarm
    run_id = "b" * 32
    _honest_record(peer, run_id)
    fake = dataclasses.replace(HONEST, round=2**63 - 1, inner_step=2**63 - 1)
    assert attacker.store(keys.progress_key(run_id), fake.to_wire(), subkey="fake")
    records = swarm_dht.read_progress(peer, run_id, timeout_s=20)
    assert [r.peer_id for r in records] == [peer.signer.peer_id]


def test_a_record_expiring_in_ten_years_is_ignored(swarm):
    peer, attacker = swarm
    run_id = "c" * 32
    _honest_record(peer, run_id)
    assert attacker.store(
        keys.progress_key(run_id),
        dataclasses.replace(HONEST, round=9).to_wire(),
        subkey="fake",
        ttl_s=10 * 365 * 86400.0,
    )
    records = swarm_dht.read_progress(peer, run_id, timeout_s=20)
    assert [r.peer_id for r in records] == [peer.signer.peer_id]


def test_a_plain_value_over_the_progress_key_reads_as_no_records(swarm):
    peer, attacker = swarm
    run_id = "d" * 32
    _honest_record(peer, run_id)
    # this node does not protect run d's keys (it trains no run): the plain value replaces the records
    assert attacker.store(keys.progress_key(run_id), "not a dict of records", ttl_s=120)
    assert swarm_dht.read_progress(peer, run_id, timeout_s=20) == []


def test_garbage_under_the_runs_key_neither_hangs_nor_crashes(swarm):
    peer, attacker = swarm
    manifest = RunManifest(name="garbage-test")
    attacker.store_raw(keys.RUNS_KEY, NOT_MSGPACK, subkey="f" * 32)  # refused by the node's validator
    assert "f" * 32 not in swarm_dht.list_runs(peer, timeout_s=20)
    with pytest.raises((ManifestError, ManifestNotFound)):
        swarm_dht.fetch_manifest(peer, manifest.run_id, timeout_s=20)


def test_garbage_address_records_are_skipped(swarm):
    peer, attacker = swarm
    run_id = "e" * 32
    mine = [str(m) for m in peer.get_visible_maddrs()]
    assert addresses.publish_addresses(peer, run_id, peer.signer, mine)
    assert attacker.store_raw(addresses.addresses_key(run_id), NOT_MSGPACK, subkey="fake")
    assert addresses.read_addresses(peer, run_id) == {str(peer.peer_id): mine}
