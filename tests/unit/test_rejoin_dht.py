"""peer/net/rejoin.py on real hivemind DHT nodes over loopback: a node that knows no neighbour finds
the swarm again by dialing a remembered address, and then reads what the swarm stored."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.utils import get_dht_time

from peer.net.rejoin import by_peer, reconnect

pytestmark = pytest.mark.timeout(120)


def test_by_peer_groups_addresses_and_skips_the_rest():
    maddrs = ["/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/5.6.7.8/tcp/2/p2p/QmA", "/ip4/1.2.3.4/tcp/3/p2p/QmB", "junk"]
    assert by_peer(maddrs) == {"QmA": maddrs[:2], "QmB": [maddrs[2]]}


def test_an_isolated_node_dials_a_remembered_peer_and_reads_the_swarm_again():
    swarm = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    lost = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # knows nobody
    try:
        assert swarm.store("key", "value", get_dht_time() + 60)
        assert lost.get("key", latest=True) is None  # alone: it reads nothing
        assert reconnect(lost, [str(a) for a in swarm.get_visible_maddrs()]) == 1
        found = lost.get("key", latest=True)
        assert found is not None and found.value == "value"
        assert reconnect(lost, ["/ip4/127.0.0.1/tcp/9/p2p/" + str(lost.peer_id)]) == 0  # its own id: skipped
    finally:
        lost.shutdown()
        swarm.shutdown()
