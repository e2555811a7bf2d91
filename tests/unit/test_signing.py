"""protocol/signing.py and the signed manifest (protocol/manifest.py): owner keys, record envelopes."""

from __future__ import annotations

import logging
import stat

import msgpack
import pytest

from peer.net.identity import ensure_identity
from protocol.errors import BadSignature, ConfigError, ManifestError
from protocol.manifest import RunManifest, dump_toml, load_manifest, open_announcement, sign_manifest
from protocol.signing import OwnerKey, PeerSigner, Rejections, load_owner_key, open_record, peer_id_of, verify_manifest

KEY = "locoswarm_progress_" + "a" * 32


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return PeerSigner.from_identity(ensure_identity(tmp_path_factory.mktemp("id") / "identity.key"))


def test_an_owner_key_is_created_0600_and_read_back(tmp_path):
    path = tmp_path / "keys" / "owner.key"
    key = load_owner_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_owner_key(path).public_hex == key.public_hex
    assert len(key.public_hex) == 64 and int(key.public_hex, 16) >= 0


def test_an_unusable_owner_key_file_names_the_file_and_what_to_do(tmp_path):
    path = tmp_path / "owner.key"
    path.write_text("not a key")
    with pytest.raises(ConfigError) as info:
        load_owner_key(path)
    assert str(path) in str(info.value) and "--owner-key" in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_owner_key(tmp_path / "missing.key", create=False)
    assert not (tmp_path / "missing.key").exists()


def test_the_run_id_binds_the_owner_and_an_ownerless_run_id_is_unchanged():
    a, b = OwnerKey.generate(), OwnerKey.generate()
    draft = RunManifest(name="r")
    assert "owner" not in msgpack.unpackb(draft.encode())  # encodes as before owners existed
    mine, theirs = sign_manifest(draft, a), sign_manifest(draft, b)
    assert len({draft.run_id, mine.run_id, theirs.run_id}) == 3
    assert mine.manifest.same_content(theirs.manifest)
    assert sign_manifest(draft, a).run_id == mine.run_id  # deterministic


def test_an_announcement_verifies_only_with_its_owners_signature():
    a, b = OwnerKey.generate(), OwnerKey.generate()
    signed = sign_manifest(RunManifest(name="r"), a)
    assert open_announcement(signed.to_wire(), expected_run_id=signed.run_id) == signed
    payload = signed.manifest.encode()
    assert verify_manifest(a.public_hex, payload, signed.signature)
    assert not verify_manifest(b.public_hex, payload, signed.signature)
    cases = [
        {"m": payload, "s": b.sign_manifest(payload)},  # signed by another key than the owner it names
        {"m": payload, "s": signed.signature[:-1] + bytes([signed.signature[-1] ^ 1])},
        {"m": RunManifest(name="r").encode(), "s": b"\0" * 64},  # names no owner
        {"m": payload},
        "r",
    ]
    for value in cases:
        with pytest.raises(BadSignature):
            open_announcement(value, expected_run_id=None)
    with pytest.raises(ManifestError, match="hashes to run id"):
        open_announcement(signed.to_wire(), expected_run_id="0" * 32)


def test_a_manifest_owned_by_another_key_is_not_signed_and_the_message_says_what_to_do():
    a, b = OwnerKey.generate(), OwnerKey.generate()
    owned = RunManifest(name="r").with_owner(a.public_hex)
    with pytest.raises(ManifestError) as info:
        sign_manifest(owned, b)
    assert "--owner-key" in str(info.value) and a.public_hex in str(info.value)


def test_an_owned_manifest_round_trips_through_toml(tmp_path):
    owned = sign_manifest(RunManifest(name="r"), OwnerKey.generate()).manifest
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(owned))
    assert load_manifest(path) == owned and load_manifest(path).run_id == owned.run_id
    with pytest.raises(ManifestError, match="owner"):
        RunManifest(owner="not hex")


def test_a_record_opens_only_under_its_signers_id_key_and_expiration(signer, tmp_path):
    other = PeerSigner.from_identity(ensure_identity(tmp_path / "other.key"))
    envelope = signer.seal(KEY, 1000.5, {"round": 3})
    assert open_record(KEY, signer.peer_id, 1000.5, envelope) == {"round": 3}
    bad = [
        (KEY, other.peer_id, 1000.5, envelope),  # under another peer's id
        (KEY, signer.peer_id, 1001.5, envelope),  # with another expiration (a replay to live longer)
        ("locoswarm_progress_" + "b" * 32, signer.peer_id, 1000.5, envelope),  # moved to another run
        (KEY, signer.peer_id, 1000.5, {**envelope, "b": msgpack.packb({"round": 99})}),
        (KEY, signer.peer_id, 1000.5, {**envelope, "k": other.public_der}),
        (KEY, other.peer_id, 1000.5, {**envelope, "k": other.public_der}),
        (KEY, signer.peer_id, 1000.5, {"round": 3}),
        (KEY, signer.peer_id, 1000.5, {**envelope, "k": b"\0" * 4096}),
    ]
    for args in bad:
        with pytest.raises(BadSignature):
            open_record(*args)


def test_the_signers_peer_id_is_libp2ps(signer, tmp_path):
    from hivemind.p2p import PeerID

    path = ensure_identity(tmp_path / "id.key")
    assert PeerSigner.from_identity(path).peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id_of(signer.public_der) == signer.peer_id
    with pytest.raises(ConfigError, match="identity file"):
        (tmp_path / "bad.key").write_bytes(b"\xff" * 10)
        PeerSigner.from_identity(tmp_path / "bad.key")


def test_libp2p_key_protobuf_without_hivemind_matches_hiveminds(tmp_path):
    """protocol/signing.py writes and reads libp2p's key protobuf itself (protocol/ imports no hivemind)."""
    from hivemind.proto import crypto_pb2

    from protocol.signing import _libp2p_key, _parse_libp2p_key

    for n in (0, 1, 127, 128, 294, 1024, 20_000):
        data = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
        assert _libp2p_key(0, data) == crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=data).SerializeToString()
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=data).SerializeToString()
        assert _parse_libp2p_key(blob) == (0, data)
    blob = ensure_identity(tmp_path / "id.key").read_bytes()
    assert _parse_libp2p_key(blob) == (0, crypto_pb2.PrivateKey.FromString(blob).data)
    for bad in (b"", b"\xff" * 10, b"\x08\x00", b"\x12\x05ab"):
        with pytest.raises(ValueError):
            _parse_libp2p_key(bad)


def test_rejections_are_counted_each_time_and_logged_once_per_writer(caplog):
    rejected = Rejections()
    with caplog.at_level(logging.WARNING, logger="protocol.signing"):
        for _ in range(3):
            rejected.note("progress", "QmA", "bad signature")
        rejected.note("progress", "QmB", "bad signature")
        rejected.note("manifest", "QmA", "unsigned")
    assert rejected.counts == {"progress": 4, "manifest": 1} and rejected.total() == 5
    assert len(caplog.records) == 3
