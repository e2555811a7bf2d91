"""Corpus, train/validation split, and each peer's random shard of training windows.

:func:`load_corpus` streams the documents of the source ``[data]`` names (peer/train/sources.py),
hashes them into the corpus's identity (checked against ``data.corpus_sha256`` when the run pins
it), gets the tokenizer (peer/train/tokenizer.py, peer/train/bpe.py), and memory-maps the token
streams of the two splits from the on-disk cache, tokenizing into it on a first load
(peer/train/cache.py). The corpus's hash is kept in the same cache, keyed by the source's
fingerprint (each file's relative path, size and modification time, :func:`source_fingerprint`), so a
restart reads no text at all; a file that changed is read and hashed again. A document is held out for validation by a hash of its name (the relative
path of a file, the text hash of a record), so the split is the same on every machine. Each
document's tokens are followed by EOS. The default (python-stdlib, bytes) gives the same streams
as ever: the standard library's ``.py`` files in path order, byte by byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peer.train.bpe import load_tokenizer
from peer.train.cache import (
    atomic_write,
    cache_key,
    corpus_sha256,
    default_cache_dir,
    load_token_cache,
    write_token_cache,
)
from peer.train.sources import SkippedFiles, describe, iter_documents, list_files, stdlib_root
from peer.train.tokenizer import Tokenizer, byte_tokenizer
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

__all__ = [
    "BatchSampler",
    "Corpus",
    "PeekSampler",
    "SamplerState",
    "bits_per_byte",
    "hash_corpus",
    "is_validation",
    "list_files",
    "load_corpus",
    "peer_seed",
    "source_fingerprint",
    "stdlib_root",
    "validation_batch",
    "validation_bits_per_byte",
    "with_local_data",
]

logger = logging.getLogger(__name__)


def is_validation(name: str, fraction: float) -> bool:
    """Deterministic split: a document is held out when the hash of its name falls below ``fraction``."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True)
class Corpus:
    """Token streams of the two splits: 1-D integer tensors (uint16 or uint32 when memory-mapped from the cache)."""

    train: torch.Tensor
    validation: torch.Tensor
    train_files: int
    """Documents in the training split (files, or records), empty ones included."""
    validation_files: int
    corpus_sha256: str = ""
    """Content hash of the corpus (``data.corpus_sha256``); empty for a corpus built by hand."""
    corpus_bytes: int = 0
    """UTF-8 bytes of the corpus's texts (``data.corpus_bytes``); 0 for a corpus built by hand."""
    tokenizer: Tokenizer = field(default_factory=byte_tokenizer)
    skipped_files: int = 0
    """Binary or non-UTF-8 files of the source that were skipped (peer/train/sources.py), not trained on."""
    make_sampler: Callable[..., Any] | None = None
    """A sharded corpus (peer/shards/corpus.py): ``make_sampler(peer_id=..., run_key=..., seq_len=...,
    batch_sequences=...)`` builds the peer's sampler of its own shards; ``train`` is then empty. None:
    :class:`BatchSampler` over ``train``."""


