"""The shards held on this machine: one directory, at most ``--data-cache-gb`` of files.

A shard is stored as ``<sha256>.<suffix>`` (content-addressed: two runs sharing a shard share the
file). Files pinned (the validation shards, the shard being read) are never evicted; the others
(shards already tokenized, kept so that other peers can fetch them from this one) go oldest first
when room is needed for the next one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from peer.shards.fetch import Fetcher
from peer.shards.index import Shard, file_sha256
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)


class ShardStore:
    """A directory of shard files under a byte cap.

    Args:
        root: the directory (created).
        cap_bytes: most bytes of shard files (``.part`` files of downloads in flight included).

    Thread-safe: the loader thread fetches while the serving side reads.
    """

    def __init__(self, root: Path, cap_bytes: int):
        self.root, self.cap_bytes = Path(root), int(cap_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pinned: set[str] = set()
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def path(self, shard: Shard) -> Path:
        return self.root / f"{shard.sha256}{Path(shard.name).suffix}"

    def holds(self, sha256: str) -> Path | None:
        """The file of the shard with this hash, if held here."""
        for suffix in (".parquet", ".jsonl"):
            p = self.root / f"{sha256}{suffix}"
            if p.is_file():
                return p
        return None

    def used_bytes(self) -> int:
        """Bytes of the files in the directory now (a file removed meanwhile counts 0)."""
        total = 0
        for p in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
        return total

    def _make_room(self, need: int, shard: Shard) -> None:
        used = self.used_bytes()
        if used + need <= self.cap_bytes:
            return
        victims = sorted(
            (p for p in self.root.iterdir() if p.suffix in (".parquet", ".jsonl") and p.stem not in self.pinned),
            key=lambda p: p.stat().st_mtime,
        )
        for victim in victims:
            size = victim.stat().st_size
            victim.unlink()
            logger.info("evicted shard file %s (%d bytes) to stay under the data cache cap", victim.name, size)
            used -= size
            if used + need <= self.cap_bytes:
                return
        raise ConfigError(
            f"--data-cache-gb {self.cap_bytes / 1e9:g} cannot hold shard {shard.name} ({shard.size:,} bytes) next to the "
            f"{used:,} bytes of shards in use (validation shards and the shard being read): raise --data-cache-gb"
        )

    def get(self, shard: Shard, fetcher: Fetcher, *, pin: bool = False) -> Path:
        """The local file of ``shard``, fetched if it is not held (or no longer hashes to its
        SHA-256), hash-checked; pinned when ``pin``.

        Raises:
            ConfigError: the cap cannot hold it next to the pinned shards.
            ShardUnavailable: no source delivered it (fetch.py).
        """
        dest = self.path(shard)
        with self._lock:
            if pin:
                self.pinned.add(shard.sha256)
            if dest.is_file():
                if file_sha256(dest) == shard.sha256:  # checked again before every use: the disk may lie too
                    os.utime(dest)
                    return dest
                logger.warning(
                    "shard %s held in %s no longer hashes to %s: fetching it again", shard.name, dest, shard.sha256
                )
                dest.unlink()
            part = dest.with_name(dest.name + ".part")
            have = part.stat().st_size if part.exists() else 0
            self.pinned.add(shard.sha256)  # not evicted while it downloads
            self._make_room(shard.size - have, shard)
        try:
            fetcher.fetch(shard, dest)
        finally:
            with self._lock:
                if not pin:
                    self.pinned.discard(shard.sha256)
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, self.used_bytes())
        return dest

    def pin(self, shard: Shard) -> None:
        with self._lock:
            self.pinned.add(shard.sha256)

    def unpin(self, shard: Shard) -> None:
        with self._lock:
            self.pinned.discard(shard.sha256)
