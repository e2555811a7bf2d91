"""Signatures on what run owners and peers write to the DHT (issue 17, items 1 and 2).

Two kinds of keys sign:

* A run's **owner key** (Ed25519, ``cryptography``) signs the run manifest. The manifest names its
  owner (``owner``: the raw 32-byte public key in hex), and the run id is the hash of the
  manifest's canonical encoding (protocol/manifest.py), so the run id binds the key: no other key
  can sign a manifest with that run id. The key file is PKCS#8 PEM, created with mode 0600
  (:func:`load_owner_key`).
* A peer's **identity key** (the libp2p RSA key of peer/net/identity.py, which fixes its peer id)
  signs its records (progress, addresses) and, as an owner of all-reduce pieces, the digest of
  the means it sent in a group (:func:`seal_means`: what makes equivocation provable). A signed record carries the signer's public key; its
  peer id is the multihash of that key (libp2p's rule), so a reader checks that the subkey the
  record is stored under is the signer's peer id, then the signature (:func:`open_record`).

Every signed message is domain-separated (``b"locoswarm/1\\0" + kind + b"\\0" + ...``). A record's
signature also covers its DHT key, subkey and expiration time: a record cannot be moved to another
run or peer, nor stored again with a longer lifetime (which in hivemind's storage would pin it
over the peer's later records). Envelopes are msgpack maps of bytes; nothing here unpickles.

A value that fails verification is ignored where it is read, counted in :data:`REJECTED` (by
kind) and logged once per (kind, writer) at warning level.

About 450 lines: every signed format of the protocol (owner keys, record envelopes, means seals) and
the rejection counter sit in one file, so the whole trust boundary is reviewed in one place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

from protocol.errors import BadSignature, ConfigError

logger = logging.getLogger(__name__)

OWNER_KEY_FILE = "owner.key"
"""Name of the owner key file in a peer's data dir (and beside a bootstrap node's identity)."""

OWNER_HEX_CHARS = 64
"""An owner is named by its raw Ed25519 public key: 32 bytes, 64 hex characters."""

MAX_BODY_BYTES = 1 << 16
"""A signed record's body is at most this long (a progress record is about 200 bytes)."""
MAX_KEY_BYTES = 1024
"""A record signer's public key (DER SubjectPublicKeyInfo; RSA-2048: 294 bytes) is at most this long."""
MAX_SIGNATURE_BYTES = 1024

_DOMAIN = b"locoswarm/1\0"
_RSA_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


# ---------------------------------------------------------------- owner keys (Ed25519)


