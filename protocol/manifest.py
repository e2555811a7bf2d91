"""The run manifest: everything peers must agree on to train one model together.

A manifest is a tree of small frozen dataclasses, one per section (defined in :mod:`protocol.specs`
and re-exported here). It is loaded from TOML (``load_manifest``), validated field by field in
``__post_init__`` (a :class:`ManifestError` names the field, the bad value and the allowed range),
encoded canonically with msgpack (``encode``: sorted keys, fixed types) and identified by the
SHA-256 of that encoding (``run_id``). Peers fetch the encoding from the DHT by run id and
recompute the hash, so a tampered manifest is never trained on.

A run has an owner: ``owner`` holds the owner's Ed25519 public key (hex) and is part of the
encoding, so the run id binds the key. The owner signs the encoding (:func:`sign_manifest`); what
is announced in the DHT is a :class:`SignedManifest`, and :func:`open_announcement` accepts one only
with the owner's valid signature. A manifest with no owner (a TOML file, a preset) is a run not
started yet: whoever starts it becomes its owner (``with_owner``). An ownerless manifest encodes as
before owners existed, so its run id did not change.

Slightly over 300 lines: the manifest's encoding, its run id and its signed announcement must
agree byte for byte, so they stay in one module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgpack

from protocol.errors import BadSignature, ManifestError, VersionMismatch
from protocol.signing import OwnerKey, is_owner_hex, verify_manifest
from protocol.specs import (
    CODECS,
    OMITTED_AT_DEFAULT_INNER_FIELDS,
    OMITTED_AT_DEFAULT_SYNC_FIELDS,
    OMITTED_AT_DEFAULT_TOKENIZER_FIELDS,
    PHI_CODECS,
    SHARD_FIELDS,
    CompressionSpec,
    DataSpec,
    InnerOptimizerSpec,
    ModelSpec,
    NoLoCoSpec,
    OuterOptimizerSpec,
    PipelineSpec,
    SyncSpec,
    check,
    int_in,
)
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "CODECS",
    "PHI_CODECS",
    "RUN_ID_HEX_CHARS",
    "CompressionSpec",
    "DataSpec",
    "InnerOptimizerSpec",
    "ModelSpec",
    "NoLoCoSpec",
    "OuterOptimizerSpec",
    "PipelineSpec",
    "RunManifest",
    "SignedManifest",
    "SyncSpec",
    "decode",
    "dump_toml",
    "from_dict",
    "load_manifest",
    "open_announcement",
    "sign_manifest",
]

RUN_ID_HEX_CHARS = 32
"""Run ids are the first 128 bits of the SHA-256 of the canonical encoding, in hex."""

_SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "data": DataSpec,
    "inner_optimizer": InnerOptimizerSpec,
    "outer_optimizer": OuterOptimizerSpec,
    "sync": SyncSpec,
    "noloco": NoLoCoSpec,
    "compression": CompressionSpec,
    "pipeline": PipelineSpec,
}


@dataclass(frozen=True, kw_only=True)
class RunManifest:
    """One training run. Identified by :attr:`run_id`, the hash of :meth:`encode`."""

    name: str = "default"
    protocol_version: int = PROTOCOL_VERSION
    owner: str = ""
    """The run owner's Ed25519 public key, 64 hex characters (protocol/signing.py); empty while the
    run is not started. Part of the run id: another owner's run of the same content is another run."""
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    inner_optimizer: InnerOptimizerSpec = field(default_factory=InnerOptimizerSpec)
    outer_optimizer: OuterOptimizerSpec = field(default_factory=OuterOptimizerSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    noloco: NoLoCoSpec = field(default_factory=NoLoCoSpec)
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)

    def __post_init__(self) -> None:
        check(
            "run",
            "name",
            self.name,
            isinstance(self.name, str) and 0 < len(self.name) <= 128 and self.name.isprintable(),
            "a printable string of 1 to 128 characters",
        )
        int_in("run", "protocol_version", self.protocol_version, 1, 2**31 - 1)
        check(
            "run",
            "owner",
            self.owner,
            isinstance(self.owner, str) and (not self.owner or is_owner_hex(self.owner)),
            "empty or an Ed25519 public key as 64 lowercase hex characters",
        )
        if self.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"run manifest speaks protocol version {self.protocol_version}, this client speaks "
                f"{PROTOCOL_VERSION}: install the locoswarm release that matches the run"
            )
        check(
            "inner_optimizer",
            "batch_size_tokens",
            self.inner_optimizer.batch_size_tokens,
            self.inner_optimizer.batch_size_tokens % self.data.seq_len_tokens == 0,
            f"a multiple of data.seq_len_tokens = {self.data.seq_len_tokens}",
        )
        check(
            "data",
            "seq_len_tokens",
            self.data.seq_len_tokens,
            self.data.seq_len_tokens <= self.model.max_seq_len,
            f"at most model.max_seq_len = {self.model.max_seq_len}",
        )
        if self.sync.algorithm == "noloco":
            self.noloco.check_stability()
        if self.sync.overlap == "streaming":
            check(
                "sync",
                "fragments",
                self.sync.fragments,
                self.sync.fragments <= self.model.num_layers,
                f"at most model.num_layers = {self.model.num_layers} with sync.overlap = 'streaming' "
                "(a fragment holds whole transformer blocks; 1 syncs the whole model as one fragment)",
            )
        check(
            "inner_optimizer",
            "kind",
            self.inner_optimizer.kind,
            self.inner_optimizer.kind == "adamw" or self.pipeline.stages == 1,
            "'adamw' with pipeline.stages > 1 (a stage's inner step runs AdamW only)",
        )
        check(
            "pipeline",
            "stages",
            self.pipeline.stages,
            self.pipeline.stages <= self.model.num_layers,
            f"at most model.num_layers = {self.model.num_layers} (a stage holds whole transformer blocks)",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data; ``owner`` is left out while empty, the streaming fields of ``sync`` and its
        ``overlap_from_round`` (``OMITTED_AT_DEFAULT_SYNC_FIELDS``) and the inner optimizer's ``kind``
        and ``muon_lr_ratio`` (``OMITTED_AT_DEFAULT_INNER_FIELDS``) while at their defaults, and the
        ``pipeline`` section while all of it is, so run ids from before they existed stay as they
        were (and older clients can read those manifests)."""
        data = dataclasses.asdict(self)
        if not self.owner:
            del data["owner"]
        if self.pipeline == PipelineSpec():
            del data["pipeline"]
        for section, default, names in (
            ("sync", SyncSpec(), OMITTED_AT_DEFAULT_SYNC_FIELDS),
            ("inner_optimizer", InnerOptimizerSpec(), OMITTED_AT_DEFAULT_INNER_FIELDS),
            ("data", DataSpec(), SHARD_FIELDS),
            ("data", DataSpec(), OMITTED_AT_DEFAULT_TOKENIZER_FIELDS),
        ):
            for name in names:
                if getattr(getattr(self, section), name) == getattr(default, name):
                    del data[section][name]
        return data

    def encode(self) -> bytes:
        """Canonical msgpack bytes: keys sorted at every level, so equal manifests encode equally."""
        return cast(bytes, msgpack.packb(_sorted(self.to_dict()), use_bin_type=True))

    def with_owner(self, owner: str) -> RunManifest:
        """This run owned by ``owner`` (hex public key; "" for the ownerless content).

        Raises:
            ManifestError: ``owner`` is neither empty nor 64 lowercase hex characters.
        """
        return dataclasses.replace(self, owner=owner)

    def same_content(self, other: RunManifest) -> bool:
        """Whether the two describe the same training run, whoever owns each."""
        return self.with_owner("") == other.with_owner("")

    @functools.cached_property
    def run_id(self) -> str:
        """The first RUN_ID_HEX_CHARS hex digits of the sha256 of :meth:`encode`. Computed once per
        manifest (every section is a frozen dataclass of scalars, so it cannot change): the round
        loop reads it several times a round."""
        return hashlib.sha256(self.encode()).hexdigest()[:RUN_ID_HEX_CHARS]

    @property
    def batch_sequences(self) -> int:
        return self.inner_optimizer.batch_size_tokens // self.data.seq_len_tokens

    def replace(self, **sections: Any) -> RunManifest:
        """A copy with fields overridden per section, e.g. ``replace(sync={"inner_steps": 5})``, or
        top-level ones (``replace(name="x")``)."""
        return from_dict(_merge(self.to_dict(), sections))


def _sorted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    return obj


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(data: Any) -> RunManifest:
    """Build and validate a manifest from plain data (parsed TOML or decoded msgpack).

    Raises:
        ManifestError: unknown section or field, wrong type, or value out of range.
        VersionMismatch: ``protocol_version`` differs from this client's.
    """
    if not isinstance(data, dict):
        raise ManifestError(f"a run manifest must be a table of sections, got {type(data).__name__}")
    top_fields = {"name", "protocol_version", "owner"}
    if "tokenizer" in data:
        raise ManifestError(
            "the [tokenizer] section is gone: the tokenizer is data.tokenizer ('bytes' or 'bpe', "
            "with data.vocab_size); move it into [data]"
        )
    unknown = set(data) - top_fields - set(_SECTIONS)
    if unknown:
        raise ManifestError(
            f"unknown manifest entries {sorted(unknown)}: allowed sections are {sorted(_SECTIONS)} "
            f"and top-level fields {sorted(top_fields)}"
        )
    kwargs: dict[str, Any] = {k: data[k] for k in top_fields if k in data}
    if "protocol_version" in kwargs and kwargs["protocol_version"] != PROTOCOL_VERSION:
        # Check first: a newer manifest may carry sections this client cannot parse.
        raise VersionMismatch(
            f"run manifest speaks protocol version {kwargs['protocol_version']!r}, this client speaks "
            f"{PROTOCOL_VERSION}: install the locoswarm release that matches the run"
        )
    for section, cls in _SECTIONS.items():
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise ManifestError(f"manifest section [{section}] must be a table, got {values!r}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        bad = set(values) - allowed
        if section == "compression" and "uplink_mbps" in bad:
            raise ManifestError(
                "compression.uplink_mbps is not part of a run (each peer measures its own uplink): "
                "remove it from the manifest and pass `peer join --uplink-mbps` instead"
            )
        if bad:
            raise ManifestError(
                f"unknown field(s) {sorted(bad)} in manifest section [{section}]: allowed {sorted(allowed)}"
            )
        for name, value in values.items():
            expected = type(getattr(cls(), name))
            _check_type(section, name, value, expected)
        if section == "noloco" and "lr" in values and "pull" not in values:
            values = {**values, "pull": values["lr"]}  # γ defaults to β (NoLoCo reference code)
        kwargs[section] = cls(**values)
    return RunManifest(**kwargs)


def _check_type(section: str, name: str, value: Any, expected: type) -> None:
    if expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    check(section, name, value, ok, f"a value of type {expected.__name__}")


def decode(payload: bytes, *, expected_run_id: str | None = None) -> RunManifest:
    """Decode a manifest received from the network and check it against its run id.

    Raises:
        ManifestError: the bytes are not a valid manifest, or hash to another run id.
        VersionMismatch: the manifest's protocol version differs from this client's.
    """
    if not isinstance(payload, bytes) or len(payload) > 1 << 16:
        raise ManifestError("manifest payload must be at most 64 KiB of msgpack bytes")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ManifestError(f"manifest payload is not valid msgpack: {exc}") from exc
    manifest = from_dict(data)
    if expected_run_id is not None and manifest.run_id != expected_run_id:
        raise ManifestError(
            f"manifest hashes to run id {manifest.run_id}, expected {expected_run_id}: "
            "the peer that served it is faulty or malicious"
        )
    return manifest


def load_manifest(path: str | Path) -> RunManifest:
    """Load and validate a run manifest from a TOML file.

    Raises:
        ConfigError (ManifestError): unreadable file, bad TOML, or a field out of range.
        VersionMismatch: the file's protocol version differs from this client's.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read run manifest {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"run manifest {path} is not valid TOML: {exc}") from exc
    return from_dict(data)


def dump_toml(manifest: RunManifest) -> str:
    """The manifest as TOML text that :func:`load_manifest` reads back to an equal manifest."""
    data = manifest.to_dict()
    lines = [f"name = {_toml_value(data.pop('name'))}", f"protocol_version = {data.pop('protocol_version')}"]
    if "owner" in data:
        lines.append(f"owner = {_toml_value(data.pop('owner'))}")
    for section, values in data.items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


@dataclass(frozen=True)
class SignedManifest:
    """A manifest with its owner's signature of :meth:`RunManifest.encode`: what a run's announcement
    holds (peer/net/dht.py), checked by :func:`open_announcement`."""

    manifest: RunManifest
    signature: bytes

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def to_wire(self) -> dict[str, bytes]:
        return {"m": self.manifest.encode(), "s": self.signature}


def sign_manifest(manifest: RunManifest, key: OwnerKey) -> SignedManifest:
    """Sign ``manifest`` with its owner's key (an ownerless one becomes ``key``'s run first).

    Raises:
        ManifestError: the manifest names another owner than ``key``.
    """
    if not manifest.owner:
        manifest = manifest.with_owner(key.public_hex)
    if manifest.owner != key.public_hex:
        where = f" ({key.path})" if key.path else ""
        raise ManifestError(
            f"run {manifest.run_id} ({manifest.name}) is owned by {manifest.owner}, not by the owner key{where} "
            f"({key.public_hex}): pass --owner-key with the run owner's key file, or remove `owner` from the "
            "manifest to start a new run of your own"
        )
    return SignedManifest(manifest, key.sign_manifest(manifest.encode()))


def open_announcement(value: Any, *, expected_run_id: str | None = None) -> SignedManifest:
    """Check a run announcement read from the DHT: a manifest signed by the owner it names.

    Args:
        value: the stored value (decoded msgpack): ``{"m": canonical manifest bytes, "s": signature}``.
        expected_run_id: the run id it is stored under, if known.

    Returns:
        The verified manifest and signature.

    Raises:
        BadSignature: not an announcement, no owner, not the canonical encoding, or a signature that
            does not verify with the owner's key.
        ManifestError: not a valid manifest, or it hashes to another run id than ``expected_run_id``.
        VersionMismatch: the manifest speaks another protocol version.
    """
    if not isinstance(value, dict) or set(value) != {"m", "s"}:
        raise BadSignature("not a signed run announcement (expected a map of m, s)")
    payload, signature = value["m"], value["s"]
    if not isinstance(signature, bytes):
        raise BadSignature("the announcement's signature is not bytes")
    manifest = decode(payload, expected_run_id=expected_run_id)
    if not manifest.owner:
        raise BadSignature(f"run {manifest.run_id} ({manifest.name}) names no owner: an unsigned announcement")
    if manifest.encode() != payload:
        raise BadSignature(f"run {manifest.run_id} is not announced in its canonical encoding")
    if not verify_manifest(manifest.owner, payload, signature):
        raise BadSignature(f"run {manifest.run_id} ({manifest.name}) is not signed by its owner {manifest.owner}")
    return SignedManifest(manifest, signature)
