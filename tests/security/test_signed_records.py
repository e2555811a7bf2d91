"""Issue 17, item 2: records are bound to their peer. A progress record stored under another peer's
id, unsigned, wrongly signed, or replayed with a longer life is ignored (and counted), and the
node of a run refuses to store it, so the real record stays readable.

Before: one real and four fake records, or overwriting the honest peers' own records, made every
honest peer adopt the attacker's state.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from hivemind.utils import get_dht_time

from peer.net import dht as swarm_dht
from peer.net.identity import ensure_identity
from peer.net.validator import protect_run
from protocol import keys
from protocol.records import ProgressRecord
from protocol.signing import REJECTED, PeerSigner
from tests.security.dht_attacker import victim_and_attacker
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(90)

HONEST = ProgressRecord(
    round=3, inner_step=30, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10, state_digest="a" * 32
)
FAKE = dataclasses.replace(HONEST, round=99, inner_step=990, state_digest="0" * 32)
"""What the attacker wants the swarm to believe: a state far ahead that everyone should adopt."""


@pytest.fixture(scope="module")
def signers(tmp_path_factory):
    base = tmp_path_factory.mktemp("ids")
    return [PeerSigner.from_identity(ensure_identity(base / f"{name}.key")) for name in ("honest", "attacker")]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, signers):
    with victim_and_attacker(ensure_identity(tmp_path_factory.mktemp("ids") / "honest.key")) as both:
        yield both


def _forgeries(key: str, victim: PeerSigner, attacker: PeerSigner) -> list[tuple[object, float]]:
    """(value, expiration) an attacker can make for ``victim``'s subkey without ``victim``'s key."""
    expiration = get_dht_time() + 3600
    sealed_by_attacker = attacker.seal(key, expiration, FAKE.to_wire())
    honest_now = victim.seal(key, expiration, HONEST.to_wire())
    tampered = dict(honest_now, b=victim.seal(key, expiration, FAKE.to_wire())["b"])
    return [
        (FAKE.to_wire(), expiration),  # an unsigned record, as before
        (sealed_by_attacker, expiration),  # signed, but by another peer than the subkey names
        ({**sealed_by_attacker, "k": victim.public_der}, expiration),  # the victim's key, the attacker's signature
        (tampered, expiration),  # the victim's signature over another body
        (honest_now, expiration + 7 * 86400),  # the victim's own record replayed to live a week longer
    ]


def test_a_forged_record_of_another_peer_is_refused_and_the_real_one_stays(swarm, signers):
    peer, attacker = swarm
    honest, evil = signers
    run_id = "1" * 32
    protect_run(peer, run_id)
    key = keys.progress_key(run_id)
    assert swarm_dht.publish_progress(peer, run_id, honest, HONEST, ttl_s=600)
    for value, expiration in _forgeries(key, honest, evil):
        assert not attacker.store(key, value, subkey=honest.peer_id, expiration=expiration)
    assert not attacker.store(key, "a plain value over every record", ttl_s=600)
    records = swarm_dht.read_progress(peer, run_id, timeout_s=20)
    assert [(r.peer_id, r.record) for r in records] == [(honest.peer_id, HONEST)]


def test_a_reader_ignores_and_counts_forged_records_a_careless_node_serves(signers):
    honest, evil = signers
    run_id = "2" * 32
    key = keys.progress_key(run_id)
    for value, expiration in _forgeries(key, honest, evil):
        dht = FakeDHT()  # stores whatever it is given, as a stock node does: the forgery replaced the record
        swarm_dht.publish_progress(dht, run_id, honest, HONEST, ttl_s=600)
        dht.store(key, value, expiration, subkey=honest.peer_id)
        before = REJECTED.counts["progress"]
        assert swarm_dht.read_progress(dht, run_id) == []  # before: the fake record, round 99
        assert REJECTED.counts["progress"] == before + 1


def test_a_wrongly_signed_record_is_ignored_counted_and_logged_once(signers, caplog):
    honest, evil = signers
    run_id = "3" * 32
    key = keys.progress_key(run_id)
    dht = FakeDHT()
    swarm_dht.publish_progress(dht, run_id, honest, HONEST, ttl_s=600)
    expiration = get_dht_time() + 600
    bad = evil.seal(key, expiration, FAKE.to_wire())
    bad["s"] = bytes(len(bad["s"]))  # its own record, with a signature that does not verify
    dht.store(key, bad, expiration, subkey=evil.peer_id)
    before = REJECTED.counts["progress"]
    with caplog.at_level(logging.WARNING, logger="protocol.signing"):
        for _ in range(3):
            records = swarm_dht.read_progress(dht, run_id)
            assert [(r.peer_id, r.record) for r in records] == [(honest.peer_id, HONEST)]
    assert REJECTED.counts["progress"] == before + 3
    warnings = [r.getMessage() for r in caplog.records if evil.peer_id in r.getMessage()]
    assert len(warnings) == 1 and "does not verify" in warnings[0], warnings


def test_a_forged_device_record_is_refused_by_a_node_of_the_run(swarm, signers):
    from peer.net.devices import DeviceRecord, devices_key, publish_device, read_devices

    peer, attacker = swarm
    honest, evil = signers
    run_id = "5" * 32
    protect_run(peer, run_id)
    real = DeviceRecord(kind="cpu", name="x86_64", memory_gib=None, capability=None, precision="fp32")
    assert publish_device(peer, run_id, honest, real)
    key, expiration = devices_key(run_id), get_dht_time() + 3600
    claim = dict(real.to_wire(), kind="cuda", name="8x H100", memory_gib=80.0, capability="9.0", precision="bf16")
    assert not attacker.store(key, evil.seal(key, expiration, claim), subkey=honest.peer_id, expiration=expiration)
    assert not attacker.store(key, claim, subkey=honest.peer_id, expiration=expiration)
    assert read_devices(peer, run_id) == {honest.peer_id: real}
