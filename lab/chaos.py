"""Chaos harness: a swarm of real peer processes, each its own host on a shaped link, and faults.

Used by the chaos test (tests/chaos/) and the soak benchmark (bench/soak.py). Every peer and the
bootstrap node run ``peer join`` / ``bootstrap run`` in their own network namespace of a
:class:`lab.netlab.NetLab`, with their own address, behind a tbf-shaped uplink. Faults:

* :meth:`ChaosSwarm.kill` — ``kill -9`` of the whole peer (its DHT, averager and p2pd
  processes too: a machine that lost power);
* :meth:`ChaosSwarm.freeze` / :meth:`ChaosSwarm.thaw` — SIGSTOP / SIGCONT of the whole peer: a
  hung host whose sockets stay open;
* :meth:`ChaosSwarm.partition` / :meth:`ChaosSwarm.heal` — its link down, then up;
* :meth:`ChaosSwarm.add_peer` at any time — a joiner; :meth:`ChaosSwarm.restart` — the same
  identity and data directory again, after a kill;
* :meth:`ChaosSwarm.kill_bootstrap`.

Each process's stdout is read as JSON events (``--log-format json``) into :class:`Member.events`.
Needs root (see :func:`lab.netlab.available`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from lab.netlab import Host, NetLab

CHAOS_MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 384,
               "max_seq_len": 64}
"""The model of the chaos test and the soak: 0.49 M parameters, so one payload is ~2 MB and a sync
behind a 20-50 Mbit/s link lasts long enough for a fault to land in it."""


@dataclass
class Member:
    """One process of the swarm (a peer or the bootstrap node) and what it printed."""

    name: str
    host: Host
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    frozen: bool = False
    partitioned: bool = False
    starts: int = 0
    _reading: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e.get("event") == kind]

    def rounds(self) -> list[dict[str, Any]]:
        return self.of("round")

    @property
    def round(self) -> int:
        """The last round this peer reported finishing (or adopting), -1 before any."""
        with self._cond:
            for e in reversed(self.events):
                if e.get("event") in ("round", "adopted_state", "resumed"):
                    return int(e["round"])
        return -1

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, *,
                 since: int = 0) -> dict[str, Any]:
        """First event from index ``since`` on that satisfies ``predicate``.

        Raises:
            TimeoutError: none within ``timeout_s`` (the message has the log's tail).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for e in self.events[since:]:
                    if predicate(e):
                        return e
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.popen is not None and self.popen.poll() is not None
                                      and not self._reading):
                    raise TimeoutError(f"{self.name}: no matching event within {timeout_s:.0f} s "
                                       f"(alive={self.alive}); log tail:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.5))

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class ChaosSwarm:
    """Bootstrap node and peers in network namespaces; start, fault and watch them.

    Args:
        workdir: logs, identities and checkpoints (one directory per member).
        manifest_path: run manifest (TOML) the bootstrap node announces.
        rate_mbit: every host's uplink rate (tbf), None: unshaped.
        prefix, subnet: names and /24 of the lab (see NetLab); only these are touched.
        peer_args: extra ``peer join`` arguments for every peer.
    """

    def __init__(self, workdir: Path, manifest_path: Path, *, rate_mbit: float | None = 20.0,
                 prefix: str = "lsc", subnet: str = "10.213.78", peer_args: Sequence[str] = ()):
        self.workdir, self.manifest_path = Path(workdir), Path(manifest_path)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lab = NetLab(prefix=prefix, subnet=subnet, rate_mbit=rate_mbit)
        self.peer_args = list(peer_args)
        self.members: dict[str, Member] = {}
        self.bootstrap: Member | None = None
        self.bootstrap_addr: str | None = None
        self.faults: list[dict[str, Any]] = []
        """Every fault injected: {"time", "fault", "target", ...}; the soak report reads it."""

    # ---- processes ------------------------------------------------------------------------
    def _spawn(self, member: Member) -> None:
        member.starts += 1
        log = open(member.log, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        member.popen = member.host.run([sys.executable, *member.argv], stdout=subprocess.PIPE, stderr=log,
                                       stdin=subprocess.DEVNULL, cwd=self.workdir, env=env)
        log.close()
        member._reading = True
        popen = member.popen
        events_file = self.workdir / f"{member.name}.events.jsonl"

        def read() -> None:
            with open(events_file, "ab") as out:
                for raw in popen.stdout:
                    out.write(raw)
                    out.flush()
                    self._on_line(member, raw)
            popen.stdout.close()
            with member._cond:
                member._reading = False
                member._cond.notify_all()

        threading.Thread(target=read, daemon=True, name=f"chaos-read-{member.name}").start()

    @staticmethod
    def _on_line(member: Member, raw: bytes) -> None:
        try:
            event = json.loads(raw)
        except json.JSONDecodeError:
            return
        event["_start"] = member.starts
        with member._cond:
            member.events.append(event)
            member._cond.notify_all()

    def start_bootstrap(self, timeout_s: float = 90.0) -> str:
        """Start the bootstrap node in its own namespace; return its multiaddr."""
        host = self.lab.add_host("boot")
        member = Member(name="bootstrap", host=host, log=self.workdir / "bootstrap.log", argv=[
            "-m", "bootstrap", "run", "--host", host.address, "--port", "31337",
            "--identity", str(self.workdir / "bootstrap.key"), "--run", str(self.manifest_path),
            "--no-relay", "--log-format", "json"])
        self._spawn(member)
        ready = member.wait_for(lambda e: e.get("event") == "ready", timeout_s)
        self.bootstrap = member
        self.bootstrap_addr = next(a for a in ready["maddrs"] if f"/ip4/{host.address}/" in a)
        return self.bootstrap_addr

    def add_peer(self, name: str, *, initial_peers: Sequence[str] | None = None,
                 extra: Sequence[str] = ()) -> Member:
        """Start a new peer host running ``peer join`` (a joiner, when the swarm is running)."""
        host = self.lab.add_host(name)
        peers = list(initial_peers) if initial_peers is not None else [self.bootstrap_addr]
        argv = ["-m", "peer", "join", "--host", host.address, "--port", "31337",
                "--data-dir", str(self.workdir / name), "--threads", "1", "--log-format", "json",
                *[a for p in peers for a in ("--initial-peers", p)], *self.peer_args, *extra]
        member = Member(name=name, host=host, argv=argv, log=self.workdir / f"{name}.log")
        self.members[name] = member
        self._spawn(member)
        self._note("join", name, initial_peers=peers)
        return member

    def peer_addr(self, name: str) -> str:
        """The multiaddr a member announced in its ``started`` event."""
        member = self.members[name]
        started = member.wait_for(lambda e: e.get("event") == "started", 60)
        return next(a for a in started["maddrs"] if f"/ip4/{member.host.address}/" in a)

    # ---- faults ----------------------------------------------------------------------------
    def _note(self, fault: str, target: str, **extra: Any) -> None:
        self.faults.append({"time": time.time(), "fault": fault, "target": target, **extra})

    def _signal_group(self, member: Member, sig: int) -> None:
        if member.popen is None:
            return
        try:
            os.killpg(member.popen.pid, sig)
        except ProcessLookupError:
            pass
        member.host.signal(sig)  # p2pd daemons or children that left the process group

    def kill(self, name: str) -> None:
        """``kill -9`` of every process of the peer (a crash or power loss)."""
        member = self.members[name]
        self._signal_group(member, signal.SIGKILL)
        if member.popen is not None:
            member.popen.wait(timeout=30)
        member.frozen = False
        self._note("kill9", name, round=member.round)

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of the peer: it hangs with its sockets open."""
        member = self.members[name]
        self._signal_group(member, signal.SIGSTOP)
        member.frozen = True
        self._note("sigstop", name, round=member.round)

    def thaw(self, name: str) -> None:
        member = self.members[name]
        self._signal_group(member, signal.SIGCONT)
        member.frozen = False
        self._note("sigcont", name, round=member.round)

    def partition(self, name: str) -> None:
        """Take the peer's link down: it and the swarm cannot reach each other."""
        member = self.members[name]
        self.lab.link_down(member.host)
        member.partitioned = True
        self._note("link_down", name, round=member.round)

    def heal(self, name: str) -> None:
        member = self.members[name]
        self.lab.link_up(member.host)
        member.partitioned = False
        self._note("link_up", name, round=member.round)

    def restart(self, name: str, *, initial_peers: Sequence[str] | None = None) -> Member:
        """Start a killed peer again with the same identity and data directory."""
        member = self.members[name]
        if member.alive:
            raise RuntimeError(f"{name} is still running; kill it first")
        if initial_peers is not None:
            argv = [a for a in member.argv]
            while "--initial-peers" in argv:
                i = argv.index("--initial-peers")
                del argv[i:i + 2]
            member.argv = argv + [a for p in initial_peers for a in ("--initial-peers", p)]
        self._spawn(member)
        self._note("restart", name)
        return member

    def kill_bootstrap(self) -> None:
        if self.bootstrap is not None:
            self._signal_group(self.bootstrap, signal.SIGKILL)
            if self.bootstrap.popen is not None:
                self.bootstrap.popen.wait(timeout=30)
            self._note("kill_bootstrap", "bootstrap")

    # ---- watching --------------------------------------------------------------------------
    def disagreements(self) -> list[str]:
        """Rounds after which peers that completed them in the same group hold different states.

        A peer's ``round`` event lists, as ``agreeing``, the groupmates it completed the round with
        that started it from the same state (only itself when the round failed or left out a
        groupmate), and the digest of its state afterwards; peers listing the same two or more
        peers at the same round must list the same digest.
        """
        digests: dict[tuple[int, tuple[str, ...]], dict[str, str]] = {}
        for member in self.members.values():
            for e in member.rounds():
                if len(e.get("agreeing", [])) > 1:
                    digests.setdefault((e["round"], tuple(e["agreeing"])), {})[member.name] = e["state_digest"]
        return [f"round {r}, group of {len(g)}: {by_peer}" for (r, g), by_peer in sorted(digests.items())
                if len(set(by_peer.values())) > 1]

    def live_peers(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive and not m.frozen and not m.partitioned]

    def wait_rounds(self, names: Sequence[str], round_: int, timeout_s: float) -> None:
        """Wait until every named peer reports round ``round_`` (or later)."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            member = self.members[name]
            member.wait_for(lambda e: e.get("event") in ("round", "adopted_state") and e["round"] >= round_,
                            max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop everything (SIGCONT first, so frozen processes can die) and remove the lab."""
        everyone = [*self.members.values(), *([self.bootstrap] if self.bootstrap else [])]
        for member in everyone:
            if member.alive:
                self._signal_group(member, signal.SIGCONT)
                self._signal_group(member, signal.SIGKILL)
        self.lab.close()
        for member in everyone:
            if member.popen is not None:
                member.popen.wait()
                with member._cond:
                    member._cond.wait_for(lambda: not member._reading, timeout=10)

    def __enter__(self) -> ChaosSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
