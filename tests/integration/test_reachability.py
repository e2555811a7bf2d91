"""Reachable by default (issue 16, item 1), on real hosts: a bootstrap node and peers, each in its
own network namespace (lab/netlab.py).

A peer with default flags listens on all interfaces, is dialed back by the bootstrap node
(peer/net/reachability.py) and prints its lab address, not 127.0.0.1. A peer whose host drops
every incoming TCP connection (a NAT or firewall: SYNs towards it are held back by tc, see
:func:`refuse_incoming_tcp`) says in one line that it cannot be dialed and goes on in client
mode, relayed through the bootstrap node: it still joins the run and averages with the open peer.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lab import netlab
from peer.launch import Child, peer_argv, stop_all

OK, WHY = netlab.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"needs network namespaces: {WHY}"), pytest.mark.timeout(600)]

BOOT_PORT = 31337


def refuse_incoming_tcp(host: netlab.Host) -> None:
    """Make ``host`` undialable while it can still dial out: every TCP SYN towards it (leaving the
    bridge through its link's root end) goes to an htb class of 8 bit/s, so it waits minutes and
    each connection attempt times out. iptables is not installed on these machines; a SYN-ACK, the
    answer to this host's own connections, is not held back."""

    def tc(*args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True)

    dev = host.veth_root
    tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
    tc(
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:2",
        "htb",
        "rate",
        "8bit",
        "ceil",
        "8bit",
        "burst",
        "1",
        "cburst",
        "1",
    )
    # IPv4 without options: the TCP flags byte is at offset 20 + 13; 0x02 = SYN alone
    tc(
        "filter",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
        "match",
        "ip",
        "protocol",
        "6",
        "0xff",
        "match",
        "u8",
        "0x02",
        "0xff",
        "at",
        "33",
        "flowid",
        "1:2",
    )
    # htb lets a class's first packet through on credit: spend it on a SYN of our own
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect((host.address, 9))
        except OSError:
            pass


def can_connect(host: netlab.Host, address: str, port: int) -> bool:
    code = (
        "import socket,sys\ns=socket.socket();s.settimeout(3)\n"
        f"sys.exit(0 if s.connect_ex(({address!r},{port}))==0 else 1)"
    )
    return host.run(["python3", "-c", code]).wait(timeout=30) == 0


@pytest.fixture
def lab():
    with netlab.NetLab(prefix="lsr", subnet="10.213.93") as lab:
        yield lab


def start(lab: netlab.NetLab, workdir: Path, children: list[Child], name: str, argv: list[str]) -> Child:
    host = lab.hosts[name]
    child = Child(name, argv, log_path=workdir / f"{name}.log", cwd=workdir, spawn=host.run)
    children.append(child)
    return child.start()


def start_bootstrap(lab: netlab.NetLab, workdir: Path, children: list[Child], boot: netlab.Host):
    """The bootstrap node of a tiny run on ``boot``; its ``ready`` event and its lab address."""
    argv = [sys.executable, "-m", "bootstrap", "run", "--host", boot.address, "--port", str(BOOT_PORT)]
    argv += ["--identity", str(workdir / "boot.key"), "--preset", "tiny", "--log-format", "json"]
    ready = start(lab, workdir, children, "boot", argv).wait_event(lambda e: e.kind == "ready", 240)
    [boot_addr] = ready.addresses_on(boot.address)
    return ready, boot_addr


def joiner(lab: netlab.NetLab, workdir: Path, children: list[Child], boot_addr: str):
    def join(name: str) -> Child:  # default --host: all interfaces
        argv = peer_argv(data_dir=workdir / name, initial_peers=[boot_addr], extra=["--threads", "1"])
        return start(lab, workdir, children, name, argv)

    return join


def test_default_peer_is_reachable_and_a_firewalled_one_falls_back(lab, tmp_path: Path):
    boot, open_host, walled = lab.add_host("boot"), lab.add_host("open"), lab.add_host("walled")
    refuse_incoming_tcp(walled)
    children: list[Child] = []
    try:
        ready, boot_addr = start_bootstrap(lab, tmp_path, children, boot)
        # the lab itself: the walled host cannot be dialed, the open one can, both dial out
        assert not can_connect(open_host, walled.address, 9) and can_connect(walled, boot.address, BOOT_PORT)

        join = joiner(lab, tmp_path, children, boot_addr)
        # The walled peer joins the run the open peer trains (started together, it could be the first
        # to train, alone, rounds ahead of the open peer: the case of the next test).
        peers = {"open": join("open")}

        def verdict(name: str):
            return peers[name].wait_event(lambda e: e.kind == "status" and "reachability" in e, 240)

        def started(name: str):
            return peers[name].wait_event(lambda e: e.kind == "started", 300)

        reach = verdict("open")
        assert reach["reachability"] == "reachable", reach["message"]
        [verified] = reach["verified"]
        assert verified.startswith(f"/ip4/{open_host.address}/tcp/")
        up = started("open")
        assert up.maddrs[0] == f"{verified}/p2p/{up['peer_id']}"
        assert not any("/127.0.0.1/" in m for m in up.maddrs), up.maddrs  # a non-loopback address exists
        peers["walled"] = join("walled")

        reach = verdict("walled")
        assert reach["reachability"] == "unreachable", reach["message"]
        assert "not reachable from outside" in reach["message"] and walled.address in reach["message"]
        assert "client mode" in reach["message"] and "\n" not in reach["message"]
        up = started("walled")  # it goes on, in client mode, to the swarm's run
        assert up["run_id"] == ready["run_id"]
        # no direct address is offered: only relay addresses, none until a relay slot is granted
        assert not any(walled.address in m.split("/p2p-circuit")[-1] for m in up.maddrs), up.maddrs
        assert all("/p2p-circuit/" in m for m in up.maddrs), up.maddrs
        # and it averages with the open peer: it dials every groupmate; it publishes no state digest
        # (nobody could download it), and follows the open peer's state whenever they diverge
        together = peers["walled"].wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 300)
        assert together["round"] >= 1
    finally:
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)


def test_a_firewalled_peer_that_trained_alone_first_joins_the_swarm_behind_it(lab, tmp_path: Path):
    """The firewalled peer is the first to train: alone, rounds ahead of the open peer that comes
    later, which cannot download its state (client mode serves none). It steps back to the open
    peer's state (its loss held against the run's initial φ, not its own better trained one) and
    the two average from then on."""
    boot, _, walled = lab.add_host("boot"), lab.add_host("open"), lab.add_host("walled")
    refuse_incoming_tcp(walled)
    children: list[Child] = []
    try:
        _, boot_addr = start_bootstrap(lab, tmp_path, children, boot)
        join = joiner(lab, tmp_path, children, boot_addr)
        walled_peer = join("walled")
        alone = walled_peer.wait_event(lambda e: e.kind == "round" and e["round"] >= 3, 300)
        assert alone["group_size"] == 1
        join("open")
        stepped = walled_peer.wait_event(lambda e: e.kind == "adopted_state", 300)
        assert stepped["reason"] == "raced ahead", stepped
        together = walled_peer.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 300)
        assert together["round"] >= stepped["round"]
    finally:
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)
