"""Fuzzing every decoder and handler that reads what another peer sends (issue #17 item 5).

Each :class:`Target` takes one message (bytes as they arrive) and must either return or raise one
of its documented exception types; anything else is a crash. A message that takes longer than
``HANG_S`` is a hang (a wall-clock alarm interrupts it). Memory is the process's resident size
after a warm-up tenth of the messages against the end.

Messages are drawn by :func:`messages` from a target's valid seed messages: random bytes, bit
flips, truncations, appended bytes, length fields overwritten with extreme values, spliced seeds,
and, for msgpack payloads, the decoded object with a node swapped for another msgpack type (huge
and negative integers, NaN, deep nesting, long strings, bytes for text and back).

Handlers run in process, on an asyncio ``StreamReader`` fed with the message (then end of
stream) and a writer that counts what they answer: the state donor (peer/state/serve.py), the
state downloader reading a donor's answer (peer/state/download.py), the all-reduce stream
handler with a live session (peer/sync/allreduce.py), hivemind's ``rpc_join_group`` framing as
bounded here (peer/sync/hivemind_limits.py), and the reachability dial-back server
(peer/net/reachability.py). Used by bench/fuzz.py (1e5 messages) and tests/security/test_fuzz.py.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

HANG_S = 2.0
"""A message whose handling takes longer than this, s, is a hang (the slowest valid message of any
target takes a few milliseconds here)."""


class Hang(BaseException):
    """Raised by the alarm inside a target that ran past ``HANG_S`` (not an Exception: a target's own
    ``except Exception`` must not swallow it)."""


@dataclass(frozen=True)
class Target:
    name: str
    seeds: Sequence[bytes]
    """Valid messages, the starting points of mutation."""
    call: Callable[[bytes], Any]
    """Decode or handle one message."""
    allowed: tuple[type[BaseException], ...]
    """The documented exceptions: raising one of these is the target refusing the message."""
    msgpack_body: Callable[[bytes], tuple[bytes, bytes, bytes]] | None = None
    """Splits a seed into (prefix, msgpack body, suffix), for the type-swap mutations."""


@dataclass
class Result:
    target: str
    messages: int
    crashes: int
    hangs: int
    memory_growth_mb: float
    refused: int = 0
    """Messages the target refused with a documented exception (the rest were accepted)."""
    first_crash: str = ""


# ---------------------------------------------------------------- mutations

_EXTREME_U32 = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 1 << 24)


def _swap_value(value: Any, rng: random.Random) -> Any:
    choices = [
        2**64 - 1,
        -(2**63),
        -1,
        0,
        2**63,
        math.nan,
        math.inf,
        -math.inf,
        1e308,
        True,
        None,
        "",
        "x" * rng.choice((1, 255, 4096)),
        "\x1b[2J<script>",
        b"",
        b"\xff" * rng.choice((1, 16, 4096)),
        [],
        {},
        [value] * rng.choice((1, 2, 1000)),
        {"k": value},
        3.5,
    ]
    nested: Any = 0
    for _ in range(rng.choice((10, 100, 500))):
        nested = [nested]
    choices.append(nested)
    return rng.choice(choices)


def _mutate_object(obj: Any, rng: random.Random) -> Any:
    """A copy of ``obj`` with one node (or a dict key) replaced by a value of another type."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = rng.choice(list(obj))
        out = dict(obj)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.3:
            new_key = rng.choice((2**64 - 1, -1, "", b"k", None, 3.5, True, f"{key}x"))
            out[new_key] = out.pop(key)
        else:
            out[key] = _mutate_object(out[key], rng)
        return out
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        out = list(obj)
        i = rng.randrange(len(out))
        out[i] = _mutate_object(out[i], rng)
        return out
    return _swap_value(obj, rng)


def _repack(obj: Any) -> bytes | None:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


def mutate(
    seed: bytes,
    rng: random.Random,
    *,
    seeds: Sequence[bytes] = (),
    msgpack_body: Callable[[bytes], tuple[bytes, bytes, bytes]] | None = None,
) -> bytes:
    """One mutation of ``seed`` (see the module docstring)."""
    data = bytearray(seed)
    roll = rng.random()
    if roll < 0.08 or not data:
        return rng.randbytes(rng.choice((0, 1, 4, 16, 64, 512, max(1, len(seed)))))
    if roll < 0.3:
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if roll < 0.42:
        return bytes(data[: rng.randrange(len(data))])
    if roll < 0.5:
        return bytes(data) + rng.randbytes(rng.choice((1, 3, 64, 4096)))
    if roll < 0.62 and len(data) >= 4:
        at = rng.randrange(min(len(data) - 3, 16)) if rng.random() < 0.7 else rng.randrange(len(data) - 3)
        data[at : at + 4] = struct.pack(">I", rng.choice(_EXTREME_U32 + (len(seed), len(seed) + 1)))
        return bytes(data)
    if roll < 0.68 and seeds:
        other = rng.choice(seeds)
        return bytes(data[: rng.randrange(len(data) + 1)]) + other[rng.randrange(len(other) + 1) :]
    if msgpack_body is not None:
        prefix, body, suffix = msgpack_body(seed)
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception:
            obj = None
        if obj is not None:
            packed = _repack(_mutate_object(obj, rng))
            if packed is not None:
                return prefix + packed + suffix
    data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def messages(target: Target, count: int, *, seed: int = 0) -> Iterator[bytes]:
    """``count`` messages for ``target``: every seed once, then mutations (deterministic in ``seed``)."""
    rng = random.Random(seed)
    for i in range(count):
        if i < len(target.seeds):
            yield target.seeds[i]
        else:
            yield mutate(rng.choice(target.seeds), rng, seeds=target.seeds, msgpack_body=target.msgpack_body)


# ---------------------------------------------------------------- the run


def rss_mb() -> float:
    """This process's resident memory, MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _alarm(_signum, _frame):
    raise Hang()


def run(target: Target, count: int, *, seed: int = 0) -> Result:
    """Send ``count`` messages to ``target``; count crashes, hangs and memory growth.

    Must be called from the main thread (the hang alarm is SIGALRM).
    """
    result = Result(target=target.name, messages=0, crashes=0, hangs=0, memory_growth_mb=0.0)
    previous = signal.signal(signal.SIGALRM, _alarm)
    warm_up, baseline = max(1, count // 10), None
    logging.disable(logging.CRITICAL)  # every refusal logs a line; 1e5 of them say nothing
    try:
        for i, message in enumerate(messages(target, count, seed=seed)):
            if i == warm_up:
                baseline = rss_mb()
            signal.setitimer(signal.ITIMER_REAL, HANG_S)
            try:
                target.call(message)
            except Hang:
                result.hangs += 1
            except target.allowed:
                result.refused += 1
            except Exception as exc:  # anything undocumented is a crash
                result.crashes += 1
                if not result.first_crash:
                    result.first_crash = f"{type(exc).__name__}: {exc} <- {message[:64]!r}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            result.messages += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
        logging.disable(logging.NOTSET)
    result.memory_growth_mb = round(rss_mb() - (baseline if baseline is not None else rss_mb()), 1)
    return result


def timed(target: Target, count: int, *, seed: int = 0) -> tuple[Result, float]:
    start = time.monotonic()
    result = run(target, count, seed=seed)
    return result, time.monotonic() - start
