"""Length-prefixed frames, shared by every stream protocol (protocol/wire/allreduce.py, state.py).

A frame is ``u32 big-endian length`` + payload; the length counts the payload only, is at least
1 and is bounded by the reader before anything is allocated. The payload's first byte is its
kind; each stream protocol names its own kinds.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping

from protocol.errors import BadPayload

LENGTH = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    """Length-prefix ``payload``."""
    return LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, *, max_bytes: int, timeout: float | None) -> bytes:
    """Read one frame's payload.

    Args:
        max_bytes: the largest payload this reader accepts at this point of the protocol; a
            longer declared length is rejected before anything is allocated.
        timeout: seconds to wait for the whole frame (None: forever).

    Raises:
        BadPayload: declared length 0 or above ``max_bytes``.
        asyncio.TimeoutError: nothing complete arrived in time.
        asyncio.IncompleteReadError: the stream closed mid-frame.
    """

    async def _read() -> bytes:
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if length == 0 or length > max_bytes:
            raise BadPayload(f"frame declares {length} bytes; at most {max_bytes} allowed here")
        return await reader.readexactly(length)

    return await asyncio.wait_for(_read(), timeout)


def kind_of(payload: bytes, names: Mapping[int, str]) -> int:
    """The kind byte of ``payload``.

    Raises:
        BadPayload: ``payload`` is empty or its kind is not one of ``names``.
    """
    if not payload or payload[0] not in names:
        raise BadPayload(f"unknown frame kind {payload[:1].hex() or '(empty)'}")
    return payload[0]


def describe_failure(exc: BaseException) -> str:
    """Why a stream exchange failed, in words for a log line or a donor's failure reason."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return f"stream closed after {len(exc.partial)} of {exc.expected} bytes of a frame"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, BadPayload) else str(exc)
