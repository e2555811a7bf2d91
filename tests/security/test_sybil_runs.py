"""Issue #51, item 5: owner keys cost nothing, so an attacker announces as many validly signed runs
as it likes. Once a few of them made a plain ``peer join`` exit 64 ("choose --run-id"), and 3,000
made a joiner with ``--run-id`` exit 69 (the read of the whole runs index overran its deadline).

Real DHT nodes on 127.0.0.1: the bootstrap node (an honest node of ours with a persistent identity)
announces the honest run and, signed by its identity, that run as its own (peer/net/home_run.py); a
stock hivemind node announces STRANGER_RUNS runs, each signed by a fresh owner key.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from peer import node
from peer.net import dht as swarm_dht, home_run
from peer.net.identity import ensure_identity
from peer.run_choice import MAX_WEIGHED_RUNS
from protocol import keys
from protocol.manifest import RunManifest, sign_manifest
from protocol.presets import PRESETS
from protocol.records import ProgressRecord
from protocol.signing import OwnerKey, PeerSigner
from tests.security.dht_attacker import _store_many, victim_and_attacker
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(240)

HONEST = sign_manifest(PRESETS["tiny"](), OwnerKey.generate())
STRANGER_RUNS = 120
RECORD = ProgressRecord(
    round=2, inner_step=20, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10, state_digest="a" * 32
)


def _join(dht, tmp_path, *, run_id=None, initial_peers=()):
    """What `peer join --initial-peers ...` decides (peer/node.py), with no wait for announcements."""
    cfg = types.SimpleNamespace(
        initial_peers=initial_peers,
        new_run=None,
        manifest_wait_s=0.0,
        run_flag="--preset tiny",
        run_id=run_id,
        start_new_run=False,
        data_dir=tmp_path / "data",
        owner_key_path=None,
    )
    return node._find_run(dht, cfg, types.SimpleNamespace(emit=lambda *args, **fields: None))


def _strangers() -> list:
    """STRANGER_RUNS runs, each validly signed by an owner key of its own; two copy the honest content."""
    runs = [sign_manifest(RunManifest(name=f"stranger-{i}"), OwnerKey.generate()) for i in range(STRANGER_RUNS - 2)]
    runs += [sign_manifest(HONEST.manifest.with_owner(""), OwnerKey.generate()) for _ in range(2)]
    return runs


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """The bootstrap node (home run announced), the attacker, and the bootstrap's multiaddr."""
    identity = ensure_identity(tmp_path_factory.mktemp("boot") / "identity.key")
    with victim_and_attacker(identity) as (peer, attacker):
        assert swarm_dht.store_manifest(peer, HONEST)
        home_run.HomeRunAnnouncer(peer, PeerSigner.from_identity(identity), HONEST.run_id).tick()
        runs = _strangers()
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + 3600
        for i in range(0, len(runs), 5):  # hivemind's pipe to its DHT process refuses big messages
            part = runs[i : i + 5]
            attacker.dht.run_coroutine(
                functools.partial(
                    _store_many,
                    key=keys.RUNS_KEY,
                    values=[r.to_wire() for r in part],
                    subkeys=[r.run_id for r in part],
                    expirations=[expiration] * len(part),
                    chunk=5,
                )
            )
        assert len(swarm_dht.read_entries(peer, keys.RUNS_KEY, cap=10**6, signed=False)) == 1 + STRANGER_RUNS
        yield peer, attacker, swarm_dht.visible_maddrs(peer)[0], identity


@pytest.fixture()
def verified(monkeypatch):
    """Run ids whose announcement this process verified."""
    calls: list[str] = []
    real = swarm_dht.open_announcement

    def counting(value, *, expected_run_id):
        calls.append(expected_run_id)
        return real(value, expected_run_id=expected_run_id)

    monkeypatch.setattr(swarm_dht, "open_announcement", counting)
    return calls


def test_a_plain_join_takes_the_run_its_bootstrap_node_announces(swarm, tmp_path, verified):
    peer, _, maddr, _ = swarm
    assert home_run.read_home_run(peer, home_run.bootstrap_ids([maddr])) == HONEST.run_id
    assert _join(peer, tmp_path, initial_peers=(maddr,)) == HONEST  # once: exit 64, "choose --run-id"
    assert len(set(verified)) <= swarm_dht.MAX_RUNS_READ < STRANGER_RUNS  # the index read is capped
    assert HONEST.run_id in verified  # the home run is read first


def test_run_id_reads_that_runs_entry_alone(swarm, tmp_path, verified):
    peer, _, _, _ = swarm
    assert _join(peer, tmp_path, run_id=HONEST.run_id) == HONEST  # once: exit 69 at 3,000 runs
    assert set(verified) == {HONEST.run_id}
    verified.clear()
    assert swarm_dht.fetch_signed(peer, HONEST.run_id) == HONEST
    assert verified == [HONEST.run_id]


def test_without_a_home_run_a_plain_join_takes_the_run_with_vouched_live_peers(tmp_path):
    # a bootstrap node of another version (no home run): the joiner weighs the runs it read, at most
    # MAX_WEIGHED_RUNS of them (peer/run_choice.py); here the attacker announced fewer than that
    dht = FakeDHT()
    swarm_dht.store_manifest(dht, HONEST)
    for stranger in _strangers()[: MAX_WEIGHED_RUNS - 2]:
        swarm_dht.store_manifest(dht, stranger)
    a, b, lone = (PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=1024)) for _ in range(3))
    for signer, mate in ((a, b), (b, a)):  # two peers that synced with each other
        record = dataclasses.replace(RECORD, groupmates=(mate.peer_id,))
        swarm_dht.publish_progress(dht, HONEST.run_id, signer, record, 600.0, wait=False)
    stranger = min(set(swarm_dht.list_announced(dht)) - {HONEST.run_id})  # a tie's pick: one peer, vouched by none
    swarm_dht.publish_progress(dht, stranger, lone, RECORD, 600.0, wait=False)
    assert _join(dht, tmp_path, initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/QmNotABootstrapNodeOfThisSwarm",)) == HONEST


def test_a_forged_home_run_is_refused_by_our_nodes_and_ignored_by_readers(swarm):
    peer, attacker, maddr, identity = swarm
    [bootstrap_id] = home_run.bootstrap_ids([maddr])
    liar = PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=1024))
    theirs = _strangers()[0].run_id
    from hivemind.utils import get_dht_time

    expiration = get_dht_time() + 3600
    forged = liar.seal(keys.HOME_KEY, expiration, {"run_id": theirs})
    assert not attacker.store(keys.HOME_KEY, forged, subkey=bootstrap_id, expiration=expiration)
    assert not attacker.store(keys.HOME_KEY, {"run_id": theirs}, expiration=expiration)  # a plain value over it
    assert home_run.read_home_run(peer, [bootstrap_id]) == HONEST.run_id
    careless = FakeDHT()  # a node that stores anything
    careless.store(keys.HOME_KEY, forged, expiration, subkey=bootstrap_id)
    assert home_run.read_home_run(careless, [bootstrap_id]) is None
