"""Uplink probe: how fast can this machine send to the swarm? Asked of a node it is connected to.

A volunteer's uplink decides how long each sync takes (a home line often uploads at a tenth of
its download speed), so `peer doctor` measures it before the first join: it sends a few MiB of
random bytes to an initial peer on :data:`PROTOCOL` and times them until the peer's answer that it
received all of them. Every locoswarm node (bootstrap nodes and peers) serves the probe next to
the dial-back check (peer/net/reachability.py), on its DHT's libp2p host.

Serving a probe costs only download bandwidth (the answer is a few bytes), and it is bounded:
at most :data:`MAX_PROBE_BYTES` per probe, :data:`MAX_CONCURRENT` probes at a time (others are
answered "busy" at once), :data:`PEER_BUDGET_BYTES` per requesting peer per
:data:`PEER_WINDOW_S`, :data:`PROBE_TIMEOUT_S` for the whole probe. Frames are
protocol/wire/framing.py frames:

* request: msgpack ``{"bytes": n}`` with 1 ≤ n ≤ MAX_PROBE_BYTES, then n bytes in frames of at
  most :data:`CHUNK_BYTES`;
* answer: msgpack ``{"received": n}``, or ``{"refused": reason}`` (busy, over budget) sent
  right after the request frame.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from peer.net.dht import call_in_dht, serve_stream
from protocol.errors import BadPayload, NetworkError
from protocol.text import sanitize
from protocol.wire import framing

logger = logging.getLogger(__name__)

PROTOCOL = "/locoswarm/uplink/1"
MAX_PROBE_BYTES = 8 * 2**20
"""The largest probe served: 8 MiB take 6.7 s at a 10 Mbit/s home uplink, 0.07 s at 1 Gbit/s."""
CHUNK_BYTES = 2**20
"""Probe bytes travel in frames of at most this size (the reader's bound per frame)."""
MAX_CONCURRENT = 2
"""Probes served at once by one node; a third requester is told "busy"."""
PEER_BUDGET_BYTES = 24 * 2**20
"""Probe bytes one peer may send to this node per :data:`PEER_WINDOW_S` (a doctor run sends at most 9 MiB)."""
PEER_WINDOW_S = 60.0
PROBE_TIMEOUT_S = 60.0
"""Seconds a whole probe may take (8 MiB at 1.2 Mbit/s); a slower sender is cut off."""
MAX_CONTROL_BYTES = 256
"""Request and answer frames are tiny msgpack maps."""


@dataclass(frozen=True)
class UplinkProbe:
    """One probe's result."""

    checker: str
    """The peer id (base58) of the node that received the bytes."""
    bytes: int
    """Bytes sent (0 when the probe failed)."""
    seconds: float
    """From the first byte written to the checker's answer read."""
    error: str = ""
    """Why the probe gave no figure ('' when it did)."""

    @property
    def mbit_per_s(self) -> float | None:
        """Measured uplink, Mbit/s (10^6 bits), or None for a failed probe. The time includes one
        round trip, so on a fast line with a far checker this is a lower bound."""
        return None if self.error or self.seconds <= 0 else self.bytes * 8 / self.seconds / 1e6


def parse_request(payload: bytes) -> int:
    """The byte count of a request.

    Raises:
        BadPayload: not a msgpack map ``{"bytes": n}`` with 1 ≤ n ≤ MAX_PROBE_BYTES.
    """
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_map_len=4, max_str_len=32)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadPayload(f"uplink probe request is not msgpack: {exc}") from exc
    n = data.get("bytes") if isinstance(data, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_PROBE_BYTES:
        raise BadPayload(f"uplink probe request must declare 1 to {MAX_PROBE_BYTES} bytes, got {str(n)[:40]}")
    return n


def parse_answer(payload: bytes) -> int:
    """The byte count the checker says it received.

    Raises:
        BadPayload: not ``{"received": n}``; a ``{"refused": reason}`` answer says the reason.
    """
    try:
        data = msgpack.unpackb(payload, raw=False, max_map_len=4, max_str_len=64)
    except Exception as exc:
        raise BadPayload(f"uplink probe answer is not msgpack: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("refused"), str):
        raise BadPayload(f"the checker refused the probe: {sanitize(data['refused'], max_chars=64)}")
    n = data.get("received") if isinstance(data, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise BadPayload("uplink probe answer is not {received: int}")
    return n


class _Server:
    """The serving side's limits (one per DHT process)."""

    def __init__(self):
        self.slots = 0
        self.spent: dict[str, list[tuple[float, int]]] = {}
        """Requesting peer id → (time, bytes) of its probes in the last window."""

    def admit(self, peer_id: str, n: int, now: float) -> str:
        """'' when a probe of ``n`` bytes from ``peer_id`` may start now (and counts it), else why not."""
        if self.slots >= MAX_CONCURRENT:
            return "busy"
        for pid in list(self.spent):  # forget peers whose window passed (bounded memory)
            self.spent[pid] = [(t, b) for t, b in self.spent[pid] if now - t < PEER_WINDOW_S]
            if not self.spent[pid]:
                del self.spent[pid]
        used = sum(b for _, b in self.spent.get(peer_id, []))
        if used + n > PEER_BUDGET_BYTES:
            return f"over budget: {used} bytes in the last {PEER_WINDOW_S:.0f} s"
        self.spent.setdefault(peer_id, []).append((now, n))
        self.slots += 1
        return ""


_server = _Server()


async def _receive(reader: asyncio.StreamReader, n: int) -> None:
    remaining = n
    while remaining:
        remaining -= len(await framing.read_frame(reader, max_bytes=min(CHUNK_BYTES, remaining), timeout=None))


async def _handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Server side (in the DHT process): read the probe's bytes, answer how many arrived."""
    admitted = False
    try:
        n = parse_request(await framing.read_frame(reader, max_bytes=MAX_CONTROL_BYTES, timeout=PROBE_TIMEOUT_S))
        refusal = _server.admit(str(stream_info.peer_id), n, time.monotonic())
        if refusal:
            writer.write(framing.frame(msgpack.packb({"refused": refusal})))
        else:
            admitted = True
            await asyncio.wait_for(_receive(reader, n), PROBE_TIMEOUT_S)
            writer.write(framing.frame(msgpack.packb({"received": n})))
        await asyncio.wait_for(writer.drain(), 5.0)
    except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        logger.debug("uplink probe from %s ended: %s", stream_info.peer_id, framing.describe_failure(exc))
    finally:
        if admitted:
            _server.slots -= 1
        writer.close()


def serve_uplink(dht) -> None:
    """Answer other nodes' uplink probes from now on (in ``dht``'s process; raises as
    peer/net/dht.py ``serve_stream``)."""
    serve_stream(dht, PROTOCOL, _handle)


async def _probe(_dht, node, checker: str, n: int) -> UplinkProbe:
    from hivemind.p2p import PeerID

    writer = None
    try:
        _, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(PeerID.from_base58(checker), PROTOCOL), PROBE_TIMEOUT_S
        )
        data = os.urandom(n)  # random: no link-level compression can flatter the figure
        start = time.perf_counter()
        writer.write(framing.frame(msgpack.packb({"bytes": n})))
        for offset in range(0, n, CHUNK_BYTES):
            writer.write(framing.frame(data[offset : offset + CHUNK_BYTES]))
            await asyncio.wait_for(writer.drain(), PROBE_TIMEOUT_S)
        received = parse_answer(await framing.read_frame(reader, max_bytes=MAX_CONTROL_BYTES, timeout=PROBE_TIMEOUT_S))
        seconds = time.perf_counter() - start
        if received != n:
            raise BadPayload(f"the checker says it received {received} of {n} bytes")
        return UplinkProbe(checker=checker, bytes=n, seconds=seconds)
    except Exception as exc:  # an old node without the handler, a refusal, a closed stream
        return UplinkProbe(checker=checker, bytes=0, seconds=0.0, error=framing.describe_failure(exc))
    finally:
        if writer is not None:
            writer.close()


def measure_uplink(
    dht, checkers: Sequence[str], *, sizes: Sequence[int] = (2**20, MAX_PROBE_BYTES), enough_s: float = 2.0
) -> UplinkProbe:
    """Time probes of growing ``sizes`` to the first checker that takes them; stop at the first
    probe that lasted ``enough_s`` seconds (a longer probe would tell nothing new).

    Args:
        checkers: peer ids (base58) of nodes this node is connected to, tried in order.
        sizes: probe sizes in bytes, each at most :data:`MAX_PROBE_BYTES`.

    Returns:
        The largest successful probe, or the last failure (``error`` set; ``checker`` '' when no
        checker was given). Never raises for a checker's failure.
    """
    best = UplinkProbe(checker="", bytes=0, seconds=0.0, error="no node to send to")
    for checker in checkers:
        for n in sizes:
            try:
                result = call_in_dht(
                    dht,
                    functools.partial(_probe, checker=checker, n=min(n, MAX_PROBE_BYTES)),
                    "an uplink probe",
                    PROBE_TIMEOUT_S + 30.0,
                )
            except NetworkError as exc:
                result = UplinkProbe(checker=checker, bytes=0, seconds=0.0, error=str(exc))
            if result.error:
                best = result if not best.bytes else best
                break
            best = result
            if result.seconds >= enough_s:
                break
        if best.bytes:
            return best
    return best
