"""What `peer join` decides from its reachability (peer/reachability.py `reach_out`): a frozen
`Reachability` that says client mode, relays and announced addresses, the JoinConfig left as it is;
and the addresses printed from it. The dial-back check and the DHT are fakes in peer.reachability's
namespace; the real thing runs in tests/integration/test_reachability.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from peer import reachability
from peer.config import JoinConfig
from peer.reachability import Reachability

ID = "12D3KooWKypwB8ARFtvZsniHQMbzHYKNEM9Eaov1exVoCKYt5P8z"
BOOTSTRAP = f"/ip4/198.51.100.1/tcp/31337/p2p/{ID}"


class Node:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log, self.peer_id = name, log, "QmSelf"

    def shutdown(self) -> None:
        self.log.append(f"{self.name}.shutdown")


class Events:
    def __init__(self):
        self.events = []

    def emit(self, event: str, **fields) -> None:
        self.events.append((event, fields))


@pytest.fixture
def fakes(monkeypatch):
    """``verdict``: what the dial-back check finds; ``log``: shutdowns and restarts in order."""
    f = SimpleNamespace(verdict=Reachability("reachable", ("/ip4/203.0.113.7/tcp/31337",), line="reachable"), log=[])
    monkeypatch.setattr(reachability, "serve_dialback", lambda dht: None)
    monkeypatch.setattr(reachability, "serve_uplink", lambda dht: None)
    monkeypatch.setattr(reachability, "check", lambda dht, peers: f.verdict)

    def start_node(peers, **kwargs):
        f.log.append(f"restart client_mode={kwargs['client_mode']} restart={kwargs['restart']}")
        return Node("relayed", f.log)

    monkeypatch.setattr(reachability, "start_node", start_node)
    return f


def test_a_reachable_peer_keeps_its_node_and_offers_its_announced_addresses(fakes, tmp_path):
    cfg = JoinConfig(
        data_dir=tmp_path,
        initial_peers=(BOOTSTRAP,),
        announce=("/ip4/203.0.113.7/tcp/31337", f"/ip4/203.0.113.8/tcp/1/p2p/{ID}"),
    )
    node = Node("first", fakes.log)
    dht, reach = reachability.reach_out(node, cfg, Events(), identity_path="id.key")
    assert dht is node and fakes.log == []
    assert reach == dataclasses.replace(fakes.verdict, announce=("/ip4/203.0.113.7/tcp/31337",))
    assert not reach.client_mode and reach.relays == ()


def test_an_unreachable_peer_restarts_relayed_and_the_config_stays_as_given(fakes, tmp_path):
    fakes.verdict = Reachability("unreachable", line="not reachable from outside")
    cfg = JoinConfig(data_dir=tmp_path, initial_peers=(BOOTSTRAP,))
    reporter = Events()
    dht, reach = reachability.reach_out(Node("first", fakes.log), cfg, reporter, identity_path="id.key")
    assert fakes.log == ["first.shutdown", "restart client_mode=True restart=True"] and dht.name == "relayed"
    assert reach.status == "unreachable" and reach.client_mode and reach.relays == (BOOTSTRAP,)
    assert not cfg.client_mode
    assert (
        "status",
        {"message": "not reachable from outside", "reachability": "unreachable", "verified": []},
    ) in reporter.events
    with pytest.raises(dataclasses.FrozenInstanceError):
        reach.client_mode = False


def test_client_mode_asked_for_is_not_checked(fakes, tmp_path):
    fakes.verdict = None  # never asked
    cfg = JoinConfig(data_dir=tmp_path, initial_peers=(BOOTSTRAP,), client_mode=True)
    node = Node("first", fakes.log)
    dht, reach = reachability.reach_out(node, cfg, Events(), identity_path="id.key")
    assert dht is node and fakes.log == []
    assert (reach.status, reach.client_mode, reach.relays) == ("unchecked", True, (BOOTSTRAP,))
    dht, reach = reachability.reach_out(
        node, dataclasses.replace(cfg, initial_peers=()), Events(), identity_path="id.key"
    )
    assert reach.client_mode and reach.relays == () and reachability.relay_maddrs(dht, reach) == []


def test_printed_addresses_follow_the_reachability(monkeypatch):
    visible = ["/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.5/tcp/4001", f"{BOOTSTRAP}/p2p-circuit"]
    monkeypatch.setattr(reachability, "visible_maddrs", lambda dht, latest: visible)
    dht = SimpleNamespace(peer_id="QmSelf")
    direct = Reachability("reachable", ("/ip4/203.0.113.7/tcp/4001",), announce=("/ip4/203.0.113.9/tcp/4001",))
    assert reachability.printable_maddrs(dht, direct) == [
        "/ip4/203.0.113.7/tcp/4001/p2p/QmSelf",
        "/ip4/203.0.113.9/tcp/4001/p2p/QmSelf",
        "/ip4/10.0.0.5/tcp/4001/p2p/QmSelf",
        f"{BOOTSTRAP}/p2p-circuit",
    ]
    assert reachability.relay_maddrs(dht, direct) == []
    relayed = Reachability("unreachable", client_mode=True, relays=(BOOTSTRAP,))
    assert reachability.printable_maddrs(dht, relayed) == [f"{BOOTSTRAP}/p2p-circuit"]
    assert reachability.relay_maddrs(dht, relayed) == [f"{BOOTSTRAP}/p2p-circuit/p2p/QmSelf"]
