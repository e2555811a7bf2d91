"""The run manifest: everything peers must agree on to train one model together.

A manifest is a tree of small frozen dataclasses. It is loaded from TOML (``load_manifest``),
validated field by field in ``__post_init__`` (a :class:`ManifestError` names the field, the bad
value and the allowed range), encoded canonically with msgpack (``encode``: sorted keys, fixed
types) and identified by the SHA-256 of that encoding (``run_id``). Peers fetch the encoding
from the DHT by run id and recompute the hash, so a tampered manifest is never trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from protocol.errors import ManifestError, VersionMismatch
from protocol.version import PROTOCOL_VERSION

RUN_ID_HEX_CHARS = 32
"""Run ids are the first 128 bits of the SHA-256 of the canonical encoding, in hex."""


def _check(section: str, name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ManifestError(f"manifest field {section}.{name} = {value!r} is invalid: allowed {allowed}")


def _int_in(section: str, name: str, value: Any, lo: int, hi: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    _check(section, name, value, ok, f"an integer in [{lo}, {hi}]")


def _float_in(section: str, name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    bracket = "(" if lo_open else "["
    _check(section, name, value, ok, f"a number in {bracket}{lo}, {hi}]")


def _choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(section, name, value, value in choices, "one of " + ", ".join(repr(c) for c in choices))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A Llama-style causal LM built with transformers from this config; no weights are fetched."""

    family: str = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 384
    max_seq_len: int = 256
    """Longest sequence the rotary embedding is configured for, in tokens."""
    init_seed: int = 0
    """Seed of φ_0: every peer builds the identical initial model from it."""

    def __post_init__(self) -> None:
        s = "model"
        _choice(s, "family", self.family, ("llama",))
        _int_in(s, "hidden_size", self.hidden_size, 8, 16384)
        _int_in(s, "num_layers", self.num_layers, 1, 256)
        _int_in(s, "num_heads", self.num_heads, 1, 256)
        _int_in(s, "num_kv_heads", self.num_kv_heads, 1, 256)
        _int_in(s, "intermediate_size", self.intermediate_size, 8, 65536)
        _int_in(s, "max_seq_len", self.max_seq_len, 8, 1 << 20)
        _int_in(s, "init_seed", self.init_seed, 0, 2**31 - 1)
        _check(s, "hidden_size", self.hidden_size, self.hidden_size % self.num_heads == 0,
               f"a multiple of model.num_heads = {self.num_heads}")
        _check(s, "num_kv_heads", self.num_kv_heads, self.num_heads % self.num_kv_heads == 0,
               f"a divisor of model.num_heads = {self.num_heads}")


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """Byte-level tokenizer: ids 0..255 are bytes, then BOS, EOS and PAD."""

    kind: str = "bytes"

    def __post_init__(self) -> None:
        _choice("tokenizer", "kind", self.kind, ("bytes",))


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the text comes from and how it is cut into training sequences."""

    source: str = "python-stdlib"
    """'python-stdlib': the running interpreter's standard library sources; 'files': ``path``."""
    path: str = ""
    """A directory or file of .txt/.py/.md/.jsonl text, used when source = 'files'."""
    seq_len_tokens: int = 128
    validation_fraction: float = 0.05
    """Share of files (chosen by path hash) held out for validation."""
    validation_sequences: int = 48
    """Size of the fixed validation subset every peer evaluates on."""

    def __post_init__(self) -> None:
        s = "data"
        _choice(s, "source", self.source, ("python-stdlib", "files"))
        _check(s, "path", self.path, isinstance(self.path, str), "a string")
        _check(s, "path", self.path, self.source != "files" or bool(self.path),
               "a non-empty path when data.source = 'files'")
        _int_in(s, "seq_len_tokens", self.seq_len_tokens, 8, 1 << 20)
        _float_in(s, "validation_fraction", self.validation_fraction, 0.0, 0.5, lo_open=True)
        _int_in(s, "validation_sequences", self.validation_sequences, 1, 1 << 20)


