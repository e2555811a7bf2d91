"""peer.net.dht: --initial-peers values are checked before any connection is tried."""

import pytest

from peer.net.dht import parse_initial_peers
from protocol.errors import BadPeerAddress


def test_initial_peer_addresses_are_checked():
    good = "/ip4/127.0.0.1/tcp/31337/p2p/QmTchctY2mrWtDteP1QWQW79B2bLycdUvtDZ3airqiax6s"
    assert parse_initial_peers([good]) == [good]
    for bad in ("127.0.0.1:31337", "/ip4/127.0.0.1/tcp/31337", "/ip4/999.1.1.1/tcp/1/p2p/Qm"):
        with pytest.raises(BadPeerAddress) as info:
            parse_initial_peers([bad])
        assert bad in str(info.value)
