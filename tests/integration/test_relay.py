"""A peer nobody can dial is reachable through the bootstrap node's circuit relay (issue 16, item 1).

Real processes in network namespaces (lab/netlab.py): a bootstrap node, a peer whose host drops
every incoming TCP connection (tests/integration/test_reachability.py ``refuse_incoming_tcp``), and
an outsider that dials the peer only through the relay address the peer printed.

The lab uses a public-range subnet on purpose: go-libp2p's auto relay ignores relays whose
addresses are private (10/8, 192.168/16, ...), so with the private subnet of test_reachability.py
no slot is ever reserved. The namespaces are isolated: nothing leaves the machine. go-libp2p asks
for a slot about three minutes after it judged itself private, so the outsider tries for up to
six.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import netlab
from peer.launch import Child, peer_argv, stop_all
from tests.integration.test_reachability import BOOT_PORT, can_connect, refuse_incoming_tcp

OK, WHY = netlab.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"needs network namespaces: {WHY}"), pytest.mark.timeout(720)]

PUBLIC_SUBNET = "5.213.93"
"""An isolated bridge: the address range only has to look public to go-libp2p."""
RELAY_WAIT_S = 360.0


def test_a_walled_peer_is_reachable_through_the_bootstrap_relay(tmp_path: Path):
    with netlab.NetLab(prefix="lsz", subnet=PUBLIC_SUBNET) as lab:
        boot, walled, outsider = lab.add_host("boot"), lab.add_host("walled"), lab.add_host("outsider")
        refuse_incoming_tcp(walled)
        children: list[Child] = []

        def start(name: str, argv: list[str]) -> Child:
            child = Child(name, argv, log_path=tmp_path / f"{name}.log", cwd=tmp_path, spawn=lab.hosts[name].run)
            children.append(child)
            return child.start()

        try:
            bootstrap = start(
                "boot",
                [
                    sys.executable,
                    "-m",
                    "bootstrap",
                    "run",
                    "--host",
                    boot.address,
                    "--port",
                    str(BOOT_PORT),
                    "--identity",
                    str(tmp_path / "boot.key"),
                    "--preset",
                    "tiny",
                    "--log-format",
                    "json",
                ],
            )
            [boot_addr] = bootstrap.wait_event(lambda e: e.kind == "ready", 240).addresses_on(boot.address)
            assert not can_connect(outsider, walled.address, 9)  # the lab: nobody dials the walled host

            peer = start(
                "walled", peer_argv(data_dir=tmp_path / "walled", initial_peers=[boot_addr], extra=["--threads", "1"])
            )
            reach = peer.wait_event(lambda e: e.kind == "status" and "reachability" in e, 240)
            assert reach["reachability"] == "unreachable", reach["message"]
            up = peer.wait_event(lambda e: e.kind == "started", 300)
            assert up["relayed_at"] == [f"{boot_addr}/p2p-circuit/p2p/{up['peer_id']}"], up["relayed_at"]

            # the outsider reads the swarm through the walled peer alone, at the address it printed
            deadline, last = time.monotonic() + RELAY_WAIT_S, ""
            while time.monotonic() < deadline:
                result = subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        outsider.netns,
                        sys.executable,
                        "-m",
                        "peer",
                        "status",
                        "--initial-peers",
                        up["relayed_at"][0],
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    cwd=str(tmp_path),
                )
                if result.returncode == 0:
                    break
                last = (result.stdout + result.stderr).strip().splitlines()[-1:]
                time.sleep(15)
            else:
                pytest.fail(f"the walled peer was not reachable through the relay within {RELAY_WAIT_S:.0f} s: {last}")
            assert up["peer_id"][:8] in result.stdout or "1 live peer" in result.stdout, result.stdout
        finally:
            for child in children:
                child.send(signal.SIGINT)
            stop_all(children, 20.0)
