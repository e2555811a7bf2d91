"""The shard list of a run: each shard's name, size and SHA-256, and the hash that binds it to the run.

``shards.json`` is canonical JSON (sorted keys, no spaces, shards sorted by name, UTF-8)::

    {"format": "locoswarm-shards-v1", "shards": [{"name": "part-00000.parquet", "sha256": "...", "size": 123}, ...]}

Its SHA-256 is ``data.shards_sha256``, part of the run id; a list whose bytes hash otherwise is
refused. The list lives next to the shards (a local directory, an HTTP base URL, a dataset
repository), so a manifest stays small whatever the shard count.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ConfigError

INDEX_NAME = "shards.json"
FORMAT = "locoswarm-shards-v1"
SUFFIXES = (".parquet", ".jsonl")
MAX_INDEX_BYTES = 64 << 20
"""Largest shards.json read (about 500,000 shards)."""
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class Shard:
    """One shard file: ``name`` is its path relative to the corpus root ('/'-separated)."""

    name: str
    size: int
    """Bytes of the file."""
    sha256: str
    """Hex SHA-256 of the file's bytes."""


@dataclass(frozen=True)
class ShardIndex:
    """The shards of a corpus, sorted by name."""

    shards: tuple[Shard, ...]

    def encode(self) -> bytes:
        """The canonical bytes of ``shards.json``."""
        data = {"format": FORMAT, "shards": [{"name": s.name, "sha256": s.sha256, "size": s.size} for s in self.shards]}
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of :meth:`encode`: ``data.shards_sha256``."""
        return hashlib.sha256(self.encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def held_out(self, count: int) -> tuple[Shard, ...]:
        """The ``count`` validation shards: those whose names hash lowest (independent of the order
        shards were written in), in name order."""
        ranked = sorted(self.shards, key=lambda s: hashlib.sha256(s.name.encode("utf-8")).digest())
        chosen = {s.name for s in ranked[:count]}
        return tuple(s for s in self.shards if s.name in chosen)

    def training(self, held_out: int) -> tuple[Shard, ...]:
        """The shards peers train on: all but :meth:`held_out`, in name order."""
        out = {s.name for s in self.held_out(held_out)}
        return tuple(s for s in self.shards if s.name not in out)


def _check_name(name: object, where: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
        or not name.endswith(SUFFIXES)
    ):
        raise ConfigError(
            f"{where}: shard name {name!r} is not a relative path of a {' or '.join(SUFFIXES)} file: "
            "rebuild the list with `peer data prepare`"
        )
    return name


def parse_index(data: bytes, *, expected_sha256: str | None, where: str) -> ShardIndex:
    """Read ``shards.json`` bytes, checked against the run's hash first.

    Args:
        expected_sha256: ``data.shards_sha256``; None: not checked (``peer data prepare``).
        where: the list's origin, for messages.

    Raises:
        ConfigError: the bytes hash otherwise, are not a shard list, or name a shard twice or unsafely.
    """
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise ConfigError(
            f"the shard list at {where} hashes to {digest}, the run pins data.shards_sha256 = {expected_sha256}: "
            "it is another corpus's list; point the source at the run's shards"
        )
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        shards = tuple(Shard(_check_name(s["name"], where), int(s["size"]), str(s["sha256"])) for s in doc["shards"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"the shard list at {where} is not a {FORMAT} list ({exc}): rebuild it with `peer data prepare`"
        ) from exc
    names = [s.name for s in shards]
    if names != sorted(set(names)):
        raise ConfigError(
            f"the shard list at {where} names shards twice or out of order: rebuild it with `peer data prepare`"
        )
    for s in shards:
        if s.size < 1 or len(s.sha256) != 64 or any(c not in "0123456789abcdef" for c in s.sha256):
            raise ConfigError(
                f"the shard list at {where} gives shard {s.name!r} size {s.size} and hash {s.sha256!r}: rebuild it"
            )
    return ShardIndex(shards)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def index_directory(root: Path) -> ShardIndex:
    """Hash every ``.parquet`` and ``.jsonl`` file under ``root`` (recursively, hidden files skipped).

    Raises:
        ConfigError: ``root`` is not a directory, or holds fewer than two shard files.
    """
    if not root.is_dir():
        raise ConfigError(
            f"{str(root)!r} is not a directory: point `peer data prepare --shards` at the directory of shard files"
        )
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in SUFFIXES and not any(x.startswith(".") for x in p.relative_to(root).parts)
    )
    if len(files) < 2:
        raise ConfigError(
            f"{str(root)!r} holds {len(files)} .parquet/.jsonl file(s); a sharded corpus needs at least 2 "
            "(one to validate on, one to train on); for one file use data.source = 'parquet' or 'jsonl'"
        )
    return ShardIndex(tuple(Shard(p.relative_to(root).as_posix(), p.stat().st_size, file_sha256(p)) for p in files))


def hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when a listing or download fails: its HTTP errors, OSError,
    ValueError, and its HTTP client's transport errors (requests' are OSErrors, httpx's are not)."""
    from huggingface_hub.utils import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    found: list[type[BaseException]] = [
        HfHubHTTPError,
        EntryNotFoundError,
        LocalEntryNotFoundError,
        OSError,
        ValueError,
    ]
    for client in ("httpx", "httpx2"):
        with contextlib.suppress(ImportError, AttributeError):
            found.append(importlib.import_module(client).HTTPError)
    return tuple(found)


def index_hub_repo(repo: str, revision: str, *, endpoint: str | None = None, token: str | None = None) -> ShardIndex:
    """The shard list of a Hugging Face dataset repository at ``revision``, from its file listing
    (the LFS SHA-256 and size the hub records for each file): nothing is downloaded.

    Raises:
        ConfigError: the repository or revision cannot be listed, or a shard file is not in LFS
            (the hub records no SHA-256 for it).
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        entries = list(api.list_repo_tree(repo, revision=revision, repo_type="dataset", recursive=True))
    except hub_errors() as exc:
        raise ConfigError(
            f"cannot list dataset {repo} at {revision} ({exc}): check the repository and revision"
        ) from exc
    shards = []
    for entry in entries:
        path = getattr(entry, "path", "")
        if not path.endswith(SUFFIXES) or not hasattr(entry, "size"):
            continue
        lfs = getattr(entry, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        if not sha:
            raise ConfigError(
                f"{repo}/{path} at {revision} is not stored in LFS, so the hub gives no SHA-256: hash a local copy instead"
            )
        shards.append(Shard(_check_name(path, repo), int(entry.size), sha))
    if len(shards) < 2:
        raise ConfigError(
            f"dataset {repo} at {revision} holds {len(shards)} .parquet/.jsonl file(s); a sharded corpus needs at least 2"
        )
    return ShardIndex(tuple(sorted(shards, key=lambda s: s.name)))
