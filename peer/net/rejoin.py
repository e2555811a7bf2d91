"""Finding the swarm again after losing it: a peer whose DHT node lost every neighbour (a network
partition longer than the DHT's RPC timeouts, a laptop off the network for a while) dials the
addresses it remembers again and rebuilds its routing table.

hivemind 1.1.12 bootstraps a DHT node once, from its initial peers, at start; a node whose
neighbours all failed RPCs during an outage drops them from its routing table and has no way back:
it then reads no record and trains alone for good (tests/chaos/test_churn.py, a peer partitioned for
20 s). :func:`reconnect` repeats that bootstrap's steps on a running node: connect to each
remembered peer (by the multiaddrs the address book keeps), ping it into the routing table, then
look up the node's own id to find its neighbours.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence

from peer.net.dht import call_in_dht

logger = logging.getLogger(__name__)

RECONNECT_TIMEOUT_S = 5.0
"""How long one remembered peer may take to connect and answer the ping, s."""
MAX_RECONNECT_PEERS = 16
"""Remembered peers dialed by one :func:`reconnect` (the rest wait for the next)."""


def by_peer(maddrs: Sequence[str]) -> dict[str, list[str]]:
    """Multiaddrs (``.../p2p/<peer id>``) grouped by peer id, in first-seen order; others skipped."""
    grouped: dict[str, list[str]] = {}
    for maddr in maddrs:
        if "/p2p/" in maddr:
            grouped.setdefault(maddr.rsplit("/p2p/", 1)[1], []).append(maddr)
    return grouped


def reconnect(dht, maddrs: Sequence[str], *, timeout_s: float = RECONNECT_TIMEOUT_S) -> int:
    """Dial the peers of ``maddrs`` (at most :data:`MAX_RECONNECT_PEERS`, this node's own skipped),
    ping each into this DHT node's routing table and, if any answered, look up the node's own id.

    Returns:
        How many peers answered the ping (0: none; the node is left as it was).

    Raises:
        NetworkError: the DHT process did not answer in time (peer/net/dht.py ``finish``).
    """
    peers = list(by_peer(maddrs).items())[:MAX_RECONNECT_PEERS]
    if not peers:
        return 0
    total_s = (len(peers) + 1) * 2 * timeout_s + 5.0
    return call_in_dht(
        dht, functools.partial(_reconnect, peers=peers, timeout_s=timeout_s), "reconnecting to the swarm", total_s
    )


async def _reconnect(_dht, node, peers: list[tuple[str, list[str]]], timeout_s: float) -> int:  # in the DHT process
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    answered = 0
    for peer, addresses in peers:
        try:
            peer_id = PeerID.from_base58(peer)
            if peer_id == node.peer_id:
                continue
            # hivemind's P2P has no public connect: its daemon client's is what DHTNode.create's p2p used
            transport = [Multiaddr(a.rsplit("/p2p/", 1)[0]) for a in addresses]  # the daemon wants them bare
            await asyncio.wait_for(node.p2p._client.connect(peer_id, transport), timeout_s)
            if await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout_s) is not None:
                answered += 1
        except Exception as exc:  # an unreachable or invalid address: the next one
            logger.debug("reconnect: %s did not answer: %r", peer, exc)
    if answered:
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout_s)
        except Exception as exc:
            logger.debug("reconnect: looking up this node's neighbours failed: %r", exc)
    return answered
