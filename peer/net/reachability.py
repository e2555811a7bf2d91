"""Dial-back: can the swarm open a connection to this node? Asked of a node it is connected to.

A node behind NAT or a firewall reaches out fine, so nothing it does alone tells it whether others
can dial it, and libp2p's AutoNAT does not decide in a small swarm (it needs several servers and
refuses to probe private addresses). So every locoswarm node (bootstrap nodes and peers) serves
:data:`PROTOCOL` on its DHT's libp2p host: a node that asks sends the TCP ports it listens on;
the server connects back to the IP address it sees the request come from (the observed address,
which is the public one behind a NAT) on each port, and answers which ports spoke libp2p there.

Only the requester's own observed IP is ever dialed, at most :data:`MAX_PORTS` ports per request
and :data:`MAX_CONCURRENT` requests at a time, so a request cannot point the server at a third
party. Frames are protocol/wire/framing.py frames of msgpack maps:

* request: ``{"ports": [int, ...]}`` (1 to MAX_PORTS ports in [1, 65535]);
* answer: ``{"observed": "IP" or "", "reachable": [int, ...]}`` (the ports that answered).

Both sides run inside the DHT process (``dht.run_coroutine``), on the p2pd connection the DHT
already holds; :func:`serve_dialback` installs the handler, :func:`ask_dialback` asks.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from peer.net.dht import DAEMON_CALL_TIMEOUT_S, call_in_dht, serve_stream
from protocol.errors import BadPayload
from protocol.wire import framing

logger = logging.getLogger(__name__)

PROTOCOL = "/locoswarm/dialback/1"
MAX_PORTS = 4
MAX_FRAME_BYTES = 1024
MAX_CONCURRENT = 4
"""Dial-back requests served at once by one node; more wait."""
DIAL_TIMEOUT_S = 3.0
"""Seconds the server waits for a TCP connection to open, then as long for the libp2p greeting."""
ASK_TIMEOUT_S = 12.0
"""Seconds a requester waits for one server's answer (the server's dials included)."""
GREETING = b"/multistream/1.0.0"
"""What a libp2p listener writes first on a new TCP connection (multistream-select)."""


@dataclass(frozen=True)
class DialBack:
    """One server's answer."""

    checker: str
    """The peer id (base58) of the node that dialed back."""
    observed: str
    """The IP address the checker sees this node's requests come from ('' when it saw none, e.g. relayed)."""
    reachable: tuple[int, ...]
    """The ports the checker could open a libp2p connection to at ``observed``."""
    error: str = ""
    """Why the checker gave no answer ('' when it answered)."""


def encode_request(ports: Sequence[int]) -> bytes:
    """A request frame's payload for ``ports`` (the first MAX_PORTS)."""
    return msgpack.packb({"ports": [int(p) for p in ports][:MAX_PORTS]})


def parse_request(payload: bytes) -> list[int]:
    """The ports of a request.

    Raises:
        BadPayload: not a msgpack map with 1 to MAX_PORTS integer ports in [1, 65535].
    """
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_array_len=MAX_PORTS)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadPayload(f"dial-back request is not msgpack: {exc}") from exc
    ports = data.get("ports") if isinstance(data, dict) else None
    if (
        not isinstance(ports, list)
        or not 1 <= len(ports) <= MAX_PORTS
        or not all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports)
    ):
        raise BadPayload(f"dial-back request needs 1 to {MAX_PORTS} TCP ports, got {str(ports)[:80]}")
    return list(dict.fromkeys(ports))


def parse_answer(payload: bytes, checker: str) -> DialBack:
    """A server's answer.

    Raises:
        BadPayload: not a msgpack map with a string ``observed`` and a list of ports ``reachable``.
    """
    try:
        data = msgpack.unpackb(payload, raw=False, max_array_len=MAX_PORTS, max_str_len=64)
    except Exception as exc:
        raise BadPayload(f"dial-back answer is not msgpack: {exc}") from exc
    observed = data.get("observed") if isinstance(data, dict) else None
    ports = data.get("reachable") if isinstance(data, dict) else None
    if (
        not isinstance(observed, str)
        or not isinstance(ports, list)
        or not all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports)
    ):
        raise BadPayload("dial-back answer is not {observed: str, reachable: [port, ...]}")
    if observed:
        try:
            observed = str(ipaddress.ip_address(observed))
        except ValueError as exc:
            raise BadPayload(f"dial-back answer's observed address {observed!r} is not an IP address") from exc
    return DialBack(checker=checker, observed=observed, reachable=tuple(ports))


