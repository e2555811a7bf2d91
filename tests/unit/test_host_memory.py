"""peer/train/host_memory.py: glibc's thresholds set for a training process, or left alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from peer.train import host_memory
from protocol.errors import ConfigError

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]


def run_probe(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter at the repository's root, with ``LOCOSWARM_HOST_ALLOCATOR``
    set to ``env_value`` (None: unset) and glibc's own ``MALLOC_ARENA_MAX`` unset."""
    env = {k: v for k, v in os.environ.items() if k not in (host_memory.ENV, "MALLOC_ARENA_MAX")}
    if env_value is not None:
        env[host_memory.ENV] = env_value
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )


# Allocates a 64 MiB-in-8-MiB-blocks tensor list, frees it, and prints how much of it the process
# still holds resident (MiB): freed memory glibc kept for reuse, or gave back to the kernel.
PROBE = textwrap.dedent("""
    import torch
    from peer.train.host_memory import tune_host_allocator
    print(tune_host_allocator())
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    before = rss_mib()
    blocks = [torch.ones(2 * 2**20) for _ in range(8)]  # 8 x 8 MiB, each page written
    held = rss_mib()
    del blocks
    print(held - before, rss_mib() - before)
""")


def probe(env_value: str | None) -> tuple[str, float, float]:
    out = run_probe(PROBE, env_value).stdout.split("\n")
    grown, kept = map(float, out[1].split())
    return out[0], grown, kept


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (Linux)")
def test_tuned_process_keeps_freed_blocks_and_system_returns_them():
    result, grown, kept = probe(None)
    assert result == "tuned"
    assert grown >= 60  # the 64 MiB were resident while held
    assert kept >= 0.9 * grown  # freed, but kept by the process for the next round's tensors
    result, grown, kept = probe("system")
    assert result == "system"
    assert grown >= 60
    assert kept <= 0.2 * grown  # glibc's own thresholds: each 8 MiB block was its own mapping, unmapped


def test_system_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "system")
    with mock.patch.object(host_memory.ctypes, "CDLL") as cdll:
        assert host_memory.tune_host_allocator() == "system"
    cdll.assert_not_called()


def test_unknown_setting_names_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    with mock.patch.object(host_memory.ctypes, "CDLL") as cdll, pytest.raises(ConfigError) as err:
        host_memory.tune_host_allocator()
    assert "'jemalloc'" in str(err.value) and "'tuned'" in str(err.value) and "'system'" in str(err.value)
    cdll.assert_not_called()


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.delenv(host_memory.ENV, raising=False)
    with (
        mock.patch.object(host_memory.platform, "libc_ver", return_value=("", "")),
        mock.patch.object(host_memory.ctypes, "CDLL") as cdll,
    ):
        assert host_memory.tune_host_allocator() == "not glibc"
    cdll.assert_not_called()


def test_a_refused_value_is_reported(monkeypatch):
    monkeypatch.delenv(host_memory.ENV, raising=False)
    monkeypatch.setattr(host_memory.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    with mock.patch.object(host_memory.ctypes, "CDLL") as cdll:
        cdll.return_value.mallopt.side_effect = [1, 0, 1]
        assert host_memory.tune_host_allocator() == "mallopt refused"
    calls = cdll.return_value.mallopt.call_args_list
    assert [c.args for c in calls] == [
        (host_memory.M_TRIM_THRESHOLD, host_memory.TRIM_THRESHOLD_BYTES),
        (host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_THRESHOLD_BYTES),
        (host_memory.M_ARENA_MAX, host_memory.ARENA_MAX),
    ]


# Two threads, both alive, each allocate 8 MiB tensors; glibc then prints its arenas to stderr.
ARENA_PROBE = textwrap.dedent("""
    import ctypes, threading, torch
    from peer.train.host_memory import tune_host_allocator
    print(tune_host_allocator())
    started, done = threading.Barrier(3), threading.Event()
    def allocate():
        blocks = [torch.ones(2 * 2**20) for _ in range(4)]
        started.wait()
        done.wait()
    threads = [threading.Thread(target=allocate) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    ctypes.CDLL(None).malloc_stats()
    done.set()
    for t in threads:
        t.join()
""")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (Linux)")
@pytest.mark.parametrize("env_value", [None, "system"])
def test_a_tuned_process_keeps_every_threads_tensors_in_one_heap(env_value):
    """Tuned, the threads share one arena (what one frees, another's next tensor reuses: the
    averager's event loop and codec thread, the round loop and the checkpoint writer); glibc's own
    setting gives each thread an arena of its own."""
    run = run_probe(ARENA_PROBE, env_value)
    arenas = sum(line.startswith("Arena ") for line in run.stderr.splitlines())
    if env_value is None:
        assert arenas == 1
    else:
        assert arenas >= 3  # the main thread's and one per allocating thread at least
