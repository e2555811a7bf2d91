"""Issue 17: "20,000 fake records slowed sync from 0.2 s to 3-7 s and grew each peer by 470-560 MB".

Records are signed by their peer's identity, but identities are free, so signatures alone do not
bound a flood: a reader verified (RSA) and kept every entry under the run's records key. Now a read
verifies and keeps at most ``MAX_RECORDS_READ`` entries (peer/net/dht.py ``select_entries``): the
reader's own and known peers first, the others by a per-process keyed hash of the peer id, never
by the expiration (the writer's choice).

The flood is stored in tests/security/fake_dht.py's FakeDHT (it stores whatever it is given). Two
kinds of flooding records, because generating 20,000 RSA keys would take minutes here:

* 20,000 entries under distinct peer-id-shaped subkeys, all carrying ONE attacker key's envelope:
  they fail verification (the key is not their subkey's identity), which is what the old reader
  paid a full check for, 20,000 times; the new one drops them with a hash each;
* 300 distinct real identities (1024-bit RSA keys, quick to make), each with a valid record:
  the records that do pass every check, used with a smaller cap (monkeypatched) to check which
  ones a reader keeps.
"""

from __future__ import annotations

import dataclasses
import os

import base58
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils import get_dht_time

from peer.net import devices as swarm_devices, dht as swarm_dht, selection
from protocol import keys
from protocol.records import ProgressRecord
from protocol.signing import PeerSigner
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(300)

RUN = "cd" * 8
RECORD = ProgressRecord(
    round=3, inner_step=30, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10, state_digest="a" * 32
)
FAKE = dataclasses.replace(RECORD, round=99, state_digest="0" * 32)


def _signer() -> PeerSigner:
    return PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=1024))


@pytest.fixture(scope="module")
def identities():
    """``(me, friend, strangers)``: this reader, a peer it knows, 300 fresh identities."""
    return _signer(), _signer(), [_signer() for _ in range(300)]


def _publish(dht, key: str, signer: PeerSigner, record: ProgressRecord, ttl_s: float) -> None:
    expiration = get_dht_time() + ttl_s
    dht.store(key, signer.seal(key, expiration, record.to_wire()), expiration, subkey=signer.peer_id)


def _fake_peer_id() -> str:
    return base58.b58encode(b"\x12\x20" + os.urandom(32)).decode()


@pytest.fixture()
def flooded(identities):
    """A FakeDHT with: this reader's and its friend's records, 300 strangers' valid records (far
    later expirations than the honest ones), and 20,000 one-key forgeries."""
    me, friend, strangers = identities
    dht, key = FakeDHT(), keys.progress_key(RUN)
    for signer in (me, friend):
        _publish(dht, key, signer, RECORD, 60)
    for signer in strangers:
        _publish(dht, key, signer, FAKE, 3600)
    attacker = _signer()
    expiration = get_dht_time() + 3600
    envelope = attacker.seal(key, expiration, FAKE.to_wire())
    for _ in range(20_000):
        dht.store(key, envelope, expiration, subkey=_fake_peer_id())
    return dht


@pytest.fixture()
def verified(monkeypatch):
    """Counts signature checks made by peer/net/dht.py's readers (progress, addresses and devices
    all verify through ``read_signed``)."""
    calls = []

    def counting(module):
        real = module.open_record

        def open_record(*args, **kwargs):
            calls.append(args[1])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "open_record", open_record)

    counting(swarm_dht)
    return calls


def test_a_flood_costs_at_most_the_cap_in_signature_checks(flooded, identities, verified):
    me, friend, strangers = identities
    found = swarm_dht.read_progress(flooded, RUN, prefer={me.peer_id, friend.peer_id})
    assert len(verified) == selection.MAX_RECORDS_READ <= 500  # a few hundred (issue #51 item 5)
    assert len(found) == selection.MAX_RECORDS_READ
    ids = {p.peer_id for p in found}
    assert {me.peer_id, friend.peer_id} <= ids  # the preferred (vouched) peers first
    assert ids - {me.peer_id, friend.peer_id} <= {s.peer_id for s in strangers}  # no forgery takes a place


def test_the_cap_keeps_preferred_peers_whatever_the_expirations(flooded, identities, verified, monkeypatch):
    me, friend, strangers = identities
    monkeypatch.setattr(selection, "MAX_RECORDS_READ", 100)
    found = swarm_dht.read_progress(flooded, RUN, prefer={me.peer_id, friend.peer_id})
    assert len(found) == 100
    assert len(verified) == 100
    ids = [p.peer_id for p in found]
    assert me.peer_id in ids and friend.peer_id in ids
    # deterministic for this reader: the same read keeps the same peers
    assert [p.peer_id for p in swarm_dht.read_progress(flooded, RUN, prefer={me.peer_id, friend.peer_id})] == ids


def test_preferred_peers_leave_room_for_others(flooded, identities, monkeypatch):
    me, friend, strangers = identities
    monkeypatch.setattr(selection, "MAX_RECORDS_READ", 100)
    prefer = {s.peer_id for s in strangers[:200]}
    ids = {p.peer_id for p in swarm_dht.read_progress(flooded, RUN, prefer=prefer)}
    assert len(ids) == 100
    assert len(ids & prefer) == 50  # cap - cap // 2 preferred, cap // 2 for the others
    assert len(ids - prefer) == 50


def test_device_reads_are_capped_too(flooded, verified, monkeypatch):
    monkeypatch.setattr(selection, "MAX_RECORDS_READ", 100)
    flooded.stored[swarm_devices.devices_key(RUN)] = flooded.stored[keys.progress_key(RUN)]
    swarm_devices.read_devices(flooded, RUN)  # the records are not device records: none kept
    assert len(verified) <= 100


def test_select_entries_small_reads_untouched():
    entries = [("x", None, 1.0), ("y", None, 2.0)]
    assert swarm_dht.select_entries(entries, cap=2) is entries
