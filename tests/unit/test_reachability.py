"""The dial-back check's wire format and verdict, and the addresses a peer prints for others
(peer/net/reachability.py, peer/reachability.py); the real thing runs in
tests/integration/test_reachability.py."""

import asyncio

import msgpack
import pytest

from peer.net.reachability import (
    GREETING,
    MAX_PORTS,
    DialBack,
    encode_request,
    observed_ip,
    parse_answer,
    parse_request,
    speaks_libp2p,
)
from peer.reachability import dialable_maddrs, judge, listen_ports, peer_ids
from protocol.errors import BadPayload

ID = "12D3KooWKypwB8ARFtvZsniHQMbzHYKNEM9Eaov1exVoCKYt5P8z"


def test_request_round_trip_and_bad_requests():
    assert parse_request(encode_request([31337, 4001])) == [31337, 4001]
    for bad in (
        msgpack.packb({"ports": []}),
        msgpack.packb({"ports": [0]}),
        msgpack.packb({"ports": [70000]}),
        msgpack.packb({"ports": [True]}),
        msgpack.packb({"ports": list(range(1, MAX_PORTS + 2))}),
        msgpack.packb([1, 2]),
        b"\xc1garbage",
    ):
        with pytest.raises(BadPayload):
            parse_request(bad)


def test_answer_parsing():
    answer = parse_answer(msgpack.packb({"observed": "203.0.113.7", "reachable": [31337]}), "Qm")
    assert answer == DialBack(checker="Qm", observed="203.0.113.7", reachable=(31337,))
    for bad in (
        msgpack.packb({"observed": "not an ip", "reachable": []}),
        msgpack.packb({"observed": 7, "reachable": []}),
        msgpack.packb({"observed": "", "reachable": ["x"]}),
    ):
        with pytest.raises(BadPayload):
            parse_answer(bad, "Qm")


def test_observed_ip_of_a_connection():
    assert observed_ip("/ip4/203.0.113.7/tcp/52344") == "203.0.113.7"
    assert observed_ip("/ip6/2001:db8::1/tcp/1") == "2001:db8::1"
    assert observed_ip("/ip4/10.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit") == ""  # relayed: nothing to dial back
    assert observed_ip("/dns4/example.org/tcp/1") == ""


def test_a_port_counts_only_when_it_greets_like_libp2p():
    async def main():
        async def libp2p(reader, writer):
            writer.write(b"\x13" + GREETING + b"\n")
            await writer.drain()
            writer.close()

        async def other(reader, writer):
            writer.write(b"SSH-2.0-OpenSSH\r\n")
            await writer.drain()
            writer.close()

        servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (libp2p, other)]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        try:
            return [await speaks_libp2p("127.0.0.1", p, timeout_s=2) for p in ports]
        finally:
            for s in servers:
                s.close()

    assert asyncio.run(main()) == [True, False]


def test_verdict_from_the_answers():
    reached = judge([DialBack("QmA", "203.0.113.7", (31337,)), DialBack("QmB", "", (), error="timed out")])
    assert reached.status == "reachable" and reached.verified == ("/ip4/203.0.113.7/tcp/31337",)
    walled = judge([DialBack("QmA", "203.0.113.7", ())])
    assert walled.status == "unreachable" and "203.0.113.7" in walled.line and "client mode" in walled.line
    unknown = judge([DialBack("QmA", "", (), error="ControlFailure: protocol not supported")])
    assert unknown.status == "unknown" and "protocol not supported" in unknown.line
    assert "\n" not in walled.line + reached.line + unknown.line


def test_printed_addresses_prefer_what_others_can_use():
    visible = [f"/ip4/127.0.0.1/tcp/4001/p2p/{ID}", f"/ip4/192.168.1.20/tcp/4001/p2p/{ID}"]
    assert dialable_maddrs(visible, ID) == [f"/ip4/192.168.1.20/tcp/4001/p2p/{ID}"]  # no loopback beside it
    assert dialable_maddrs(
        visible, ID, verified=["/ip4/203.0.113.7/tcp/4001"], announce=["/dns4/me.example.org/tcp/4001"]
    ) == [
        f"/ip4/203.0.113.7/tcp/4001/p2p/{ID}",
        f"/dns4/me.example.org/tcp/4001/p2p/{ID}",
        f"/ip4/192.168.1.20/tcp/4001/p2p/{ID}",
    ]
    only_loopback = [f"/ip4/127.0.0.1/tcp/4001/p2p/{ID}"]
    assert dialable_maddrs(only_loopback, ID) == only_loopback  # --host 127.0.0.1: that is all there is
    relay = f"/ip4/198.51.100.1/tcp/31337/p2p/QmBoot/p2p-circuit/p2p/{ID}"
    assert dialable_maddrs([*only_loopback, relay], ID) == [*only_loopback, relay]
    assert listen_ports([*visible, relay]) == [4001]
    assert peer_ids([f"/ip4/1.2.3.4/tcp/1/p2p/{ID}", f"/ip4/1.2.3.5/tcp/1/p2p/{ID}"]) == [ID]
