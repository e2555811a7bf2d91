"""Is this peer reachable, and at which address? What `peer join` finds out and prints at start.

A peer listens on all interfaces by default. Once its DHT node is up it asks its initial peers (or,
when it came in through remembered peers, nodes it is connected to) to dial it back
(protocol/reachability.py): each answers from where it sees the peer's requests come
(the observed, public address) whether the peer's listen port answered there. Then:

* reachable: the verified address ``/ip4/OBSERVED/tcp/PORT/p2p/ID`` is printed first;
* not reachable (every checker answered and none got through: NAT or a firewall): one line says
  so, and the DHT node is restarted in client mode with libp2p's auto relay through the initial
  peers (bootstrap nodes serve as circuit relays by default), so the peer still trains and
  averages: it opens every connection itself;
* unknown (no checker answered, e.g. an older bootstrap node): one line says so, nothing changes.

Addresses printed for others (:func:`dialable_maddrs`): verified first, then ``--announce``d
ones, then the other non-loopback listen addresses; loopback ones only when there is nothing else.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from peer.net import dht_node
from peer.net.dht import parse_initial_peers, visible_maddrs
from peer.net.reachability import DialBack, ask_dialback, serve_dialback
from peer.net.uplink import serve_uplink

logger = logging.getLogger(__name__)

MAX_CHECKERS = 3
"""Initial peers asked to dial back at once."""


@dataclass(frozen=True)
class Reachability:
    """What the dial-back check found (:func:`judge`), and, once :func:`reach_out` decided, how
    this peer is reached: what the rest of ``peer join`` reads instead of ``JoinConfig.client_mode``."""

    status: str
    """'reachable', 'unreachable', 'unknown' (no checker answered) or 'unchecked' (no initial peer,
    or client mode)."""
    verified: tuple[str, ...] = ()
    """Addresses (without /p2p/) at which a checker opened a libp2p connection to this peer."""
    line: str = ""
    """The one line that tells the user (empty for 'unchecked')."""
    client_mode: bool = False
    """Whether the peer runs in client mode (dials out, accepts no connection, serves no state):
    asked for with --client-mode, or fallen back to when it was found 'unreachable'."""
    relays: tuple[str, ...] = ()
    """In client mode: the initial peers through whose circuit relays others reach this peer
    (:func:`relay_maddrs`); empty otherwise."""
    announce: tuple[str, ...] = ()
    """The ``--announce`` addresses offered to others (those without /p2p/; :func:`printable_maddrs`)."""


def _ip_of(maddr: str) -> str:
    parts = str(maddr).split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts and parts.index(proto) + 1 < len(parts):
            return parts[parts.index(proto) + 1]
    return ""


def _port_of(maddr: str) -> int | None:
    parts = str(maddr).split("/")
    if "tcp" in parts and parts.index("tcp") + 1 < len(parts) and parts[parts.index("tcp") + 1].isdigit():
        return int(parts[parts.index("tcp") + 1])
    return None


def is_loopback(maddr: str) -> bool:
    """Whether a multiaddr's IP is a loopback address (False for DNS names and non-IP addresses)."""
    try:
        return ipaddress.ip_address(_ip_of(maddr)).is_loopback
    except ValueError:
        return False


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """The distinct TCP ports of ``maddrs`` (direct addresses only), in order."""
    ports = [_port_of(m) for m in maddrs if "p2p-circuit" not in str(m)]
    return list(dict.fromkeys(p for p in ports if p))


def peer_ids(initial_peers: Sequence[str]) -> list[str]:
    """The /p2p/ ids of ``initial_peers`` (already validated multiaddrs), distinct, in order."""
    return list(dict.fromkeys(str(m).rsplit("/p2p/", 1)[-1] for m in initial_peers if "/p2p/" in str(m)))


def judge(answers: Sequence[DialBack]) -> Reachability:
    """The verdict from the checkers' answers (protocol/reachability.py)."""
    answered = [a for a in answers if not a.error]
    if not answered:
        why = "; ".join(f"{a.checker[:12]}…: {a.error}" for a in answers) or "connected to no node to ask"
        return Reachability("unknown", line=f"reachability unknown: no peer answered the dial-back check ({why})")
    verified = tuple(
        dict.fromkeys(
            f"/ip{6 if ':' in a.observed else 4}/{a.observed}/tcp/{port}" for a in answered for port in a.reachable
        )
    )
    if verified:
        return Reachability(
            "reachable",
            verified,
            line=f"reachable: {len(answered)} peer(s) of the swarm dialed this peer back at {', '.join(verified)}",
        )
    seen = sorted({a.observed for a in answered if a.observed}) or ["(no direct connection)"]
    return Reachability(
        "unreachable",
        line=(
            f"not reachable from outside: {len(answered)} peer(s) of the swarm could not dial this peer back at "
            f"{', '.join(seen)} (NAT or firewall; forward the port and pass --announce, or keep going): "
            "continuing in client mode, relayed through the initial peers"
        ),
    )


def check(dht, initial_peers: Sequence[str]) -> Reachability:
    """Ask up to :data:`MAX_CHECKERS` initial peers to dial this node back. Never raises for the
    checkers' failures (the verdict is then 'unknown')."""
    checkers = peer_ids(initial_peers)[:MAX_CHECKERS]
    if not checkers:
        return Reachability("unchecked")
    ports = listen_ports(visible_maddrs(dht, latest=True))
    try:
        answers = ask_dialback(dht, checkers, ports)
    except Exception as exc:  # the DHT process failed to run the check at all
        logger.debug("dial-back check failed", exc_info=True)
        answers = [
            DialBack(checker=c, observed="", reachable=(), error=f"{type(exc).__name__}: {exc}") for c in checkers
        ]
    return judge(answers)