@dataclass(frozen=True)
class OwnerKey:
    """A run owner's Ed25519 key pair."""

    private: ed25519.Ed25519PrivateKey
    path: Path | None = None

    @property
    def public_hex(self) -> str:
        """The public key as a manifest's ``owner`` field: 64 lowercase hex characters."""
        raw = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return raw.hex()

    def sign_manifest(self, payload: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of a manifest's canonical encoding ``payload``."""
        return self.private.sign(manifest_message(payload))

    @classmethod
    def generate(cls) -> OwnerKey:
        """A new key held in memory only (tests, simulations)."""
        return cls(ed25519.Ed25519PrivateKey.generate())


def manifest_message(payload: bytes) -> bytes:
    """What an owner signs for a manifest whose canonical encoding is ``payload``."""
    return _DOMAIN + b"manifest\0" + payload


def verify_manifest(owner_hex: str, payload: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``owner_hex``'s Ed25519 signature of the manifest ``payload``.

    Never raises: a malformed owner or signature is simply not valid.
    """
    if not (
        isinstance(owner_hex, str)
        and is_owner_hex(owner_hex)
        and isinstance(signature, bytes)
        and isinstance(payload, bytes)
        and len(signature) == 64
    ):
        return False
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(owner_hex)).verify(
            signature, manifest_message(payload)
        )
    except (InvalidSignature, ValueError):
        return False
    return True


def is_owner_hex(text: str) -> bool:
    return len(text) == OWNER_HEX_CHARS and all(c in "0123456789abcdef" for c in text)


def load_owner_key(path: str | Path, *, create: bool = True) -> OwnerKey:
    """Read the owner key at ``path``, creating it (mode 0600, atomically) if absent and ``create``.

    Args:
        path: PKCS#8 PEM file of an Ed25519 private key, unencrypted.
        create: make a new key when the file does not exist.

    Returns:
        The key; ``path`` is left as it was when it existed.

    Raises:
        ConfigError: the file is unreadable or not an Ed25519 private key, it is absent and
            ``create`` is False, or its directory cannot be created. Nothing is written then.
    """
    path = Path(path).expanduser()
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"owner key file {path} is not an unencrypted Ed25519 private key (PEM): {exc}; "
                "pass --owner-key with the run owner's key file"
            ) from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(
                f"owner key file {path} holds a {type(key).__name__}, not an Ed25519 key; "
                "pass --owner-key with the run owner's key file"
            )
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("owner key file %s has mode %o; others can read it (chmod 600)", path, mode)
        return OwnerKey(key, path)
    if not create:
        raise ConfigError(f"owner key file {path} does not exist; pass --owner-key with the run owner's key file")
    created = save_owner_key(OwnerKey.generate(), path)
    logger.info("created new owner key %s", path)
    return created


def save_owner_key(key: OwnerKey, path: str | Path) -> OwnerKey:
    """Write ``key`` to ``path`` (PKCS#8 PEM, mode 0600, atomically: a crash leaves no half key).

    Returns:
        The key, with its ``path``.

    Raises:
        ConfigError: the directory cannot be created or the file cannot be written; nothing is left.
    """
    path = Path(path).expanduser()
    pem = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write owner key file {path}: {exc.strerror}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return OwnerKey(key.private, path)


# ---------------------------------------------------------------- peer records (libp2p identity)

_LIBP2P_RSA = 0
"""libp2p's ``KeyType.RSA`` (crypto.proto)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _libp2p_key(key_type: int, data: bytes) -> bytes:
    """libp2p's ``PublicKey``/``PrivateKey`` protobuf (proto2, both fields required):
    ``key_type = 1`` (varint), ``data = 2`` (bytes), the bytes protobuf itself writes for them."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def _parse_libp2p_key(blob: bytes) -> tuple[int, bytes]:
    """``(key_type, data)`` of a libp2p ``PrivateKey``/``PublicKey`` protobuf (what p2pd reads with
    ``-id``); fields of other numbers are skipped, as protobuf does.

    Raises:
        ValueError: malformed, or a required field missing.
    """

    def varint(at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if at >= len(blob) or shift > 63:
                raise ValueError("truncated or overlong varint")
            byte = blob[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if not byte & 0x80:
                return value, at

    key_type = data = None
    at = 0
    while at < len(blob):
        tag, at = varint(at)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = varint(at)
            if field == 1:
                key_type = value
        elif wire == 2:
            length, at = varint(at)
            if at + length > len(blob):
                raise ValueError("truncated length-delimited field")
            if field == 2:
                data = blob[at : at + length]
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            if at > len(blob):
                raise ValueError("truncated fixed-size field")
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if field == 0:
            raise ValueError("field number 0")
    if key_type is None or data is None:
        raise ValueError("not a libp2p key: key_type or data missing")
    return key_type, data


def peer_id_of(public_der: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in DER SubjectPublicKeyInfo form.

    Raises:
        BadSignature: ``public_der`` is not bytes of at most :data:`MAX_KEY_BYTES`.
    """
    import base58
    import multihash

    if not isinstance(public_der, bytes) or not 0 < len(public_der) <= MAX_KEY_BYTES:
        raise BadSignature("a record's public key must be 1 to 1024 bytes")
    encoded = _libp2p_key(_LIBP2P_RSA, public_der)
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def record_message(key: str, subkey: str, expiration: float, body: bytes) -> bytes:
    """What a peer signs for ``body`` stored under DHT ``key``/``subkey`` until ``expiration``."""
    return (
        _DOMAIN
        + b"record\0"
        + key.encode()
        + b"\0"
        + subkey.encode()
        + b"\0"
        + struct.pack(">d", float(expiration))
        + body
    )


class PeerSigner:
    """Signs this peer's DHT records with its libp2p identity key.

    Args:
        private: the RSA private key of the identity file that fixes this peer's id.
    """

    def __init__(self, private: rsa.RSAPrivateKey):
        self._private = private
        self.public_der = private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.peer_id = peer_id_of(self.public_der)

    @classmethod
    def from_identity(cls, path: str | Path) -> PeerSigner:
        """The signer of the identity file at ``path`` (peer/net/identity.py ``ensure_identity``).

        Raises:
            ConfigError: the file is unreadable or not a libp2p RSA private key.
        """
        path = Path(path).expanduser()
        try:
            _, data = _parse_libp2p_key(path.read_bytes())
            private = serialization.load_der_private_key(data, password=None)
        except Exception as exc:  # protobuf and cryptography raise several unrelated types
            raise ConfigError(
                f"identity file {path} is not a libp2p private key ({exc}); move it away to create a new identity"
            ) from exc
        if not isinstance(private, rsa.RSAPrivateKey):
            raise ConfigError(
                f"identity file {path} holds a {type(private).__name__}, not an RSA key; "
                "move it away to create a new identity"
            )
        return cls(private)

    def sign(self, message: bytes) -> bytes:
        """RSA-PSS (SHA-256) signature of ``message``, a domain-separated message of this module."""
        return self._private.sign(message, _RSA_PADDING, hashes.SHA256())

    def seal(self, key: str, expiration: float, value: Any) -> dict[str, bytes]:
        """The envelope to store under ``key`` with subkey :attr:`peer_id` until ``expiration``.

        Args:
            value: msgpack-able data (the record).

        Returns:
            ``{"b": body (msgpack of value), "k": public key (DER), "s": RSA-PSS signature}``.
        """
        body = msgpack.packb(value, use_bin_type=True)
        signature = self.sign(record_message(key, self.peer_id, expiration, body))
        return {"b": body, "k": self.public_der, "s": signature}


def open_record(key: str, subkey: Any, expiration: float, value: Any) -> Any:
    """Check a signed record read from (or offered to) the DHT and return what it carries.

    Args:
        key: the DHT key it is stored under; subkey: its subkey (the writer's peer id);
        expiration: its expiration time (DHT time, s); value: the stored value (decoded msgpack).

    Returns:
        The record's data (decoded msgpack of the body).

    Raises:
        BadSignature: not an envelope, a subkey that is not the signer's peer id, or a signature
            that does not verify.
    """
    if not isinstance(value, dict) or set(value) != {"b", "k", "s"}:
        raise BadSignature("not a signed record (expected a map of b, k, s)")
    body, public_der, signature = value["b"], value["k"], value["s"]
    if not (
        isinstance(body, bytes)
        and len(body) <= MAX_BODY_BYTES
        and isinstance(signature, bytes)
        and len(signature) <= MAX_SIGNATURE_BYTES
    ):
        raise BadSignature("a signed record's body or signature is not bytes of the allowed size")
    if not isinstance(subkey, str) or peer_id_of(public_der) != subkey:
        raise BadSignature("the record is stored under another peer's id than its signer's")
    try:
        public = serialization.load_der_public_key(public_der)
    except (ValueError, TypeError) as exc:
        raise BadSignature(f"a record's public key is not a DER public key: {exc}") from exc
    if not isinstance(public, rsa.RSAPublicKey) or not isinstance(expiration, (int, float)):
        raise BadSignature("a record's public key is not an RSA key")
    try:
        public.verify(signature, record_message(key, subkey, expiration, body), _RSA_PADDING, hashes.SHA256())
    except InvalidSignature as exc:
        raise BadSignature("the record's signature does not verify") from exc
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadSignature(f"a signed record's body is not msgpack: {exc}") from exc


# ---------------------------------------------------------------- an owner's means (all-reduce seals)


def means_message(group_id: bytes, owner: str, digest: bytes) -> bytes:
    """What an owner of all-reduce pieces signs: the BLAKE2b digest of every MEAN frame payload it
    sent in group ``group_id``, in piece order (peer/sync/receipts.py ``MeanDigests``). One message
    per owner and group: two valid signatures of two digests for one ``(group_id, owner)`` prove
    that the owner sent different means to different receivers."""
    return _DOMAIN + b"means\0" + bytes(group_id) + b"\0" + owner.encode() + b"\0" + bytes(digest)


def seal_means(signer: PeerSigner, group_id: bytes, digest: bytes) -> bytes:
    """``signer``'s RSA-PSS signature of :func:`means_message` for its own peer id (256 bytes for
    RSA-2048); about a millisecond of CPU."""
    return signer.sign(means_message(group_id, signer.peer_id, digest))


def verify_means(public_der: bytes, owner: str, group_id: bytes, digest: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``owner``'s signature of ``digest`` for ``group_id``: ``public_der``
    (DER SubjectPublicKeyInfo) must be the RSA key whose libp2p peer id is ``owner``.

    Never raises: a malformed key or signature is simply not valid.
    """
    if not (isinstance(signature, bytes) and 0 < len(signature) <= MAX_SIGNATURE_BYTES):
        return False
    try:
        if peer_id_of(public_der) != owner:
            return False
        public = serialization.load_der_public_key(public_der)
        if not isinstance(public, rsa.RSAPublicKey):
            return False
        public.verify(signature, means_message(group_id, owner, digest), _RSA_PADDING, hashes.SHA256())
    except (BadSignature, InvalidSignature, ValueError, TypeError):
        return False
    return True


# ---------------------------------------------------------------- what was rejected


class Rejections:
    """Counts values ignored for a bad signature (by kind); logs each (kind, writer) once."""

    MAX_LOGGED = 10_000
    """Writers remembered for log-once; past this, further rejections are counted but not logged."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def note(self, kind: str, writer: str, reason: object) -> None:
        """Count one rejected ``kind`` value written by ``writer`` (a subkey, already printable)."""
        with self._lock:
            self.counts[kind] += 1
            first = (kind, writer) not in self._logged and len(self._logged) < self.MAX_LOGGED
            if first:
                self._logged.add((kind, writer))
        if first:
            logger.warning(
                "ignoring a %s value under %r: %s (further ones from it are counted, not logged)",
                kind,
                writer[:64],
                reason,
            )

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


REJECTED = Rejections()
"""Values this process ignored for a bad or missing signature, by kind ("manifest", "progress", ...)."""
