"""Start a DHT node of ours: hivemind's DHT as a helper process that dies with its parent, whose
node refuses unsigned records under protected keys (peer/net/validator.py) and keeps at most
``dht_storage.MAX_ENTRIES_STORED`` entries per key (peer/net/dht_storage.py).

Importing it imports hivemind (the validator subclasses hivemind's). Everything done with a
started node (bounded calls, reads and writes of DHT values, its addresses, stream handlers) and
the check of --initial-peers: peer/net/dht.py.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

from peer.net import dht_storage
from peer.net.dht import parse_initial_peers
from peer.net.lifetime import HelperProcess, bind_subprocesses_to_this_process
from peer.net.validator import SwarmRecordValidator
from protocol.errors import BootstrapUnreachable, ConfigError, NetworkError

logger = logging.getLogger(__name__)


@functools.cache
def _helper_dht_class():
    """hivemind's DHT as a helper process (peer/net/lifetime.py), built on first use."""
    import hivemind

    class SwarmDHT(HelperProcess, hivemind.DHT):
        """A hivemind DHT whose process and p2pd die with the process that started it, leave
        signals to it, and shut down within ``shutdown_timeout`` even when p2pd is already gone."""

        def run(self) -> None:  # in the DHT process
            bind_subprocesses_to_this_process()  # p2pd dies with this process
            _decode_found_values_one_by_one()
            dht_storage.install()  # at most MAX_ENTRIES_STORED entries per key, stored or cached
            try:
                super().run()
            except (EOFError, ConnectionError) as exc:
                # hivemind's request loop fetches each request's reply pipe from its sender's
                # process; a sender killed mid-request (the averager, by the OOM killer) leaves
                # nothing to fetch it from, and the loop ends. The peer stops for that helper's
                # death (peer/net/lifetime.py): end with one line, not a traceback.
                logger.warning("DHT process stops: a request's sender died before its reply pipe arrived (%r)", exc)
                raise SystemExit(1) from None

        async def _shutdown(self) -> None:
            # When p2pd is gone first (a service manager signals every process of the unit),
            # DHTNode.shutdown raises or waits forever on the closed daemon connection.
            try:
                await asyncio.wait_for(super()._shutdown(), self.shutdown_timeout / 2)
            except Exception as exc:
                logger.debug("DHT node did not shut down cleanly (%r); stopping p2pd", exc)
                try:
                    await asyncio.wait_for(self._node.p2p.shutdown(), self.shutdown_timeout / 4)
                except Exception as p2p_exc:
                    logger.debug("p2pd did not stop cleanly: %r", p2p_exc)

    return SwarmDHT


class _TolerantSerializer:
    """hivemind's serializer for values a search found: an undecodable value reads as None."""

    def __init__(self, inner):
        self.inner = inner

    def dumps(self, obj):
        return self.inner.dumps(obj)

    def loads(self, buf):
        try:
            return self.inner.loads(buf)
        except Exception as exc:  # msgpack raises several unrelated types
            logger.debug("skipping an undecodable DHT value (%d bytes): %r", len(buf), exc)
            return None


def _decode_found_values_one_by_one() -> None:
    """In this (the DHT) process: make every DHT search decode each value it found on its own, an
    undecodable one as None, instead of raising from the search's callback and leaving the
    caller's future unresolved forever (hivemind 1.1.12 ``_SearchState.finish_search``)."""
    from hivemind.dht.node import _SearchState

    if getattr(_SearchState, "_locoswarm_tolerant", False):
        return
    original_init = _SearchState.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.serializer = _TolerantSerializer(self.serializer)

    _SearchState.__init__ = __init__
    _SearchState._locoswarm_tolerant = True


PORT_BUSY_WAIT_S = 2.0
"""How long :func:`check_port_free` waits for a port held by a listener to be released (the p2pd of a
peer that just stopped on that port may still be exiting) before it calls the port taken."""