@dataclass(frozen=True, kw_only=True)
class InnerOptimizerSpec:
    """AdamW on each peer's θ; its schedule is indexed by cumulative inner steps of the swarm."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 20
    schedule: str = "cosine"
    """'cosine': linear warm-up then cosine decay to ``min_lr_ratio``·lr at ``decay_steps``;
    'constant': linear warm-up then constant."""
    decay_steps: int = 2000
    min_lr_ratio: float = 0.1
    batch_size_tokens: int = 2048
    """Tokens per inner step on one peer; a multiple of data.seq_len_tokens."""

    def __post_init__(self) -> None:
        s = "inner_optimizer"
        _float_in(s, "lr", self.lr, 0.0, 1.0, lo_open=True)
        _float_in(s, "weight_decay", self.weight_decay, 0.0, 10.0)
        _float_in(s, "beta1", self.beta1, 0.0, 0.999999)
        _float_in(s, "beta2", self.beta2, 0.0, 0.999999)
        _float_in(s, "eps", self.eps, 0.0, 1.0, lo_open=True)
        _float_in(s, "grad_clip_norm", self.grad_clip_norm, 0.0, 1e6)
        _int_in(s, "warmup_steps", self.warmup_steps, 0, 10**9)
        _choice(s, "schedule", self.schedule, ("cosine", "constant"))
        _int_in(s, "decay_steps", self.decay_steps, 1, 10**12)
        _float_in(s, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _int_in(s, "batch_size_tokens", self.batch_size_tokens, 1, 1 << 30)


@dataclass(frozen=True, kw_only=True)
class OuterOptimizerSpec:
    """SGD on φ with the averaged pseudo-gradient as its gradient (DiLoCo, arXiv 2311.08105)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    """True: Nesterov momentum (DiLoCo's choice); False: heavy-ball."""

    def __post_init__(self) -> None:
        s = "outer_optimizer"
        _float_in(s, "lr", self.lr, 0.0, 10.0, lo_open=True)
        _float_in(s, "momentum", self.momentum, 0.0, 0.999)
        _check(s, "nesterov", self.nesterov, isinstance(self.nesterov, bool), "true or false")


@dataclass(frozen=True, kw_only=True)
class NoLoCoSpec:
    """NoLoCo's outer step (arXiv 2506.10911; ALGORITHMS.md §2), used when sync.algorithm = 'noloco'."""

    momentum: float = 0.5
    """α: heavy-ball momentum of the outer step."""
    lr: float = 0.7
    """β: outer learning rate on the group's mean pseudo-gradient."""
    pull: float = 0.7
    """γ: pull toward the group's mean φ. When a TOML file sets ``lr`` but not ``pull``, γ = β."""
    group_size: int = 2
    """n: peers per averaging group, this one included (2: one random partner)."""

    def __post_init__(self) -> None:
        s = "noloco"
        _float_in(s, "momentum", self.momentum, 0.0, 0.999)
        _float_in(s, "lr", self.lr, 0.0, 10.0, lo_open=True)
        _float_in(s, "pull", self.pull, 0.0, 10.0)
        _int_in(s, "group_size", self.group_size, 2, 256)

    def check_stability(self) -> None:
        """Refuse (α, β, γ, n) outside NoLoCo's stability region (paper App. A, quadratic model).

        The replicas' mean converges only if β > α; their spread stays bounded only if
        α·sqrt(n / (2(n−1))) < γ < sqrt((2 + α²)·n / (2(n−1))).

        Raises:
            ManifestError: names the bound and the values.
        """
        a, b, g, n = self.momentum, self.lr, self.pull, self.group_size
        if not b > a:
            raise ManifestError(f"noloco.lr (β) = {b} must exceed noloco.momentum (α) = {a}: the replicas' mean "
                                "diverges otherwise (NoLoCo arXiv 2506.10911, App. A)")
        lo = a * math.sqrt(n / (2 * (n - 1)))
        hi = math.sqrt((2 + a * a) * n / (2 * (n - 1)))
        if not lo < g < hi:
            raise ManifestError(
                f"noloco.pull (γ) = {g} is outside the stability bound {lo:.4g} < γ < {hi:.4g} for "
                f"α = {a}, n = {n} (α·sqrt(n/(2(n−1))) < γ < sqrt((2+α²)·n/(2(n−1))), NoLoCo App. A): "
                "the replicas' spread would grow without bound"
            )


