"""Corpus hashing and the on-disk token cache.

A corpus is identified by the SHA-256 over its documents in their deterministic order (each as its
name and its bytes, both length-prefixed, so no two corpora share a hash by shifting a boundary).
Its token streams (one per split, every document followed by EOS) are written once per corpus,
tokenizer and split to ``tokens-<key>.{train,validation}.bin`` as raw uint16 (uint32 for
vocabularies over 65,536 ids) plus ``tokens-<key>.json`` with their lengths, and memory-mapped on
every later load: a corpus larger than RAM is never held in memory.

Every file is written to a temporary name and renamed into place; the JSON comes last and a cache
counts only when it exists and the lengths it states match the files, so a killed write leaves
nothing that a later load would take for valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from peer.train.sources import Document

_FORMAT = "tokens-v1"
_CHUNK_BYTES = 4 << 20  # documents tokenized per batch: bounds memory, keeps BPE's batch encoder busy


def default_cache_dir() -> Path:
    """``$LOCOSWARM_CACHE_DIR``, else the user cache dir (platformdirs, e.g. ~/.cache/locoswarm).

    One cache per machine, not per data dir: entries are keyed by corpus and tokenizer hashes, so
    every peer of a run on this machine (``peer swarm``, several cards) tokenizes once, and the
    atomic writes make peers that build the same entry at once harmless.
    """
    if os.environ.get("LOCOSWARM_CACHE_DIR"):
        return Path(os.environ["LOCOSWARM_CACHE_DIR"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("locoswarm"))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file handle whose content appears at ``path`` only if the block completes.

    The content goes to a temporary file in the same directory, is flushed to disk and renamed over
    ``path``; on an exception the temporary file is removed and ``path`` is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a fresh binary file that replaces ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as handle:
        write(handle)


def corpus_sha256(documents: Iterable[Document]) -> tuple[str, int, int]:
    """Hex SHA-256 of a corpus, its number of documents and its size (UTF-8 bytes of the documents'
    texts, names not counted), from one streaming pass."""
    digest, count, size = hashlib.sha256(), 0, 0
    for doc in documents:
        name = doc.name.encode("utf-8")
        digest.update(len(name).to_bytes(8, "big") + name + len(doc.data).to_bytes(8, "big"))
        digest.update(doc.data)
        count += 1
        size += len(doc.data)
    return digest.hexdigest(), count, size


@dataclass(frozen=True)
class CacheInfo:
    """What ``tokens-<key>.json`` records about the two streams."""

    corpus_sha256: str
    tokenizer_sha256: str
    dtype: str
    train_tokens: int
    validation_tokens: int
    train_documents: int
    validation_documents: int


def cache_key(corpus: str, tokenizer: str, validation_fraction: float) -> str:
    """Name stem of the token cache of one corpus, tokenizer and split."""
    key = f"{_FORMAT}:{corpus}:{tokenizer}:{validation_fraction!r}"
    return "tokens-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _paths(cache_dir: Path, key: str) -> tuple[Path, Path, Path]:
    return cache_dir / f"{key}.train.bin", cache_dir / f"{key}.validation.bin", cache_dir / f"{key}.json"


def load_token_cache(cache_dir: Path, key: str) -> tuple[CacheInfo, np.ndarray, np.ndarray] | None:
    """The cached streams as 1-D memory maps (copy-on-write) with their info, or None when absent or partial."""
    train_path, val_path, meta_path = _paths(cache_dir, key)
    try:
        info = CacheInfo(**json.loads(meta_path.read_text(encoding="utf-8")))
        dtype = np.dtype(info.dtype)
        sizes = (train_path.stat().st_size, val_path.stat().st_size)
    except (OSError, ValueError, TypeError):
        return None
    if sizes != (info.train_tokens * dtype.itemsize, info.validation_tokens * dtype.itemsize):
        return None

    def mapped(path: Path, n: int) -> np.ndarray:
        # mode "c": writable pages of our own, so torch.from_numpy shares them without a warning.
        return np.memmap(path, dtype=dtype, mode="c", shape=(n,)) if n else np.zeros(0, dtype=dtype)

    return info, mapped(train_path, info.train_tokens), mapped(val_path, info.validation_tokens)


def write_token_cache(
    cache_dir: Path,
    key: str,
    documents: Iterable[Document],
    *,
    is_validation: Callable[[str], bool],
    encode_batch: Callable[[list[bytes]], list[np.ndarray]],
    eos_id: int,
    dtype: type,
    corpus: str,
    tokenizer: str,
) -> CacheInfo:
    """Tokenize ``documents`` in one streaming pass into the two split files, then record their info.

    Empty documents count as documents but add no tokens (not even EOS).
    """
    train_path, val_path, meta_path = _paths(cache_dir, key)
    tokens, docs = [0, 0], [0, 0]
    eos: np.ndarray = np.asarray([eos_id], dtype=dtype)
    with atomic_file(train_path) as train_f, atomic_file(val_path) as val_f:
        handles = (train_f, val_f)
        pending: list[tuple[int, bytes]] = []
        size = 0

        def flush() -> None:
            for (split, _), ids in zip(pending, encode_batch([d for _, d in pending])):
                handles[split].write(np.asarray(ids, dtype=dtype).tobytes() + eos.tobytes())
                tokens[split] += len(ids) + 1
            pending.clear()

        for doc in documents:
            split = int(is_validation(doc.name))
            docs[split] += 1
            if doc.data:
                pending.append((split, doc.data))
                size += len(doc.data)
            if size >= _CHUNK_BYTES:
                flush()
                size = 0
        flush()
    info = CacheInfo(
        corpus_sha256=corpus,
        tokenizer_sha256=tokenizer,
        dtype=np.dtype(dtype).name,
        train_tokens=tokens[0],
        validation_tokens=tokens[1],
        train_documents=docs[0],
        validation_documents=docs[1],
    )
    atomic_write(meta_path, lambda f: f.write(json.dumps(asdict(info), indent=1).encode()))
    return info
