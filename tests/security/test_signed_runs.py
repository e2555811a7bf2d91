"""Issue 17, item 1: a run has an owner. An announcement that is unsigned, or signed by another key
than the one its run id binds, can neither replace the real run nor block a plain `peer join`.

Two DHTs: a real hivemind node as `peer join` starts it (with its record validator) and a stock
hivemind node that asks it to store whatever it likes; and an in-memory DHT that stores anything
(tests/security/fake_dht.py), for what a reader makes of values a careless node would serve.
"""

from __future__ import annotations

import types

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from peer import node
from peer.net import dht as swarm_dht
from peer.net.home_run import HomeRunAnnouncer
from protocol import keys
from protocol.errors import ManifestNotFound
from protocol.manifest import RunManifest, sign_manifest
from protocol.presets import PRESETS
from protocol.signing import REJECTED, OwnerKey, PeerSigner
from tests.security.dht_attacker import victim_and_attacker
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(90)

OWNER, ATTACKER = OwnerKey.generate(), OwnerKey.generate()
HONEST = sign_manifest(PRESETS["tiny"](), OWNER)
DAY_S = 86400.0


def _join(dht, tmp_path, *, run_id=None, local=None, new_run=False, initial_peers=()):
    """What `peer join --initial-peers ...` decides (peer/node.py), with no wait for announcements."""
    cfg = types.SimpleNamespace(
        initial_peers=initial_peers,
        new_run=local,
        manifest_wait_s=0.0,
        run_flag="--preset tiny",
        run_id=run_id,
        start_new_run=new_run,
        data_dir=tmp_path / "data",
        owner_key_path=None,
    )
    reporter = types.SimpleNamespace(emit=lambda *args, **fields: None)
    return node._find_run(dht, cfg, reporter)


def _unsigned_announcements(dht, store) -> RunManifest:
    """What an attacker announces without the owner's key: the old unsigned formats, a manifest naming
    no owner, one naming the honest owner with a made-up signature, garbage. Returns its run."""
    theirs = RunManifest(name="tiny-but-bigger")
    store(keys.RUNS_KEY, theirs.name, subkey=theirs.run_id)  # the runs index before owners
    store(keys.RUNS_KEY, {"m": theirs.encode(), "s": b"\0" * 64}, subkey=theirs.run_id)  # names no owner
    forged = theirs.with_owner(OWNER.public_hex)
    store(keys.RUNS_KEY, {"m": forged.encode(), "s": b"\1" * 64}, subkey=forged.run_id)  # not the owner's signature
    store(keys.RUNS_KEY, b"\xc1\xc1", subkey="e" * 32)
    return theirs


@pytest.fixture(scope="module")
def swarm():
    with victim_and_attacker() as both:
        yield both


def test_unsigned_announcements_do_not_block_a_plain_join_nor_reach_a_node(swarm, tmp_path):
    peer, attacker = swarm
    assert swarm_dht.store_manifest(peer, HONEST)
    refused = []
    _unsigned_announcements(peer, lambda key, value, subkey: refused.append(attacker.store(key, value, subkey=subkey)))
    assert refused == [False] * 4  # the node's validator stores none of them
    assert swarm_dht.list_runs(peer, timeout_s=20) == {HONEST.run_id: HONEST.manifest.name}
    assert _join(peer, tmp_path) == HONEST  # before owners: "the swarm announces several runs", exit 64


def test_a_forged_announcement_under_the_real_run_id_cannot_replace_it(swarm, tmp_path):
    peer, attacker = swarm
    assert swarm_dht.store_manifest(peer, HONEST)
    # the attacker's own run, validly signed by the attacker, stored under the honest run id to live longer
    theirs = sign_manifest(RunManifest(name=HONEST.manifest.name), ATTACKER)
    assert not attacker.store(keys.RUNS_KEY, theirs.to_wire(), subkey=HONEST.run_id, ttl_s=7 * DAY_S)
    # the honest owner's manifest, with another owner spliced in
    spliced = {"m": HONEST.manifest.with_owner(ATTACKER.public_hex).encode(), "s": HONEST.signature}
    assert not attacker.store(keys.RUNS_KEY, spliced, subkey=HONEST.run_id, ttl_s=7 * DAY_S)
    assert not attacker.store(keys.RUNS_KEY, "garbage", subkey=HONEST.run_id, ttl_s=7 * DAY_S)
    assert swarm_dht.fetch_signed(peer, HONEST.run_id, timeout_s=20) == HONEST
    assert _join(peer, tmp_path, run_id=HONEST.run_id) == HONEST


def test_a_reader_ignores_and_counts_what_a_careless_node_stored(tmp_path):
    dht = FakeDHT()  # stores whatever it is given, as a stock node does
    swarm_dht.store_manifest(dht, HONEST)
    before = REJECTED.counts["manifest"]
    _unsigned_announcements(dht, lambda key, value, subkey: dht.store(key, value, subkey=subkey))
    assert swarm_dht.list_runs(dht) == {HONEST.run_id: HONEST.manifest.name}
    assert REJECTED.counts["manifest"] - before == 3  # the name-only entry was overwritten by the second
    assert _join(dht, tmp_path) == HONEST
    # the real announcement overwritten by a forged one (a node without our validator): not replaced
    dht.store(
        keys.RUNS_KEY,
        {"m": HONEST.manifest.with_owner(ATTACKER.public_hex).encode(), "s": HONEST.signature},
        subkey=HONEST.run_id,
    )
    with pytest.raises(ManifestNotFound, match="signed by its owner"):
        swarm_dht.fetch_signed(dht, HONEST.run_id)


def test_a_joiner_follows_the_run_id_it_was_given_not_the_newest_announcement(tmp_path):
    dht = FakeDHT()
    swarm_dht.store_manifest(dht, HONEST)
    # a validly signed copy of the same run by another owner: another run id, the same content
    copy = sign_manifest(HONEST.manifest.with_owner(""), ATTACKER)
    assert copy.run_id != HONEST.run_id and copy.manifest.same_content(HONEST.manifest)
    swarm_dht.store_manifest(dht, copy, ttl_s=3000.0)
    assert _join(dht, tmp_path, run_id=HONEST.run_id) == HONEST
    # a plain join or a --preset join never exits for a stranger's copy (issue #51 item 5): it takes the
    # run the bootstrap node it dialed announces as its own, signed by that node (tests/security/test_sybil_runs.py)
    bootstrap = PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=1024))
    HomeRunAnnouncer(dht, bootstrap, HONEST.run_id).tick()
    dialed = (f"/ip4/127.0.0.1/tcp/1/p2p/{bootstrap.peer_id}",)
    assert _join(dht, tmp_path, initial_peers=dialed) == HONEST
    assert _join(dht, tmp_path, local=PRESETS["tiny"](), initial_peers=dialed) == HONEST
    assert _join(dht, tmp_path, local=PRESETS["tiny"](), run_id=HONEST.run_id) == HONEST