@dataclass(frozen=True, kw_only=True)
class SyncSpec:
    """How and how often peers exchange pseudo-gradients."""

    algorithm: str = "diloco"
    """'diloco': group all-reduce of Δ, outer_optimizer on φ; 'noloco': random groups of
    noloco.group_size peers average Δ and φ, NoLoCo outer step; 'independent': never sync (a
    baseline for comparisons)."""
    inner_steps: int = 20
    """H: inner steps per round (one round = one outer step)."""
    target_group_size: int = 16
    """Most peers in one all-reduce group, including this one."""
    matchmaking_time_s: float = 5.0
    """Seconds a peer waits for groupmates at the end of a round before averaging with those found."""
    allreduce_timeout_s: float = 60.0
    """Deadline of one all-reduce once the group is formed."""
    next_chunk_timeout_s: float = 5.0
    """A groupmate that sends nothing for this long is dropped from the round."""
    adaptive_deadlines: bool = True
    """Derive the matchmaking time and the all-reduce timeout from the swarm's recent rounds
    (peer/sync/deadlines.py), between the ``min_*`` values and the values above; false: always use the
    values above."""
    min_matchmaking_time_s: float = 1.0
    """Lower bound of the adaptive matchmaking time."""
    min_allreduce_timeout_s: float = 5.0
    """Lower bound of the adaptive all-reduce timeout."""

    def __post_init__(self) -> None:
        s = "sync"
        _choice(s, "algorithm", self.algorithm, ("diloco", "noloco", "independent"))
        _int_in(s, "inner_steps", self.inner_steps, 1, 10**6)
        _int_in(s, "target_group_size", self.target_group_size, 2, 4096)
        _float_in(s, "matchmaking_time_s", self.matchmaking_time_s, 0.0, 3600.0, lo_open=True)
        _float_in(s, "allreduce_timeout_s", self.allreduce_timeout_s, 0.0, 86400.0, lo_open=True)
        _float_in(s, "next_chunk_timeout_s", self.next_chunk_timeout_s, 0.0, 3600.0, lo_open=True)
        _check(s, "adaptive_deadlines", self.adaptive_deadlines, isinstance(self.adaptive_deadlines, bool),
               "true or false")
        for low, high in (("min_matchmaking_time_s", "matchmaking_time_s"),
                          ("min_allreduce_timeout_s", "allreduce_timeout_s")):
            _float_in(s, low, getattr(self, low), 0.0, 86400.0, lo_open=True)
            if getattr(self, low) > getattr(self, high):
                raise ManifestError(f"manifest field sync.{low} = {getattr(self, low)!r} is above sync.{high} = "
                                    f"{getattr(self, high)!r}: the adaptive deadline lies between them; lower "
                                    f"{low} too, or raise {high}")


CODECS = ("none", "fp16", "bf16", "int8", "int4", "fp4", "topk", "lowrank", "adaptive")
"""Codecs a run may choose for pseudo-gradients (protocol/codecs.py; ALGORITHMS.md §3, §5)."""
PHI_CODECS = ("none", "fp16", "bf16", "int8")