def dialable_maddrs(
    visible: Sequence[str], peer_id: str, *, verified: Sequence[str] = (), announce: Sequence[str] = ()
) -> list[str]:
    """The full multiaddrs to print for others, best first (see the module docstring).

    Args:
        visible: this node's visible multiaddrs (with or without /p2p/ID).
        verified: addresses a dial-back check reached (without /p2p/).
        announce: ``--announce`` addresses (without /p2p/).
    """
    suffix = f"/p2p/{peer_id}"

    def full(m: str) -> str:
        return str(m) if "/p2p/" in str(m) else f"{m}{suffix}"

    relayed = [full(m) for m in visible if "p2p-circuit" in str(m)]
    direct = [full(m) for m in visible if "p2p-circuit" not in str(m)]
    ordered = list(dict.fromkeys([*map(full, verified), *map(full, announce), *direct]))
    outside = [m for m in ordered if not is_loopback(m)]
    return (outside or ordered) + relayed


def start_node(
    initial_peers: Sequence[str],
    *,
    host: str,
    port: int,
    announce: Sequence[str],
    identity_path: str,
    client_mode: bool,
    restart: bool = False,
    timeout_s: float = 20.0,
):
    """Start this peer's DHT node: as ``peer.net.dht_node.start_dht``, and in client mode with libp2p's
    auto relay through ``initial_peers`` (go-libp2p reserves a relay slot on them once it judges
    itself private, which client mode forces), so others can reach it through a bootstrap node.
    ``restart``: the same identity just left the swarm (hivemind's check whether the identity is
    taken could still see its old connections, so it is skipped).

    Raises:
        BadPeerAddress, BootstrapUnreachable, NetworkError: as ``peer.net.dht_node.start_dht``.
    """
    return dht_node.start_dht(
        initial_peers=initial_peers,
        host=host,
        port=port,
        announce=announce,
        identity_path=identity_path,
        client_mode=client_mode,
        relay="use" if client_mode and initial_peers else None,
        check_identity=not restart,
        timeout_s=timeout_s,
    )


def reach_out(dht, cfg, reporter, *, identity_path: str) -> tuple[Any, Reachability]:
    """Serve dial-back checks for others, check this peer's own reachability and say it in one line;
    an unreachable peer goes on in client mode, relayed (its DHT node is restarted, same identity).

    Args:
        dht: this peer's started DHT node.
        cfg: the peer's ``JoinConfig`` (host, port, announce, initial_peers, client_mode); not changed.
        reporter: where the line goes (a ``status`` event with ``reachability`` and ``verified``).

    Returns:
        ``(dht, reach)``: the DHT to use from now on (``dht``, or after a fall back to client mode a
        new node, ``dht`` then shut down) and the :class:`Reachability` found and decided.

    Raises:
        BootstrapUnreachable, NetworkError: the restarted node could not join (the old one is shut down).
    """

    def decided(verdict: Reachability, client_mode: bool) -> Reachability:
        return replace(
            verdict,
            client_mode=client_mode,
            relays=tuple(cfg.initial_peers) if client_mode else (),
            announce=tuple(a for a in cfg.announce if "/p2p/" not in a),
        )

    if cfg.client_mode:
        verdict = Reachability(
            "unchecked",
            line="client mode: this peer dials out and accepts no connections"
            + ("; relayed through the initial peers" if cfg.initial_peers else ""),
        )
        reporter.emit("status", message=verdict.line, reachability=verdict.status, verified=[])
        return dht, decided(verdict, True)
    try:
        serve_dialback(dht)
        serve_uplink(dht)
    except Exception as exc:  # a node that cannot serve checks still trains
        logger.debug("cannot serve dial-back checks: %r", exc)
    if not cfg.initial_peers:
        return dht, decided(Reachability("unchecked"), False)
    reporter.emit("status", message="checking whether the swarm can dial this peer back")
    verdict = check(dht, cfg.initial_peers)
    reporter.emit("status", message=verdict.line, reachability=verdict.status, verified=list(verdict.verified))
    if verdict.status != "unreachable":
        return dht, decided(verdict, False)
    dht.shutdown()
    dht = start_node(
        cfg.initial_peers,
        host=cfg.host,
        port=cfg.port,
        announce=cfg.announce,
        identity_path=identity_path,
        client_mode=True,
        restart=True,
    )
    return dht, decided(verdict, True)


def relay_maddrs(dht, reach: Reachability) -> list[str]:
    """For a peer in client mode: the addresses at which others reach it through its initial peers'
    circuit relays (``<initial peer>/p2p-circuit/p2p/<this peer>``). They work once a relay granted
    this peer a slot: go-libp2p's auto relay asks after about three minutes, and only relays with
    public addresses (in the namespace lab, a public-range subnet: tests/integration/test_relay.py).
    Empty for a peer that is not in client mode or has no initial peer."""
    if not reach.relays:
        return []
    return [f"{m}/p2p-circuit/p2p/{dht.peer_id}" for m in parse_initial_peers(reach.relays) if "/p2p-circuit" not in m]


def printable_maddrs(dht, reach: Reachability) -> list[str]:
    """The addresses the ``started`` line offers others: :func:`dialable_maddrs`, or for a peer in
    client mode only its relay addresses (none until a relay slot is granted)."""
    visible = visible_maddrs(dht, latest=True)
    if reach.client_mode:
        return [m for m in visible if "p2p-circuit" in m]
    return dialable_maddrs(visible, str(dht.peer_id), verified=reach.verified, announce=reach.announce)
