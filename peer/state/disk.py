"""Free disk space, checked before a peer trains: room for two checkpoints in its data directory and
for its shard cache (issue #68, item 7), so a full disk is found at start, in one line, not when
the first checkpoint fails to write.

Two checkpoints: a checkpoint is written to a temporary file beside the old one and renamed over
it (peer/state/checkpoint.py), so for a moment both are on disk. The shard cache holds up to
``--data-cache-gb`` of a sharded run's shards (peer/shards/store.py). Both may live on one file
system (then their needs add up) or on two (each is checked against its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DiskNeed:
    """Bytes a peer will write under one directory."""

    directory: Path
    """Where the bytes go (it need not exist yet: its nearest existing parent's file system counts)."""
    need_bytes: int
    """Bytes still to be written there, beyond what it holds now, >= 0."""
    what: str
    """What they are, for the message: ``2 checkpoints of 2.5 GB``."""
    fix: str
    """What moves or shrinks them, for the message: ``pass --data-dir DIR on a disk with room``."""

    def __post_init__(self) -> None:
        if self.need_bytes < 0:
            raise ValueError(f"need_bytes = {self.need_bytes}: must be >= 0")


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (the file system it will be created on)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def dir_bytes(directory: Path) -> int:
    """Bytes of the files directly in ``directory`` (0 when it does not exist; a file removed meanwhile counts 0)."""
    total = 0
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for p in Path(directory).iterdir():
            with contextlib.suppress(FileNotFoundError):
                if p.is_file():
                    total += p.stat().st_size
    return total


def check_disk_space(needs: list[DiskNeed], *, disk_usage: Callable[[Any], Any] = shutil.disk_usage) -> None:
    """Refuse to train when a file system lacks the free space ``needs`` ask of it.

    Needs on one file system (same ``st_dev``) are added up and checked together.

    Args:
        needs: what will be written where.
        disk_usage: ``shutil.disk_usage`` (tests pass a fake); its ``free`` counts, in bytes.

    Raises:
        ConfigError: a file system has less free space than its needs (exit 78); one line naming
            the directory, the free and the needed GB, what needs them and how to make room.
    """
    by_device: dict[int, list[DiskNeed]] = {}
    for need in needs:
        if need.need_bytes > 0:
            by_device.setdefault(os.stat(_existing(need.directory)).st_dev, []).append(need)
    for group in by_device.values():
        total = sum(n.need_bytes for n in group)
        free = int(disk_usage(str(_existing(group[0].directory))).free)
        if free >= total:
            continue
        where = " and ".join(str(n.directory) for n in group)
        parts = " + ".join(f"{n.need_bytes / GB:.1f} GB for {n.what}" for n in group)
        fixes = "; or ".join(dict.fromkeys(n.fix for n in group))
        raise ConfigError(
            f"not enough free disk space: {where} has {free / GB:.1f} GB free, this peer needs "
            f"{total / GB:.1f} GB there ({parts}): free some space, or {fixes}"
        )


def checkpoint_need(checkpoint: Path, checkpoint_bytes: int) -> DiskNeed:
    """Room for two checkpoints of ``checkpoint_bytes`` at ``checkpoint`` (the old one and the one
    being written), less what the checkpoint there now takes."""
    held = checkpoint.stat().st_size if checkpoint.is_file() else 0
    return DiskNeed(
        directory=checkpoint.parent,
        need_bytes=max(0, 2 * checkpoint_bytes - held),
        what=f"2 checkpoints of {checkpoint_bytes / GB:.2f} GB",
        fix="pass --data-dir DIR on a disk with room",
    )


def shard_cache_need(shard_dir: Path, *, cap_bytes: int, run_bytes: int) -> DiskNeed:
    """Room for the shard cache at ``shard_dir`` to grow to ``cap_bytes`` (``--data-cache-gb``), or to
    the run's whole shard list (``run_bytes``) when that is smaller, less what it holds now."""
    return DiskNeed(
        directory=shard_dir,
        need_bytes=max(0, min(cap_bytes, run_bytes) - dir_bytes(shard_dir)),
        what=f"the run's shards (--data-cache-gb {cap_bytes / GB:g}, the run's {run_bytes / GB:.1f} GB)",
        fix="lower --data-cache-gb, or move the shard cache with $LOCOSWARM_CACHE_DIR",
    )
