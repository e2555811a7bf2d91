"""A lab network on one machine: every host in its own network namespace, behind a shaped link.

Used by the line-rate benchmark (bench/linerate.py) and the chaos harness (lab/chaos.py). Needs
root and ``ip`` / ``tc`` (iproute2); :func:`available` says why not where it cannot run.

Topology: a bridge in the root namespace with address ``SUBNET.1/24``; each host is a namespace
``<prefix>-<name>`` joined to the bridge by a veth pair, with address ``SUBNET.<10+i>`` on its
``eth0``. With ``rate_mbit`` both directions of each host's link are shaped by ``tc tbf`` (the
host's egress on its ``eth0``, its ingress on the bridge side), like a home line of that speed.
Only the namespaces and addresses made here are ever targeted.

Trap handled (docs/architecture.md): once a Docker daemon has run, iptables' FORWARD policy is DROP and
bridge netfilter is on, so bridged traffic silently vanishes; the lab inserts its own ACCEPT
rule for its bridge and removes it on :meth:`NetLab.close`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> tuple[bool, str]:
    """(True, '') where network namespaces and tbf can be used, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"lswprobe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return False, f"`ip netns add` failed: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


@dataclass
class Host:
    name: str
    netns: str
    address: str
    veth_root: str
    """The bridge-side end of the host's link (shaping of its downlink; link down/up)."""
    veth_host: str = "eth0"
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, argv: Sequence[str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside this host's namespace (a new process group, killed on close).

        ``popen`` goes to ``subprocess.Popen`` (so this can be a ``peer.launch.Child``'s spawn).
        """
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], **popen)
        self.procs.append(proc)
        return proc

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process in this host's namespace (p2pd daemons included)."""
        pids = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass

    def exec(self, argv: Sequence[str]) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], check=True, capture_output=True, text=True)


class NetLab:
    """Create hosts on a private bridge; shape, cut and restore their links; clean up everything.

    Args:
        prefix: short name for the bridge and namespaces (at most 6 characters).
        subnet: the first three octets of a private /24 used only by this lab.
        rate_mbit: shape each host's uplink (its egress) to this rate (None: unshaped).
        downlink_mbit: shape each host's downlink too (None: only the uplink is shaped, the
            usual home line, whose download is several times faster than its upload).
    """

    def __init__(
        self,
        prefix: str = "lsw",
        subnet: str = "10.213.77",
        rate_mbit: float | None = None,
        downlink_mbit: float | None = None,
    ):
        if len(prefix) > 6:
            raise ValueError(f"prefix {prefix!r} is longer than 6 characters (interface names are limited to 15)")
        self.prefix, self.subnet, self.rate_mbit, self.downlink_mbit = prefix, subnet, rate_mbit, downlink_mbit
        self.bridge = f"{prefix}br0"
        self.hosts: dict[str, Host] = {}
        self._iptables_rule: list[str] | None = None
        self._cleanup_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        if shutil.which("iptables"):
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
                self._iptables_rule = rule

    def _cleanup_stale(self) -> None:
        """Remove what a crashed earlier lab of the same prefix left behind."""
        listing = _ip("netns", "list", check=False).stdout.split()
        for name in listing:
            if name.startswith(f"{self.prefix}-"):
                _ip("netns", "del", name, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if link.startswith(f"{self.prefix}v"):
                _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, with its loopback up and its link shaped."""
        index = len(self.hosts)
        if index >= 200:
            raise ValueError("a lab holds at most 200 hosts")
        netns, veth_root = f"{self.prefix}-{name}", f"{self.prefix}v{index}"
        address = f"{self.subnet}.{10 + index}"
        _ip("netns", "add", netns)
        _ip("link", "add", veth_root, "type", "veth", "peer", "name", f"{veth_root}h")
        _ip("link", "set", f"{veth_root}h", "netns", netns)
        _ip("-n", netns, "link", "set", f"{veth_root}h", "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "set", veth_root, "master", self.bridge)
        _ip("link", "set", veth_root, "up")
        host = Host(name=name, netns=netns, address=address, veth_root=veth_root)
        if self.rate_mbit:
            self.shape(host, self.rate_mbit, self.downlink_mbit)
        self.hosts[name] = host
        return host

    @staticmethod
    def _tbf(rate_mbit: float) -> list[str]:
        burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # ≥ one timer tick of data at this rate
        return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]

    def shape(self, host: Host, uplink_mbit: float, downlink_mbit: float | None = None) -> None:
        """Shape ``host``'s uplink (and its downlink, if given) with tbf."""
        host.exec(["tc", "qdisc", "replace", "dev", host.veth_host, "root", "handle", "1:", *self._tbf(uplink_mbit)])
        if downlink_mbit:
            subprocess.run(
                ["tc", "qdisc", "replace", "dev", host.veth_root, "root", *self._tbf(downlink_mbit)],
                check=True,
                capture_output=True,
            )

    def link_down(self, host: Host) -> None:
        """Cut ``host`` off the network (a partition); its processes and sockets stay."""
        _ip("link", "set", host.veth_root, "down")

    def link_up(self, host: Host) -> None:
        _ip("link", "set", host.veth_root, "up")

    def close(self) -> None:
        """Kill every process started in the lab and remove its namespaces, links and rules, and the
        torch shared-memory segments (``/dev/shm/torch_<pid>_*``) its killed processes left."""
        killed: set[str] = set()
        for host in self.hosts.values():
            killed.update(_ip("netns", "pids", host.netns, check=False).stdout.split())
            killed.update(str(proc.pid) for proc in host.procs)
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in host.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            host.signal(signal.SIGKILL)  # anything left, e.g. a p2pd daemon that escaped the group
            _ip("link", "del", host.veth_root, check=False)
            _ip("netns", "del", host.netns, check=False)
        self.hosts.clear()
        _remove_shared_memory(killed)
        _ip("link", "del", self.bridge, check=False)
        if self._iptables_rule is not None:
            subprocess.run(["iptables", "-D", *self._iptables_rule], capture_output=True)
            self._iptables_rule = None

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_shared_memory(pids: set[str], shm: Path = Path("/dev/shm")) -> None:
    """Remove the torch shared-memory files (``torch_<pid>_*``) of ``pids`` that are no longer
    running: a process killed with SIGKILL cannot unlink its own, and they hold memory until removed."""
    for pid in pids:
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for leftover in shm.glob(f"torch_{pid}_*"):
            leftover.unlink(missing_ok=True)