def load_corpus(spec: DataSpec, *, cache_dir: Path | None = None) -> Corpus:
    """Hash, tokenize (once, into the cache) and memory-map the corpus the data spec names.

    Reads the whole corpus to hash it unless the cache holds its hash under the same fingerprint
    (:func:`hash_corpus`); the first call for a corpus and tokenizer also tokenizes it. A BPE is loaded by its hash (peer/train/bpe.py), never trained here.

    Args:
        cache_dir: where the token cache and the tokenizer store live; default: the user cache dir.

    Raises:
        ConfigError: bad input (see :func:`peer.train.sources.iter_documents`), a corpus or tokenizer hash
            other than the one the run pins, an unwritable cache dir, or a split too small to cut one
            sequence from.
    """
    if spec.source == "shards":
        raise ConfigError("a sharded corpus is read by peer/shards/corpus.py load_data, not load_corpus")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    fraction = spec.validation_fraction
    skipped = SkippedFiles()
    corpus_hash, documents, size = hash_corpus(spec, cache_dir, skipped)
    if skipped.paths:
        logger.warning("%s", skipped.summary(spec))
    if documents == 0:
        also = f" ({len(skipped.paths)} binary or non-UTF-8 file(s) skipped)" if skipped.paths else ""
        raise ConfigError(f"the corpus ({describe(spec)}) holds no documents{also}: point data.path at some text")
    if spec.corpus_bytes and size != spec.corpus_bytes:
        raise ConfigError(
            f"the corpus at {describe(spec)} has {size:,} bytes of text in {documents:,} documents, the run's "
            f"has {spec.corpus_bytes:,} (data.corpus_bytes): this copy is {'incomplete' if size < spec.corpus_bytes else 'another corpus'}; "
            "point --data (or data.path) at a full copy of the run's corpus (`peer data prepare` prints the local size)"
        )
    if spec.corpus_sha256 and corpus_hash != spec.corpus_sha256:
        raise ConfigError(
            f"the corpus at {describe(spec)} ({documents:,} documents) hashes to {corpus_hash}, the run pins "
            f"data.corpus_sha256 = {spec.corpus_sha256}: use the run's corpus: point --data (or data.path) at a "
            "copy of it, the same files under the same relative paths (`peer data prepare` prints the local hash)"
        )

    try:
        tokenizer = load_tokenizer(spec, cache_dir=cache_dir)
        key = cache_key(corpus_hash, tokenizer.sha256, fraction)
        cached = load_token_cache(cache_dir, key)
        if cached is None:
            logger.info("tokenizing the corpus (%s) into %s", describe(spec), cache_dir)
            write_token_cache(
                cache_dir,
                key,
                iter_documents(spec),
                is_validation=lambda n: is_validation(n, fraction),
                encode_batch=tokenizer.encode_batch,
                eos_id=tokenizer.eos_id,
                dtype=tokenizer.token_dtype,
                corpus=corpus_hash,
                tokenizer=tokenizer.sha256,
            )
            cached = load_token_cache(cache_dir, key)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the token cache in {str(cache_dir)!r} ({exc.strerror}): give the peer a writable --data-dir"
        ) from exc
    assert cached is not None, "a token cache just written must load"
    info, train, validation = cached
    need = spec.seq_len_tokens + 1
    for stream, name in ((train, "train"), (validation, "validation")):
        if len(stream) < need:
            raise ConfigError(
                f"the {name} split of the corpus ({describe(spec)}) has {len(stream)} tokens, fewer than one "
                f"sequence of {need}: use more text or change data.validation_fraction"
            )
    return Corpus(
        train=torch.from_numpy(train),
        validation=torch.from_numpy(validation),
        train_files=info.train_documents,
        validation_files=info.validation_documents,
        corpus_sha256=corpus_hash,
        corpus_bytes=size,
        tokenizer=tokenizer,
        skipped_files=len(skipped.paths),
    )


HASH_CACHE_FORMAT = "corpus-hash-v1"
RACY_MTIME_S = 2.0
"""A file modified less than this long before its fingerprint was taken may change again within
the file system's timestamp granularity without its modification time moving: a hash read from such
files is not cached (the next start hashes again, as git treats a "racily clean" entry)."""


