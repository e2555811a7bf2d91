"""The sections of a run manifest: one small frozen dataclass per component, validated on creation.

Each ``__post_init__`` checks every field and raises :class:`~protocol.errors.ManifestError`
naming the field, the bad value and the allowed range. :mod:`protocol.manifest` assembles the
sections into a :class:`~protocol.manifest.RunManifest` and gives it its encoding and run id.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from protocol.errors import ManifestError


def check(section: str, name: str, value: Any, ok: bool, allowed: str) -> None:
    """ManifestError naming ``section.name``, the bad value and what is allowed, unless ``ok``."""
    if not ok:
        raise ManifestError(f"manifest field {section}.{name} = {value!r} is invalid: allowed {allowed}")


def int_in(section: str, name: str, value: Any, lo: int, hi: int) -> None:
    """ManifestError unless ``value`` is an integer (not a bool) in [lo, hi]."""
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    check(section, name, value, ok, f"an integer in [{lo}, {hi}]")


def float_in(section: str, name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """ManifestError unless ``value`` is a finite number (not a bool) in [lo, hi], or (lo, hi] if ``lo_open``."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    bracket = "(" if lo_open else "["
    check(section, name, value, ok, f"a number in {bracket}{lo}, {hi}]")


def one_of(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    """ManifestError unless ``value`` is one of ``choices``."""
    check(section, name, value, value in choices, "one of " + ", ".join(repr(c) for c in choices))


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
        one_of(s, "family", self.family, ("llama",))
        int_in(s, "hidden_size", self.hidden_size, 8, 16384)
        int_in(s, "num_layers", self.num_layers, 1, 256)
        int_in(s, "num_heads", self.num_heads, 1, 256)
        int_in(s, "num_kv_heads", self.num_kv_heads, 1, 256)
        int_in(s, "intermediate_size", self.intermediate_size, 8, 65536)
        int_in(s, "max_seq_len", self.max_seq_len, 8, 1 << 20)
        int_in(s, "init_seed", self.init_seed, 0, 2**31 - 1)
        check(
            s,
            "hidden_size",
            self.hidden_size,
            self.hidden_size % self.num_heads == 0,
            f"a multiple of model.num_heads = {self.num_heads}",
        )
        check(
            s,
            "num_kv_heads",
            self.num_kv_heads,
            self.num_heads % self.num_kv_heads == 0,
            f"a divisor of model.num_heads = {self.num_heads}",
        )


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the text comes from, how it is tokenized, and how it is cut into training sequences."""

    source: str = "python-stdlib"
    """'python-stdlib': the running interpreter's standard library sources; 'files': a directory or file
    of .txt/.md/.rst/.py text; 'jsonl': a .jsonl file or directory of them; 'parquet': a .parquet file or
    directory of them; 'hf-dataset': a Hugging Face dataset saved with ``save_to_disk`` (never downloaded);
    'shards': parquet or jsonl shards named by the hashed list ``shards_sha256``, each peer streaming its
    own (peer/shards/) from ``path`` (a local directory), the peers, ``base_url`` and ``hub_repo``."""
    path: str = ""
    """The file or directory of every source but 'python-stdlib'. Empty when ``corpus_sha256`` names the
    corpus by content: each peer then reads its own copy (``peer join --data PATH``), checked against
    the hash; a run announced with a non-empty path is refused by joiners (peer/net/dht.py)."""
    text_field: str = "text"
    """The JSON key or column holding each document's text ('jsonl', 'parquet', 'hf-dataset')."""
    tokenizer: str = "bytes"
    """'bytes': UTF-8 bytes plus BOS/EOS/PAD (259 ids); 'bpe': a byte-level BPE, the ``tokenizer.json``
    (Hugging Face tokenizers format) whose SHA-256 is ``tokenizer_sha256``, loaded, never trained at join
    (``peer data prepare --train-tokenizer N`` trains one on the operator's side)."""
    vocab_size: int = 0
    """Ids of the tokenizer, specials included, and rows of the model's embedding: 0 with 'bytes'
    (fixed at 259), e.g. 4096 with 'bpe'."""
    corpus_sha256: str = ""
    """When set, peers whose local corpus hashes otherwise refuse to train (``peer data prepare`` prints it)."""
    corpus_bytes: int = 0
    """When set, the corpus's size in UTF-8 bytes of its texts: a copy of another size is refused with its
    size named (an incomplete download says so before its hash is compared). ``peer data prepare`` prints it."""
    tokenizer_sha256: str = ""
    """SHA-256 of the tokenizer (of the ``tokenizer.json`` bytes with 'bpe', which a 'bpe' run must set):
    peers whose tokenizer hashes otherwise refuse to train (``peer data prepare`` prints it)."""
    tokenizer_source: str = ""
    """'bpe' only: where a peer gets the ``tokenizer.json`` when neither the package (peer/assets/) nor its
    own tokenizer store holds it: a local file path, or ``hf://datasets/OWNER/NAME@COMMIT/FILE`` (a dataset
    repository; ``hf://OWNER/NAME@COMMIT/FILE`` for a model repository) at a pinned commit (40 hex digits),
    fetched from the Hub at ``$HF_ENDPOINT``. '' for none. Left out of the run id while ''."""
    seq_len_tokens: int = 128
    validation_fraction: float = 0.05
    """Share of documents (chosen by hash: of the relative path for files, of the text for records)
    held out for validation."""
    validation_sequences: int = 48
    """Size of the fixed validation subset every peer evaluates on."""
    shards_sha256: str = ""
    """'shards' only: SHA-256 of the run's shard list (``shards.json``, peer/shards/index.py: each
    shard's name, size in bytes and SHA-256, canonical JSON), so every shard is bound to the run id;
    ``peer data prepare`` writes the list and prints this hash."""
    shard_count: int = 0
    """'shards' only: shards in the list."""
    shards_bytes: int = 0
    """'shards' only: bytes of all shard files together."""
    validation_shards: int = 1
    """'shards' only: shards held out for validation (chosen by the hash of their names), which every
    peer fetches and evaluates on; the rest are dealt to peers to train on."""
    base_url: str = ""
    """'shards' only: an HTTP(S) URL the shard files (and ``shards.json``) lie under, '' for none."""
    hub_repo: str = ""
    """'shards' only: a Hugging Face dataset repository ('owner/name') holding the shards, '' for none."""
    hub_revision: str = ""
    """'shards' only: the commit of ``hub_repo`` to read, 40 hex digits (a pinned revision, never a branch)."""

    def __post_init__(self) -> None:
        s = "data"
        one_of(s, "source", self.source, DATA_SOURCES)
        self._check_shards()
        check(s, "path", self.path, isinstance(self.path, str), "a string")
        check(
            s,
            "path",
            self.path,
            self.source in ("python-stdlib", "shards") or bool(self.path) or bool(self.corpus_sha256),
            f"a non-empty path when data.source = {self.source!r}, or empty with data.corpus_sha256 set "
            "(a corpus named by content: each peer passes --data PATH)",
        )
        check(
            s,
            "text_field",
            self.text_field,
            isinstance(self.text_field, str) and bool(self.text_field),
            "a non-empty string",
        )
        one_of(s, "tokenizer", self.tokenizer, ("bytes", "bpe"))
        if self.tokenizer == "bytes":
            check(
                s, "vocab_size", self.vocab_size, self.vocab_size in (0, 259), "0 or 259 with data.tokenizer = 'bytes'"
            )
        else:
            int_in(s, "vocab_size", self.vocab_size, 512, 1 << 20)
        check(
            s,
            "tokenizer_source",
            self.tokenizer_source,
            isinstance(self.tokenizer_source, str)
            and (self.tokenizer_source == "" or self.tokenizer == "bpe")
            and (not self.tokenizer_source.startswith("hf://") or bool(HUB_FILE.fullmatch(self.tokenizer_source))),
            "'' with data.tokenizer = 'bytes'; with 'bpe': '', a file path, or "
            "'hf://datasets/OWNER/NAME@COMMIT/FILE' (COMMIT: 40 lowercase hex digits, a pinned revision)",
        )
        for name in ("corpus_sha256", "tokenizer_sha256"):
            value = getattr(self, name)
            check(
                s,
                name,
                value,
                isinstance(value, str)
                and (value == "" or (len(value) == 64 and all(c in "0123456789abcdef" for c in value))),
                "'' or 64 lowercase hex digits (a SHA-256, as `peer data prepare` prints it)",
            )
        int_in(s, "corpus_bytes", self.corpus_bytes, 0, 1 << 50)
        int_in(s, "seq_len_tokens", self.seq_len_tokens, 8, 1 << 20)
        float_in(s, "validation_fraction", self.validation_fraction, 0.0, 0.5, lo_open=True)
        int_in(s, "validation_sequences", self.validation_sequences, 1, 1 << 20)

    def _check_shards(self) -> None:
        s, hexdigits = "data", "0123456789abcdef"
        for name in ("base_url", "hub_repo", "hub_revision"):
            check(s, name, getattr(self, name), isinstance(getattr(self, name), str), "a string")
        if self.source != "shards":
            for name in SHARD_FIELDS:
                check(
                    s,
                    name,
                    getattr(self, name),
                    getattr(self, name) == getattr(DataSpec, name),
                    f"{getattr(DataSpec, name)!r} unless data.source = 'shards'",
                )
            return
        check(
            s,
            "shards_sha256",
            self.shards_sha256,
            isinstance(self.shards_sha256, str)
            and len(self.shards_sha256) == 64
            and all(c in hexdigits for c in self.shards_sha256),
            "64 lowercase hex digits with data.source = 'shards' (the hash `peer data prepare` prints)",
        )
        int_in(s, "shard_count", self.shard_count, 2, 1 << 24)
        int_in(s, "shards_bytes", self.shards_bytes, 1, 1 << 60)
        int_in(s, "validation_shards", self.validation_shards, 1, max(1, self.shard_count - 1))
        check(
            s,
            "base_url",
            self.base_url,
            self.base_url == "" or self.base_url.startswith(("http://", "https://")),
            "'' or an http:// or https:// URL",
        )
        check(s, "hub_repo", self.hub_repo, self.hub_repo == "" or self.hub_repo.count("/") == 1, "'' or 'owner/name'")
        check(
            s,
            "hub_revision",
            self.hub_revision,
            (self.hub_revision == "") == (self.hub_repo == "")
            and (
                self.hub_revision == ""
                or (len(self.hub_revision) == 40 and all(c in hexdigits for c in self.hub_revision))
            ),
            "a commit (40 lowercase hex digits) when data.hub_repo is set, '' otherwise",
        )


DATA_SOURCES = ("python-stdlib", "files", "jsonl", "parquet", "hf-dataset", "shards")
"""What ``data.source`` may name; 'shards' is a corpus given as a hashed shard list (peer/shards/)."""
SHARD_FIELDS = (
    "shards_sha256",
    "shard_count",
    "shards_bytes",
    "validation_shards",
    "base_url",
    "hub_repo",
    "hub_revision",
)
"""The data fields only ``source = "shards"`` reads; left out of a manifest's encoding while at their
defaults (protocol/manifest.py), so the run ids of runs that do not use them stay as they were."""

HUB_FILE = re.compile(r"hf://(?:(datasets)/)?([\w.-]+/[\w.-]+)@([0-9a-f]{40})/(\S+)")
"""A file of a Hugging Face repository at a pinned commit, as ``data.tokenizer_source`` names it:
groups (``'datasets'`` or None for a model repository, ``OWNER/NAME``, the commit, the file's path)."""
OMITTED_AT_DEFAULT_TOKENIZER_FIELDS = ("tokenizer_source",)
"""The data fields of the tokenizer left out of a manifest's encoding while at their defaults
(protocol/manifest.py), so the run ids of runs that do not use them stay as they were."""


INNER_KINDS = ("adamw", "muon")
"""The inner optimizers (``inner_optimizer.kind``, peer/train/inner.py)."""
OMITTED_AT_DEFAULT_INNER_FIELDS = ("kind", "muon_lr_ratio")
"""The inner_optimizer fields left out of a manifest's encoding while at their defaults (added after
runs without them existed, whose run ids stay as they were)."""


@dataclass(frozen=True, kw_only=True)
class InnerOptimizerSpec:
    """AdamW on each peer's θ (or Muon on its block matrices: ``kind``); its schedule is indexed by
    cumulative inner steps of the swarm."""

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
    kind: str = "adamw"
    """'adamw': AdamW on every parameter. 'muon': :class:`torch.optim.Muon` (momentum 0.95,
    Nesterov, 5 Newton-Schulz steps, its update's RMS matched to AdamW's so that AdamW's lr and
    weight decay carry over) on the 2-D weight matrices of the transformer blocks, AdamW on the
    rest (embeddings, output layer, norms), as MuLoCo (arXiv 2505.23725) runs DiLoCo's inner step.
    Every peer of a run uses the same."""
    muon_lr_ratio: float = 8.0
    """With ``kind = "muon"``: Muon's lr ÷ AdamW's, at every step (both follow the schedule)."""

    def __post_init__(self) -> None:
        s = "inner_optimizer"
        one_of(s, "kind", self.kind, INNER_KINDS)
        float_in(s, "muon_lr_ratio", self.muon_lr_ratio, 0.0, 1000.0, lo_open=True)
        float_in(s, "lr", self.lr, 0.0, 1.0, lo_open=True)
        float_in(s, "weight_decay", self.weight_decay, 0.0, 10.0)
        float_in(s, "beta1", self.beta1, 0.0, 0.999999)
        float_in(s, "beta2", self.beta2, 0.0, 0.999999)
        float_in(s, "eps", self.eps, 0.0, 1.0, lo_open=True)
        float_in(s, "grad_clip_norm", self.grad_clip_norm, 0.0, 1e6)
        int_in(s, "warmup_steps", self.warmup_steps, 0, 10**9)
        one_of(s, "schedule", self.schedule, ("cosine", "constant"))
        int_in(s, "decay_steps", self.decay_steps, 1, 10**12)
        float_in(s, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        int_in(s, "batch_size_tokens", self.batch_size_tokens, 1, 1 << 30)


@dataclass(frozen=True, kw_only=True)
class OuterOptimizerSpec:
    """SGD on φ with the averaged pseudo-gradient as its gradient (DiLoCo, arXiv 2311.08105).

    The default is plain averaging (lr 1.0, no momentum: φ ← mean of the group's θ): from scratch
    at short H it beat the DiLoCo paper's Nesterov 0.7/0.9 (picked at H = 500 from a pretrained
    start) and every other lr × momentum tried (docs/notes/benchmarks-log.md "Outer optimizer sweep",
    bench/sweep_outer.py).
    """

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    """True: Nesterov momentum (the DiLoCo paper's 0.7/0.9); False: heavy-ball (no difference at μ = 0)."""

    def __post_init__(self) -> None:
        s = "outer_optimizer"
        float_in(s, "lr", self.lr, 0.0, 10.0, lo_open=True)
        float_in(s, "momentum", self.momentum, 0.0, 0.999)
        check(s, "nesterov", self.nesterov, isinstance(self.nesterov, bool), "true or false")


@dataclass(frozen=True, kw_only=True)
class NoLoCoSpec:
    """NoLoCo's outer step (arXiv 2506.10911; docs/algorithms.md §2), used when sync.algorithm = 'noloco'.

    The default, α = 0 and β = γ = 1 (φ ← the group's mean θ, no momentum): from scratch at short
    H it beat the paper's α = 0.5, β = γ = 0.7 (docs/notes/benchmarks-log.md "Outer optimizer sweep").
    """

    momentum: float = 0.0
    """α: heavy-ball momentum of the outer step (the paper's default: 0.5)."""
    lr: float = 1.0
    """β: outer learning rate on the group's mean pseudo-gradient (the paper's default: 0.7)."""
    pull: float = 1.0
    """γ: pull toward the group's mean φ. When a TOML file sets ``lr`` but not ``pull``, γ = β."""
    group_size: int = 2
    """n: peers per averaging group, this one included (2: one random partner)."""

    def __post_init__(self) -> None:
        s = "noloco"
        float_in(s, "momentum", self.momentum, 0.0, 0.999)
        float_in(s, "lr", self.lr, 0.0, 10.0, lo_open=True)
        float_in(s, "pull", self.pull, 0.0, 10.0)
        int_in(s, "group_size", self.group_size, 2, 256)

    def check_stability(self) -> None:
        """Refuse (α, β, γ, n) outside NoLoCo's stability region (paper App. A, quadratic model).

        The replicas' mean converges only if β > α; their spread stays bounded only if
        α·sqrt(n / (2(n−1))) < γ < sqrt((2 + α²)·n / (2(n−1))).

        Raises:
            ManifestError: names the bound and the values.
        """
        a, b, g, n = self.momentum, self.lr, self.pull, self.group_size
        if not b > a:
            raise ManifestError(
                f"noloco.lr (β) = {b} must exceed noloco.momentum (α) = {a}: the replicas' mean "
                "diverges otherwise (NoLoCo arXiv 2506.10911, App. A)"
            )
        lo = a * math.sqrt(n / (2 * (n - 1)))
        hi = math.sqrt((2 + a * a) * n / (2 * (n - 1)))
        if not lo < g < hi:
            raise ManifestError(
                f"noloco.pull (γ) = {g} is outside the stability bound {lo:.4g} < γ < {hi:.4g} for "
                f"α = {a}, n = {n} (α·sqrt(n/(2(n−1))) < γ < sqrt((2+α²)·n/(2(n−1))), NoLoCo App. A): "
                "the replicas' spread would grow without bound"
            )


OVERLAP_MODES = ("none", "delayed", "eager", "streaming")
"""How a round's sync overlaps the next round's inner steps (``sync.overlap``)."""
FRAGMENT_MERGES = ("mix", "shift")
"""How a streaming fragment's mean enters θ when it lands (``sync.fragment_merge``, peer/train/streaming.py)."""


def delta_is_round_progress(overlap: str) -> bool:
    """Whether a sync's Δ is the round's own progress ψ − θ (blocking, delayed, eager), which receivers
    hold the means against (the receipts' alignments, a pair's whole Δ); not streaming, whose landings
    merge φ into θ inside the round."""
    return overlap != "streaming"


STREAMING_FIELDS = ("fragments", "fragment_delay_steps", "fragment_alpha", "fragment_merge")
"""The sync fields only ``overlap = "streaming"`` reads; left out of a manifest's encoding while at
their defaults (protocol/manifest.py), so the run ids of runs that do not use them stay as they were."""
OMITTED_AT_DEFAULT_SYNC_FIELDS = (*STREAMING_FIELDS, "overlap_from_round")
"""The sync fields left out of a manifest's encoding while at their defaults: the streaming fields
and ``overlap_from_round`` (added after runs without them existed)."""


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
    overlap: str = "none"
    """'none': a peer waits for its round's sync; 'delayed': round t's sync runs while round t+1
    trains and its outer step lands at the end of round t+1 (DiLoCoX one-step delay); 'eager': as
    delayed, and each peer starts round t+1 from its own outer parameters, φ plus its own fresh
    pseudo-gradient's share (with outer momentum: an offset with momentum of its own; arXiv
    2502.12996). peer/train/overlap.py; 'streaming': Streaming DiLoCo (arXiv 2501.18512),
    ``fragments`` parts of the model synced at staggered steps, each sync overlapping
    ``fragment_delay_steps`` inner steps (peer/train/streaming.py). A
    swarm-wide fact."""
    overlap_from_round: int = 0
    """K, 'delayed' and 'eager' only: rounds 0 to K − 1 of the run sync blocking (as 'none'), round K
    is the first whose sync overlaps the next round (its mean lands at the end of round K + 1). A
    round's index is the swarm's, so every peer switches at the same round, a joiner too. Overlap
    costs the most loss early in a run, when φ moves the most per round (docs/notes/benchmarks-log.md). 0:
    overlap from the first round."""
    fragments: int = 4
    """P, streaming only: fragments of the model (fragment p holds transformer blocks p, p+P, ...);
    at most model.num_layers."""
    fragment_delay_steps: int = 2
    """τ, streaming only: inner steps between a fragment's sync starting and its mean being applied
    at the earliest (0: applied at once, no overlap); below inner_steps / fragments. A peer whose
    sync takes longer applies the mean when it arrives, at the latest when the next fragment's sync
    starts (peer/round/streamed.py ``FragmentSchedule.land_due``); the simulation applies it after exactly τ steps."""
    fragment_alpha: float = 0.5
    """α, streaming only: on arrival θ_p ← α·θ_p + (1 − α)·φ_p (1: keep the local θ_p, 0: take φ_p);
    with ``fragment_merge = "shift"`` that mix is taken of θ_p as it was when the sync started."""
    fragment_merge: str = "mix"
    """Streaming only: how a fragment's mean enters θ_p when it lands. 'mix' (Streaming DiLoCo's
    rule, arXiv 2501.18512): θ_p ← α·θ_p + (1 − α)·φ_p, which also takes (1 − α) of the inner steps
    trained while the sync was in flight back out. 'shift': θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync),
    θ_p^sync being θ_p when the sync started: the same mix of the state the sync was about, with
    the steps trained since kept in full (equal to 'mix' when none were). It cost less loss than
    'mix' where a sync overlaps many steps (docs/notes/benchmarks-log.md, issue #18); 'mix' stays the default
    so that a manifest written before this field existed means what it meant."""

    def __post_init__(self) -> None:
        s = "sync"
        one_of(s, "algorithm", self.algorithm, ("diloco", "noloco", "independent"))
        one_of(s, "overlap", self.overlap, OVERLAP_MODES)
        int_in(s, "overlap_from_round", self.overlap_from_round, 0, 10**9)
        check(
            s,
            "overlap_from_round",
            self.overlap_from_round,
            self.overlap_from_round == 0 or self.overlap in ("delayed", "eager"),
            f"0 with sync.overlap = {self.overlap!r} (blocking rounds before overlap starts apply to "
            "'delayed' and 'eager' only): set sync.overlap_from_round = 0, or sync.overlap to one of those",
        )
        int_in(s, "inner_steps", self.inner_steps, 1, 10**6)
        int_in(s, "fragments", self.fragments, 1, 4096)
        int_in(s, "fragment_delay_steps", self.fragment_delay_steps, 0, 10**6)
        float_in(s, "fragment_alpha", self.fragment_alpha, 0.0, 1.0)
        one_of(s, "fragment_merge", self.fragment_merge, FRAGMENT_MERGES)
        if self.overlap == "streaming":
            # τ < H/P: a fragment's sync lands within its slot of the round (the next fragment's
            # sync starts about H/P steps later), as in the paper, where τ is a few steps
            check(
                s,
                "fragment_delay_steps",
                self.fragment_delay_steps,
                self.fragment_delay_steps * self.fragments < self.inner_steps,
                f"an integer below sync.inner_steps / sync.fragments = {self.inner_steps} / {self.fragments} "
                "with sync.overlap = 'streaming'",
            )
        int_in(s, "target_group_size", self.target_group_size, 2, 4096)
        float_in(s, "matchmaking_time_s", self.matchmaking_time_s, 0.0, 3600.0, lo_open=True)
        float_in(s, "allreduce_timeout_s", self.allreduce_timeout_s, 0.0, 86400.0, lo_open=True)
        float_in(s, "next_chunk_timeout_s", self.next_chunk_timeout_s, 0.0, 3600.0, lo_open=True)
        check(
            s, "adaptive_deadlines", self.adaptive_deadlines, isinstance(self.adaptive_deadlines, bool), "true or false"
        )
        for low, high in (
            ("min_matchmaking_time_s", "matchmaking_time_s"),
            ("min_allreduce_timeout_s", "allreduce_timeout_s"),
        ):
            float_in(s, low, getattr(self, low), 0.0, 86400.0, lo_open=True)
            if getattr(self, low) > getattr(self, high):
                raise ManifestError(
                    f"manifest field sync.{low} = {getattr(self, low)!r} is above sync.{high} = "
                    f"{getattr(self, high)!r}: the adaptive deadline lies between them; lower "
                    f"{low} too, or raise {high}"
                )


ROUTINGS = ("random", "fastest")
"""How a micro-batch picks its replica of the next pipeline stage (``pipeline.routing``,
peer/pipeline/routing.py)."""
ACTIVATION_DTYPES = ("bf16", "fp32")
"""Dtypes activations and their gradients travel in between pipeline stages."""


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """Pipeline stages: the model split across peers (issue #19; DiLoCoX arXiv 2506.21263, SWARM
    arXiv 2301.11913). ``stages = 1`` is a peer holding the whole model. The section is left out of a
    manifest's encoding while every field is at its default, so run ids without stages stay as they
    were. A peer serves one stage (peer/pipeline/: stage split, wire frames and calls, routing, the
    stage's inner loop); ``stages > 1`` with ``sync.overlap`` other than 'none' is refused."""

    stages: int = 1
    """S: pipeline stages; stage 0 holds the embedding and reads data, the last the output layer and
    the loss; at most model.num_layers (a stage holds whole transformer blocks)."""
    routing: str = "random"
    """'random': each micro-batch goes to the replica a permutation from a seed all peers share picks
    (NoLoCo); 'fastest': to the replica with the least expected finish time (SWARM)."""
    activation_dtype: str = "bf16"
    """Dtype of activations and activation gradients on the wire."""
    call_timeout_s: float = 30.0
    """Deadline of one stage call (a micro-batch's forward and backward through the stages after
    this one); a replica that misses it is skipped and the call retried on another."""

    def __post_init__(self) -> None:
        s = "pipeline"
        int_in(s, "stages", self.stages, 1, 1024)
        one_of(s, "routing", self.routing, ROUTINGS)
        one_of(s, "activation_dtype", self.activation_dtype, ACTIVATION_DTYPES)
        float_in(s, "call_timeout_s", self.call_timeout_s, 0.0, 3600.0, lo_open=True)


CODECS = ("none", "fp16", "bf16", "int8", "int4", "fp4", "topk", "lowrank", "adaptive")
"""Codecs a run may choose for pseudo-gradients (protocol/codecs/; docs/algorithms.md §3, §5)."""
PHI_CODECS = ("none", "fp16", "bf16", "int8")


@dataclass(frozen=True, kw_only=True)
class CompressionSpec:
    """How pseudo-gradients cross the network (protocol/codecs/). Every codec's sums are accumulated
    in fp32; 1-D tensors are never top-k or low-rank compressed."""

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
    residual_dtype: str = "fp32"
    """'fp32' or 'bf16': how each peer keeps its error-feedback residual e (bf16: half the memory)."""
    phi_codec: str = "none"
    """NoLoCo only: how the φ half of the payload is sent ('none' is fp32)."""
    sync_time_budget_s: float = 10.0
    """adaptive: seconds one sync should take at the peer's measured uplink (the uplink is each
    peer's own fact, ``peer join --uplink-mbps``, never part of the run)."""

    def __post_init__(self) -> None:
        s = "compression"
        one_of(s, "codec", self.codec, CODECS)
        int_in(s, "block_size", self.block_size, 8, 1 << 20)
        float_in(s, "topk_fraction", self.topk_fraction, 0.0, 1.0, lo_open=True)
        int_in(s, "rank", self.rank, 1, 4096)
        check(s, "error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "true or false")
        one_of(s, "residual_dtype", self.residual_dtype, ("fp32", "bf16"))
        one_of(s, "phi_codec", self.phi_codec, PHI_CODECS)
        float_in(s, "sync_time_budget_s", self.sync_time_budget_s, 0.0, 86400.0, lo_open=True)
