"""peer/net/uplink.py: the uplink probe's frames and the serving side's limits (one module; the
probe over real sockets runs in tests/integration/test_doctor_swarm.py)."""

from __future__ import annotations

import msgpack
import pytest

from peer.net import uplink
from peer.net.uplink import MAX_CONCURRENT, MAX_PROBE_BYTES, PEER_BUDGET_BYTES, PEER_WINDOW_S, UplinkProbe
from protocol.errors import BadPayload


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"bytes": 0}),
        msgpack.packb({"bytes": MAX_PROBE_BYTES + 1}),
        msgpack.packb({"bytes": True}),
        msgpack.packb({"bytes": "8"}),
        msgpack.packb({"n": 5}),
    ],
)
def test_a_bad_request_is_refused(payload):
    with pytest.raises(BadPayload):
        uplink.parse_request(payload)


def test_a_good_request_and_answers():
    assert uplink.parse_request(msgpack.packb({"bytes": MAX_PROBE_BYTES})) == MAX_PROBE_BYTES
    assert uplink.parse_answer(msgpack.packb({"received": 7})) == 7
    with pytest.raises(BadPayload, match="refused the probe: busy"):
        uplink.parse_answer(msgpack.packb({"refused": "busy\x1b[2J"}))
    with pytest.raises(BadPayload):
        uplink.parse_answer(msgpack.packb({"received": -1}))


def test_the_server_admits_at_most_max_concurrent_and_a_budget_per_peer():
    server = uplink._Server()
    assert [server.admit(f"p{i}", 1, now=0.0) for i in range(MAX_CONCURRENT)] == [""] * MAX_CONCURRENT
    assert server.admit("other", 1, now=0.0) == "busy"
    server.slots = 0
    assert server.admit("greedy", PEER_BUDGET_BYTES, now=1.0) == ""
    server.slots = 0
    assert server.admit("greedy", 1, now=2.0).startswith("over budget")
    assert server.admit("greedy", 1, now=1.0 + PEER_WINDOW_S) == ""  # the window passed
    assert set(server.spent) == {"greedy"}  # peers whose window passed are forgotten


def test_a_probe_figure():
    assert UplinkProbe(checker="x", bytes=2**20, seconds=1.0).mbit_per_s == pytest.approx(8.388608)
    assert UplinkProbe(checker="x", bytes=0, seconds=0.0, error="timed out").mbit_per_s is None