def check_port_free(host: str, port: int, *, flag: str = "--port", wait_s: float = PORT_BUSY_WAIT_S) -> None:
    """Refuse a listen port that another process holds, before p2pd is started on it: p2pd's own bind
    failure surfaces as a failed bootstrap, which blamed the initial peers (issue #68, item 7).

    The probe socket sets ``SO_REUSEADDR`` as p2pd's Go listener does, so connections of a stopped
    peer still in TIME_WAIT do not count; another listener (a running peer, any server) does, and so
    does a socket bound without reuse. Port 0 (any free port) is never checked.

    Args:
        host: the IPv4 address to listen on (``--host``; 0.0.0.0 for all interfaces).
        port: the TCP port (``--port``).
        flag: the flag that named the port, for the message.
        wait_s: how long a taken port is probed again (every 0.2 s) before it is refused, seconds.

    Raises:
        ConfigError: the port is taken (exit 78), or ``host`` is not an address of this machine;
            the message names both and what to do.
    """
    if not port:
        return
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                return
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(
                        f"--host {host}: not an address of this machine, cannot listen on {host}:{port}; "
                        "use 0.0.0.0 (all interfaces) or one of this machine's addresses"
                    ) from exc
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    return  # anything else (a name, IPv6) is p2pd's to judge, as before this check
                if exc.errno == errno.EACCES or time.monotonic() >= deadline:
                    why = (
                        "is in use by another process"
                        if exc.errno == errno.EADDRINUSE
                        else "needs root to listen on (a port below 1024)"
                    )
                    raise ConfigError(
                        f"{flag} {port}: TCP port {port} on {host} {why}; pick another port with {flag} "
                        f"(or {flag} 0 for any free one), or stop what listens there (`ss -ltnp 'sport = :{port}'` names it)"
                    ) from exc
        time.sleep(0.2)


def new_dht(**kwargs):
    """``hivemind.DHT(**kwargs)`` whose DHT process and p2pd die with this process however it
    dies (``kill -9`` included) and ignore the signals that stop it (peer/net/lifetime.py).

    Start it from a thread that outlives it (the kernel kills the DHT process when the thread
    that forked it exits). Unless ``record_validators`` is given, the node refuses unsigned values
    under the keys it protects (peer/net/validator.py). Raises whatever ``hivemind.DHT`` raises.
    """
    kwargs.setdefault("record_validators", [SwarmRecordValidator()])
    return _helper_dht_class()(**kwargs)


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    announce: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    relay: str | None = None,
    check_identity: bool = True,
    timeout_s: float = 20.0,
):
    """Start a hivemind DHT node (its own process plus a p2pd daemon) and connect it to the swarm.

    Args:
        initial_peers: multiaddrs of any live node of the swarm (checked by parse_initial_peers).
        host, port: where to listen (port 0: any free port).
        announce: multiaddrs to advertise instead of the listen addresses (e.g. a public IP).
        identity_path: key file fixing the peer id; see peer/net/identity.py.
        relay: None; "serve": run libp2p's circuit relay (v2) service, reachability forced public (a
            bootstrap node is there to be dialled; AutoNAT, with few peers, may never decide); "use":
            with ``client_mode``, auto relay through ``initial_peers`` (go-libp2p reserves a slot on
            them once it judges itself private, which this forces), so others reach this node at
            ``<relay>/p2p-circuit/p2p/<its id>``.
        check_identity: hivemind's check that no live node holds the identity (skip it for a node
            restarted with the identity that just left: its old connections may still be seen).
        timeout_s: how long to wait for an initial peer to answer.

    Returns:
        A started ``hivemind.DHT`` (see :func:`new_dht`). Shut it down with ``dht.shutdown()``.

    Raises:
        ValueError: ``relay`` is none of None, "serve", "use".
        BadPeerAddress: an initial peer address is malformed.
        BootstrapUnreachable: no initial peer answered within ``timeout_s``.
        NetworkError: the node could not start (e.g. the port is taken).
    """
    if relay not in (None, "serve", "use"):
        raise ValueError(f"relay = {relay!r}: expected None, 'serve' or 'use'")
    peers = parse_initial_peers(initial_peers)
    kwargs: dict[str, Any] = dict(
        initial_peers=peers,
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        client_mode=client_mode,
        start=True,
        await_ready=True,
        wait_timeout=min(5.0, timeout_s),
        bootstrap_timeout=min(5.0, timeout_s),
    )
    if relay == "serve":
        kwargs.update(use_relay=True, force_reachability="public")
    elif relay == "use":
        kwargs.update(use_relay=True, use_auto_relay=True, force_reachability="private", trusted_relays=peers)
    if not check_identity:
        kwargs["check_if_identity_free"] = False
    if announce:
        kwargs["announce_maddrs"] = list(announce)
    if identity_path is not None:
        kwargs["identity_path"] = str(identity_path)
    try:
        return new_dht(**kwargs)
    except Exception as exc:
        text = str(exc)
        if peers and ("bootstrap failed" in text or "initial_peers" in text or "connect" in text.lower()):
            raise BootstrapUnreachable(
                f"none of the initial peers answered: {', '.join(peers)}. Check that the node is running, "
                "that HOST:PORT is reachable from here (firewall, NAT) and that the /p2p/ id is current"
            ) from exc
        raise NetworkError(f"could not start the DHT node on {host}:{port}: {text}") from exc