def observed_ip(maddr) -> str:
    """The IP address of a connection's remote multiaddr ('' for a relayed or non-IP one)."""
    text = str(maddr)
    if "p2p-circuit" in text:
        return ""
    parts = text.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts and parts.index(proto) + 1 < len(parts):
            try:
                return str(ipaddress.ip_address(parts[parts.index(proto) + 1]))
            except ValueError:
                return ""
    return ""


async def speaks_libp2p(ip: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``ip:port`` opens and greets with multistream-select."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
        greeting = await asyncio.wait_for(reader.read(64), timeout_s)
        return GREETING in greeting
    except (TimeoutError, OSError):
        return False
    finally:
        if writer is not None:
            writer.close()


_slots: asyncio.Semaphore | None = None


async def _handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Server side (in the DHT process): dial the requester back at its observed IP."""
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(MAX_CONCURRENT)
    try:
        ports = parse_request(await framing.read_frame(reader, max_bytes=MAX_FRAME_BYTES, timeout=DIAL_TIMEOUT_S))
        ip = observed_ip(stream_info.addr)
        reachable = []
        if ip:
            async with _slots:
                answers = await asyncio.gather(*(speaks_libp2p(ip, port) for port in ports))
            reachable = [port for port, ok in zip(ports, answers) if ok]
        writer.write(framing.frame(msgpack.packb({"observed": ip, "reachable": reachable})))
        await asyncio.wait_for(writer.drain(), DIAL_TIMEOUT_S)
    except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        logger.debug("dial-back request from %s refused: %s", stream_info.peer_id, exc)
    finally:
        writer.close()


def serve_dialback(dht) -> None:
    """Answer other nodes' dial-back requests from now on (in ``dht``'s process; raises as
    peer/net/dht.py ``serve_stream``)."""
    serve_stream(dht, PROTOCOL, _handle)


async def _ask_all(_dht, node, checkers: Sequence[str], ports: Sequence[int]) -> list[DialBack]:
    from hivemind.p2p import PeerID

    # Ask only nodes this one is connected to (never dial a dead initial peer); when none of the
    # given ones is (the DHT came up through remembered peers), any connected node can answer.
    try:
        peers = await asyncio.wait_for(node.p2p.list_peers(), DAEMON_CALL_TIMEOUT_S)
    except TimeoutError:  # p2pd did not answer: ask the given checkers as they are
        connected = list(checkers)
    else:
        connected = list(dict.fromkeys(p.peer_id.to_base58() for p in peers))
    checkers = [c for c in checkers if c in connected] or connected[: max(1, len(checkers))]

    async def ask(checker: str) -> DialBack:
        writer = None
        try:
            _, reader, writer = await asyncio.wait_for(
                node.p2p.call_binary_stream_handler(PeerID.from_base58(checker), PROTOCOL), ASK_TIMEOUT_S
            )
            writer.write(framing.frame(encode_request(ports)))
            await writer.drain()
            payload = await framing.read_frame(reader, max_bytes=MAX_FRAME_BYTES, timeout=ASK_TIMEOUT_S)
            return parse_answer(payload, checker)
        except Exception as exc:  # an old node without the handler, a closed stream, a bad answer
            return DialBack(checker=checker, observed="", reachable=(), error=framing.describe_failure(exc))
        finally:
            if writer is not None:
                writer.close()

    return list(await asyncio.gather(*(ask(c) for c in checkers)))


def ask_dialback(dht, checkers: Sequence[str], ports: Sequence[int]) -> list[DialBack]:
    """Ask each of ``checkers`` (peer ids, base58) to dial this node back on ``ports``; all at once.

    Only checkers this node is connected to are asked; when none is, as many other connected nodes.

    Returns:
        One :class:`DialBack` per checker asked (none when this node is connected to no one); a
        checker that did not answer within :data:`ASK_TIMEOUT_S` has ``error`` set. Never raises
        for a checker's failure.
    """
    if not checkers or not ports:
        return []
    return call_in_dht(
        dht,
        functools.partial(_ask_all, checkers=list(checkers), ports=list(ports)[:MAX_PORTS]),
        "the dial-back check",
        ASK_TIMEOUT_S + 30.0,
    )