@dataclass(frozen=True, kw_only=True)
class CompressionSpec:
    """How pseudo-gradients cross the network (protocol/codecs.py).

    Every codec's sums are accumulated in fp32; lossy codecs keep a per-peer error-feedback
    residual when ``error_feedback`` is on. 1-D tensors are never top-k or low-rank compressed.
    """

    codec: str = "none"
    """'none' (fp32), 'fp16', 'bf16', 'int8' / 'int4' (blockwise absmax), 'fp4' (E3M0 float,
    blockwise scale), 'topk' (largest-magnitude fraction), 'lowrank' (PowerSGD-style), or
    'adaptive' (per tensor, fits each sync into ``sync_time_budget_s`` at the measured uplink;
    the DiLoCoX idea, arXiv 2506.21263)."""
    block_size: int = 64
    """Elements per absmax block of int8, int4 and fp4."""
    topk_fraction: float = 0.01
    """Fraction of each tensor's elements that top-k sends."""
    rank: int = 4
    """Rank of the low-rank codec."""
    error_feedback: bool = True
    """Carry each lossy codec's compression error into the next round (e ← (Δ + e) − C(Δ + e))."""
    phi_codec: str = "none"
    """NoLoCo only: how the φ half of the payload is sent ('none' is fp32)."""
    sync_time_budget_s: float = 10.0
    """adaptive: seconds one sync should take at the peer's measured uplink."""
    uplink_mbps: float = 50.0
    """adaptive: assumed uplink in Mbit/s until the first sync has measured it."""

    def __post_init__(self) -> None:
        s = "compression"
        _choice(s, "codec", self.codec, CODECS)
        _int_in(s, "block_size", self.block_size, 8, 1 << 20)
        _float_in(s, "topk_fraction", self.topk_fraction, 0.0, 1.0, lo_open=True)
        _int_in(s, "rank", self.rank, 1, 4096)
        _check(s, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "true or false")
        _choice(s, "phi_codec", self.phi_codec, PHI_CODECS)
        _float_in(s, "sync_time_budget_s", self.sync_time_budget_s, 0.0, 86400.0, lo_open=True)
        _float_in(s, "uplink_mbps", self.uplink_mbps, 0.0, 1e6, lo_open=True)


_SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "tokenizer": TokenizerSpec,
    "data": DataSpec,
    "inner_optimizer": InnerOptimizerSpec,
    "outer_optimizer": OuterOptimizerSpec,
    "sync": SyncSpec,
    "noloco": NoLoCoSpec,
    "compression": CompressionSpec,
}


@dataclass(frozen=True, kw_only=True)
class RunManifest:
    """One training run. Identified by :attr:`run_id`, the hash of :meth:`encode`."""

    name: str = "default"
    protocol_version: int = PROTOCOL_VERSION
    model: ModelSpec = field(default_factory=ModelSpec)
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    inner_optimizer: InnerOptimizerSpec = field(default_factory=InnerOptimizerSpec)
    outer_optimizer: OuterOptimizerSpec = field(default_factory=OuterOptimizerSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    noloco: NoLoCoSpec = field(default_factory=NoLoCoSpec)
    compression: CompressionSpec = field(default_factory=CompressionSpec)

    def __post_init__(self) -> None:
        _check("run", "name", self.name,
               isinstance(self.name, str) and 0 < len(self.name) <= 128 and self.name.isprintable(),
               "a printable string of 1 to 128 characters")
        _int_in("run", "protocol_version", self.protocol_version, 1, 2**31 - 1)
        if self.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"run manifest speaks protocol version {self.protocol_version}, this client speaks "
                f"{PROTOCOL_VERSION}: install the locoswarm release that matches the run"
            )
        _check("inner_optimizer", "batch_size_tokens", self.inner_optimizer.batch_size_tokens,
               self.inner_optimizer.batch_size_tokens % self.data.seq_len_tokens == 0,
               f"a multiple of data.seq_len_tokens = {self.data.seq_len_tokens}")
        _check("data", "seq_len_tokens", self.data.seq_len_tokens,
               self.data.seq_len_tokens <= self.model.max_seq_len,
               f"at most model.max_seq_len = {self.model.max_seq_len}")
        if self.sync.algorithm == "noloco":
            self.noloco.check_stability()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def encode(self) -> bytes:
        """Canonical msgpack bytes: keys sorted at every level, so equal manifests encode equally."""
        return msgpack.packb(_sorted(self.to_dict()), use_bin_type=True)

    @property
    def run_id(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()[:RUN_ID_HEX_CHARS]

    @property
    def batch_sequences(self) -> int:
        return self.inner_optimizer.batch_size_tokens // self.data.seq_len_tokens

    def replace(self, **sections: dict[str, Any]) -> RunManifest:
        """A copy with fields overridden per section, e.g. ``replace(sync={"inner_steps": 5})``."""
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
    top_fields = {"name", "protocol_version"}
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
    _check(section, name, value, ok, f"a value of type {expected.__name__}")


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
