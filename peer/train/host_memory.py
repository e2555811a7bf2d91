"""Host memory for a peer's training process: keep freed tensor memory for reuse (glibc's malloc).

A peer allocates and frees the same large host buffers every round: this round's Δ, the next start
point, eager's preview, the copies a checkpoint takes of θ and AdamW's moments, the state
snapshot. glibc's malloc (Linux) serves a block above its mmap threshold with a fresh mapping and
returns freed memory at the top of a heap to the kernel once more than the trim threshold is
free. Both thresholds start small (128 KiB each) and rise only as far as the largest block
freed so far, so memory freed in bulk at a round's end goes back to the kernel, and the next
round's tensors fault their pages in again, each one zero-filled by the kernel before torch
writes it, which makes a fresh tensor cost several times a copy into a held buffer.

:func:`tune_host_allocator` sets, through ``mallopt(3)``:

* ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's ceiling for it on 64-bit): blocks up to that size come
  from the heap, so a freed one is reused, not unmapped. Larger tensors (a 1B model's embedding)
  are still mapped and unmapped each time, as before.
* ``M_TRIM_THRESHOLD`` to 256 MiB: up to that much free memory at a heap's top stays with the
  process for the next round instead of going back to the kernel.
* ``M_ARENA_MAX`` to 1: every thread allocates from one heap, so what one thread frees serves
  another's next tensor (an all-reduce's pieces, decoded on the averager's event loop and encoded
  in its codec thread; the round loop's Δ and the checkpoint writer's copy of θ) instead of each
  thread's arena keeping its own freed memory. Threads then share that heap's lock. Threads that
  already allocated keep their arenas, so the call comes before any thread starts.

The price is resident memory the process keeps after freeing it, at most about 256 MiB above what
it holds at its peak anyway. Giving all of it back after every round (``malloc_trim``) was tried:
the next round's all-reduce faulted its pages in again and ran about as slowly as a peer's first.
Nothing is changed where the C library is not glibc (macOS, musl) or when
``LOCOSWARM_HOST_ALLOCATOR=system`` is set (glibc's own settings, for comparing;
bench/overlap_rig.py measures both).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from protocol.errors import ConfigError

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter numbers (malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
ARENA_MAX = 1
ENV = "LOCOSWARM_HOST_ALLOCATOR"
"""``system`` leaves glibc's settings as they are; unset or ``tuned`` sets those above."""


def tune_host_allocator() -> str:
    """Set glibc's mmap and trim thresholds and its arena count for this process (see the module
    docstring). Call once, early, from the process that trains, before it starts threads: it affects
    every thread and every block allocated after the call, except threads that already have an
    arena of their own.

    Returns:
        What was done, for the log: ``"tuned"``, ``"system"`` (``LOCOSWARM_HOST_ALLOCATOR=system``),
        ``"not glibc"`` or ``"mallopt refused"`` (glibc rejected a value; the others may be set).

    Raises:
        ConfigError: ``LOCOSWARM_HOST_ALLOCATOR`` is neither ``tuned`` nor ``system``; nothing set.
    """
    choice = os.environ.get(ENV, "tuned").strip().lower() or "tuned"
    if choice not in ("tuned", "system"):
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: use 'tuned' (the default) or 'system' (glibc's own settings)")
    if choice == "system":
        return "system"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: setting either one turns glibc's dynamic adjustment of both off
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and ok
    ok = mallopt(M_ARENA_MAX, ARENA_MAX) == 1 and ok
    result = "tuned" if ok else "mallopt refused"
    logger.debug("host allocator: %s", result)
    return result