def source_fingerprint(spec: DataSpec) -> tuple[str, float]:
    """SHA-256 (hex) over what the corpus is read from: the source kind, the text field, the root
    directory and, for each file in corpus order, its relative path, size in bytes and modification
    time (ns); and the newest of those modification times (s since the epoch). Stats the files,
    reads none of them.

    Raises:
        ConfigError: the path is missing, or holds no file of the source's kind (as reading it would).
    """
    if spec.source == "hf-dataset":
        root = Path(spec.path).expanduser()
        if not spec.path or not root.exists():
            next(iter_documents(spec), None)  # raises the reader's ConfigError, which says what to do
            raise ConfigError(f"data.path {spec.path!r} does not exist")
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        root = root if root.is_dir() else root.parent
    else:
        root, files = list_files(spec)
    digest = hashlib.sha256(f"{HASH_CACHE_FORMAT}\0{spec.source}\0{spec.text_field}\0{root}".encode())
    newest = 0
    for path in files:
        st = path.stat()
        digest.update(f"\0{path.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        newest = max(newest, st.st_mtime_ns)
    return digest.hexdigest(), newest / 1e9


def hash_corpus(spec: DataSpec, cache_dir: Path, skipped: SkippedFiles) -> tuple[str, int, int]:
    """The corpus's SHA-256 (peer/train/cache.py ``corpus_sha256``), its documents and its bytes of
    text: from ``<cache_dir>/corpus-<fingerprint>.json`` when the source's files are as they were
    when it was written (same paths, sizes and modification times, :func:`source_fingerprint`), else
    read and hashed, and recorded there (unless a file changed in the last :data:`RACY_MTIME_S`, or
    while it was read). ``skipped`` gets the binary or non-UTF-8 files either way.

    Raises:
        ConfigError: as :func:`peer.train.sources.iter_documents`. An unwritable or unreadable cache
            only costs the read: it is logged at debug level.
    """
    fingerprint, newest = source_fingerprint(spec)
    entry = cache_dir / f"corpus-{fingerprint[:32]}.json"
    try:
        held = json.loads(entry.read_text(encoding="utf-8"))
        if held["format"] == HASH_CACHE_FORMAT and held["fingerprint"] == fingerprint:
            skipped.paths[:] = [str(p) for p in held["skipped"]]
            skipped.reasons[:] = [str(r) for r in held["skipped_reasons"]]
            return str(held["corpus_sha256"]), int(held["documents"]), int(held["bytes"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.debug("ignoring the corpus hash cached in %s: %s", entry, exc)
    taken = time.time()
    corpus_hash, documents, size = corpus_sha256(iter_documents(spec, skipped))
    if taken - newest < RACY_MTIME_S or source_fingerprint(spec)[0] != fingerprint:
        return corpus_hash, documents, size
    record = {
        "format": HASH_CACHE_FORMAT,
        "fingerprint": fingerprint,
        "corpus_sha256": corpus_hash,
        "documents": documents,
        "bytes": size,
        "skipped": skipped.paths,
        "skipped_reasons": skipped.reasons,
    }
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write(entry, lambda f: f.write(json.dumps(record).encode("utf-8")))
    except OSError as exc:
        logger.debug("could not cache the corpus hash in %s: %s", entry, exc)
    return corpus_hash, documents, size


def with_local_data(spec: DataSpec, data_path: Path | str | None, *, run: str) -> DataSpec:
    """The run's data spec as this peer reads it: from its own copy of the corpus at ``data_path``
    (``peer join --data``), checked later by :func:`load_corpus` against the run's
    ``data.corpus_sha256``. A run names its corpus by content; where each volunteer keeps it is theirs.

    Args:
        spec: the run's ``[data]`` section.
        data_path: this peer's copy (a file or directory), or None to read the run's own ``data.path``.
        run: how to name the run in messages, e.g. ``run 3f2a... (web-1b)``.

    Returns:
        ``spec`` with ``path`` replaced by ``data_path`` (unchanged when it is None).

    Raises:
        ConfigError: ``--data`` for a python-stdlib run, ``--data`` for a run that pins no corpus hash
            (the copy could not be checked), or no ``--data`` for a run that names its corpus by hash only.
    """
    if spec.source == "shards":  # a local directory of shards is one more source, each shard hash-checked
        return spec if data_path is None else dataclasses.replace(spec, path=str(data_path))
    if data_path is None:
        if spec.source != "python-stdlib" and not spec.path:
            raise ConfigError(
                f"{run} names its corpus by content only ({spec.source}, data.corpus_sha256 = "
                f"{spec.corpus_sha256}): pass --data PATH pointing at your copy of it"
            )
        return spec
    if spec.source == "python-stdlib":
        raise ConfigError(
            f"--data {str(data_path)!r}: {run} trains on the Python standard library, which every "
            "machine has; drop --data"
        )
    if not spec.corpus_sha256:
        raise ConfigError(
            f"--data {str(data_path)!r} cannot be checked: {run} pins no data.corpus_sha256; add the "
            "hash `peer data prepare` prints to the run's [data] section, or set data.path in your "
            "--run file"
        )
    return dataclasses.replace(spec, path=str(data_path))


def bits_per_byte(nats_per_token: float, tokens: int, num_bytes: int) -> float:
    """Loss in bits per UTF-8 byte of text: comparable across tokenizers (nats/token × tokens / bytes / ln 2).

    Raises:
        ValueError: ``num_bytes`` is not positive.
    """
    if num_bytes <= 0:
        raise ValueError(f"num_bytes = {num_bytes}: bits per byte needs text of at least one byte")
    return nats_per_token * tokens / num_bytes / math.log(2)


def validation_bits_per_byte(nats_per_token: float, windows: torch.Tensor, tokenizer: Tokenizer) -> float:
    """Bits per byte of a loss measured on ``windows`` (int64, (sequences, seq_len + 1)), e.g. by
    :func:`peer.train.model.evaluate` on :func:`validation_batch`; the targets ``windows[:, 1:]``
    stand for ``tokenizer.token_bytes`` bytes each (specials, such as EOS, for none)."""
    targets = windows[:, 1:]
    num_bytes = int(np.asarray(tokenizer.token_bytes)[targets.numpy()].sum())
    return bits_per_byte(nats_per_token, targets.numel(), num_bytes)


def peer_seed(peer_id: str, salt: int = 0) -> int:
    """A 63-bit RNG seed derived from a peer id, so each peer samples its own shard."""
    return int.from_bytes(hashlib.sha256(f"{peer_id}:{salt}".encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class SamplerState:
    """Where a :class:`BatchSampler` stands in its shard, for checkpoints."""

    seed: int
    """The seed the sampler started from (:func:`peer_seed`); a state only fits a sampler of the same seed."""
    batches_drawn: int
    """Batches drawn since the seed."""
    rng: torch.Tensor
    """The generator's state after those draws: 1-D uint8 (``torch.Generator.get_state``); for a
    sharded corpus, the state the current shard's window order was drawn from."""
    shard: int = -1
    """Sharded corpus (peer/shards/stream.py): shards this peer consumed; -1: a :class:`BatchSampler`'s state."""
    shard_offset: int = 0
    """Sharded corpus: windows read from the current shard."""


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from the train stream: this peer's shard.

    Its position (:meth:`state`) goes into the checkpoint, so a restarted peer continues its
    sequence of batches instead of replaying the ones it already trained on.

    Args:
        stream: 1-D integer token stream (int16, or uint16/uint32 as memory-mapped from the token cache).
        seq_len: tokens per training sequence (inputs); targets are shifted by one.
        batch_sequences: sequences per batch.
        seed: RNG seed (see :func:`peer_seed`).
    """

    def __init__(self, stream: torch.Tensor, *, seq_len: int, batch_sequences: int, seed: int):
        self.stream, self.seq_len, self.batch_sequences = stream, seq_len, batch_sequences
        self.seed, self.batches_drawn = seed, 0
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        """An int64 tensor of shape (batch_sequences, seq_len + 1)."""
        high = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (self.batch_sequences,), generator=self.generator)
        self.batches_drawn += 1
        offsets = torch.arange(self.seq_len + 1)
        return self.stream[starts[:, None] + offsets[None, :]].to(torch.int64)

    def state(self) -> SamplerState:
        """This sampler's position (a copy: later draws do not change it)."""
        return SamplerState(seed=self.seed, batches_drawn=self.batches_drawn, rng=self.generator.get_state())

    def load_state(self, state: SamplerState) -> None:
        """Continue from ``state``: the next batch is the one the saved sampler would have drawn next.

        Raises:
            ValueError: the state is of another seed (another peer's shard) or its generator state
                is malformed; this sampler is left unchanged.
        """
        if state.seed != self.seed:
            raise ValueError(f"the data position is of seed {state.seed}, this peer samples with seed {self.seed}")
        if state.shard >= 0:
            raise ValueError(
                f"the data position is in shard {state.shard} of a sharded corpus, this run reads a whole corpus"
            )
        if state.batches_drawn < 0:
            raise ValueError(f"batches_drawn = {state.batches_drawn} is negative")
        generator = torch.Generator()
        try:
            generator.set_state(state.rng.contiguous())
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"the data position's generator state is malformed ({exc})") from exc
        self.generator, self.batches_drawn = generator, state.batches_drawn


class PeekSampler:
    """A sampler (:class:`BatchSampler` or peer/shards/stream.py ``ShardSampler``) whose next batches
    can be read ahead (:meth:`peek`) without changing which batches training gets: the batches read
    ahead are the ones :meth:`next_batch` returns next, in order, and :meth:`state` is the position
    before the first of them still ahead, so a checkpoint taken in between trains on them after a
    restart.

    Args:
        sampler: the sampler the batches come from (drawn from only through this wrapper).
    """

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self.seq_len, self.batch_sequences = sampler.seq_len, sampler.batch_sequences
        self._ahead: list[tuple[torch.Tensor, SamplerState]] = []
        """Batches read ahead, each with the sampler's position before it was drawn."""

    def peek(self, count: int = 1) -> list[torch.Tensor]:
        """The ``count`` batches :meth:`next_batch` returns next, each int64 (batch_sequences,
        seq_len + 1), drawn now where they were not (the caller must not modify them).

        Raises:
            ValueError: ``count`` < 1.
        """
        if count < 1:
            raise ValueError(f"count = {count}: expected at least one batch")
        while len(self._ahead) < count:
            before = self.sampler.state()
            self._ahead.append((self.sampler.next_batch(), before))
        return [batch for batch, _ in self._ahead[:count]]

    def next_batch(self) -> torch.Tensor:
        """The next batch: the first one read ahead, if any."""
        return self._ahead.pop(0)[0] if self._ahead else self.sampler.next_batch()

    @property
    def batches_drawn(self) -> int:
        """Batches handed to training (those read ahead not counted)."""
        return self.sampler.batches_drawn - len(self._ahead)

    def state(self) -> SamplerState:
        """The position before the batches still read ahead (see the class)."""
        return self._ahead[0][1] if self._ahead else self.sampler.state()

    def load_state(self, state: SamplerState) -> None:
        """Continue from ``state`` (the batches read ahead are dropped); errors as the sampler's."""
        self.sampler.load_state(state)
        self._ahead = []

    def close(self) -> None:
        """Close the sampler (a ``ShardSampler``'s loader thread); nothing for a :class:`BatchSampler`."""
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()


def validation_batch(corpus: Corpus, spec: DataSpec) -> torch.Tensor:
    """The fixed validation subset: ``validation_sequences`` windows evenly spaced over the split.

    Returns an int64 tensor of shape (validation_sequences, seq_len_tokens + 1), identical for
    every peer of a run with the same corpus and tokenizer.
    """
    stream, width = corpus.validation, spec.seq_len_tokens + 1
    high = stream.numel() - width
    starts = torch.linspace(0, high, spec.validation_sequences).round().to(torch.int64)
    return stream[starts[:, None] + torch.arange(width)[None, :]].to(torch.int64)
