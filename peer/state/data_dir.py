"""One peer per data directory: an advisory lock that ``peer join`` holds while it runs.

A data directory holds a peer's identity (its peer id), its address book and its checkpoints. Two
peers started on one directory (a volunteer with two cards who starts ``peer join`` twice with the
defaults) would announce one peer id from two places and write each other's checkpoints; each
checkpoint write also clears the temporaries beside it, so one peer would break the other's writes.
The second peer is refused instead, naming the directory and the process that holds it.

The lock is ``flock`` on ``DATA_DIR/.peer.lock`` (the file holds the holder's pid, for the message).
It lives as long as the open file: it goes with the process, even after ``kill -9``, and is closed
in every child forked from the holder (the DHT and averager processes), so a dead peer's children
never keep it from a restart. That last part is why this is not the ``filelock`` package: its lock
file stays open in forked children, which would hold the lock for as long as they live.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from protocol.errors import ConfigError

LOCK_FILE = ".peer.lock"

_held: set[int] = set()
"""File descriptors of the locks this process holds (closed in forked children)."""


def _close_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def hold_data_dir(data_dir: Path) -> Iterator[Path]:
    """Hold ``data_dir`` for this peer until the block ends; creates the directory if needed.

    Yields:
        The lock file's path.

    Raises:
        ConfigError: another process holds the directory (the message names it and its pid), or
            the directory cannot be created or locked (not writable). Nothing is written to the
            directory then.
    """
    data_dir = Path(data_dir)
    path = data_dir / LOCK_FILE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"data dir {data_dir}: cannot use it ({exc.strerror}); give a writable --data-dir") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"data dir {data_dir} is in use by another peer (pid {holder}): each peer needs its own "
            "--data-dir (its identity and checkpoints live there); stop the other one or give this "
            "one another directory"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"data dir {data_dir}: cannot lock {path} ({exc.strerror}); give a local --data-dir") from exc
    _held.add(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield path
    finally:
        _held.discard(fd)
        os.close(fd)  # releases the lock; the file stays (removing it could race a new holder)
