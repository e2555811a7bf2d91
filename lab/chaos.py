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

Each process is a :class:`peer.launch.Child` (started with :meth:`lab.netlab.Host.run`), whose
stdout is read as JSON events (``--log-format json``) and also kept in ``<name>.events.jsonl``.
Needs root (see :func:`lab.netlab.available`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.netlab import Host, NetLab
from peer.launch import Child, bootstrap_argv, peer_argv

CHAOS_MODEL = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "max_seq_len": 64,
}
"""The model of the chaos test and the soak: 0.49 M parameters, so one payload is ~2 MB and a sync
behind a 20-50 Mbit/s link lasts long enough for a fault to land in it."""


class ChaosSwarm:
    """Bootstrap node and peers in network namespaces; start, fault and watch them.

    Args:
        workdir: logs, identities and checkpoints (one directory per member).
        manifest_path: run manifest (TOML) the bootstrap node announces.
        rate_mbit: every host's uplink rate (tbf), None: unshaped.
        prefix, subnet: names and /24 of the lab (see NetLab); only these are touched.
        peer_args: extra ``peer join`` arguments for every peer.
        peer_entry: what runs ``peer`` in every peer's argv (default ``python -m peer``), e.g.
            ``[python, "lab/standin.py"]``: the rig's compute stand-in (lab/standin.py).
    """

    def __init__(
        self,
        workdir: Path,
        manifest_path: Path,
        *,
        rate_mbit: float | None = 20.0,
        prefix: str = "lsc",
        subnet: str = "10.213.78",
        peer_args: Sequence[str] = (),
        peer_entry: Sequence[str] | None = None,
    ):
        self.workdir, self.manifest_path = Path(workdir), Path(manifest_path)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lab = NetLab(prefix=prefix, subnet=subnet, rate_mbit=rate_mbit)
        self.peer_args = list(peer_args)
        self.peer_entry = list(peer_entry) if peer_entry is not None else None
        self.members: dict[str, Child] = {}
        """The peers, by name (the bootstrap node is ``bootstrap``)."""
        self.bootstrap: Child | None = None
        self.bootstrap_addr: str | None = None
        self.hosts: dict[str, Host] = {}
        """Every member's host, the bootstrap node's included."""
        self.frozen: set[str] = set()
        self.partitioned: set[str] = set()
        self.faults: list[dict[str, Any]] = []
        """Every fault injected: {"time", "fault", "target", ...}; the soak report reads it."""

    # ---- processes ------------------------------------------------------------------------
    def _start(self, name: str, host: Host, argv: list[str]) -> Child:
        self.hosts[name] = host
        return Child(
            name,
            argv,
            log_path=self.workdir / f"{name}.log",
            cwd=self.workdir,
            spawn=host.run,
            events_copy=self.workdir / f"{name}.events.jsonl",
            stack_signal=signal.SIGUSR1,
        ).start()

    def start_bootstrap(self, timeout_s: float = 90.0) -> str:
        """Start the bootstrap node in its own namespace; return its multiaddr."""
        host = self.lab.add_host("boot")
        self.bootstrap = self._start(
            "bootstrap",
            host,
            bootstrap_argv(
                identity=self.workdir / "bootstrap.key",
                run=self.manifest_path,
                host=host.address,
                port=31337,
                extra=["--no-relay"],
            ),
        )
        ready = self.bootstrap.wait_event(lambda e: e.kind == "ready", timeout_s)
        self.bootstrap_addr = ready.addresses_on(host.address)[0]
        return self.bootstrap_addr

    def add_peer(self, name: str, *, initial_peers: Sequence[str] | None = None, extra: Sequence[str] = ()) -> Child:
        """Start a new peer host running ``peer join`` (a joiner, when the swarm is running)."""
        host = self.lab.add_host(name)
        peers = list(initial_peers) if initial_peers is not None else [self.bootstrap_addr]
        argv = peer_argv(
            data_dir=self.workdir / name,
            initial_peers=peers,
            extra=["--host", host.address, "--port", "31337", "--threads", "1", *self.peer_args, *extra],
        )
        if self.peer_entry is not None:  # argv is [python, -m, peer, join, ...]
            argv = [*self.peer_entry, *argv[3:]]
        self.members[name] = self._start(name, host, argv)
        self._note("join", name, initial_peers=peers)
        return self.members[name]

    def peer_addr(self, name: str) -> str:
        """The multiaddr a member announced in its ``started`` event."""
        started = self.members[name].wait_event(lambda e: e.kind == "started", 60)
        return started.addresses_on(self.hosts[name].address)[0]

    def round_of(self, name: str) -> int:
        """The last round peer ``name`` reported finishing (or adopting, or resuming at), -1 before any."""
        for e in reversed(self.members[name].events):
            if e.kind in ("round", "adopted_state", "resumed"):
                return e.round
        return -1

    # ---- faults ----------------------------------------------------------------------------
    def _note(self, fault: str, target: str, **extra: Any) -> None:
        self.faults.append({"time": time.time(), "fault": fault, "target": target, **extra})

    def _signal(self, name: str, sig: int) -> None:
        child = self.bootstrap if name == "bootstrap" else self.members[name]
        child.signal_group(sig)
        self.hosts[name].signal(sig)  # p2pd daemons or children that left the process group

    def kill(self, name: str) -> None:
        """``kill -9`` of every process of the peer (a crash or power loss)."""
        self._signal(name, signal.SIGKILL)
        self.members[name].wait(30)
        self.frozen.discard(name)
        self._note("kill9", name, round=self.round_of(name))

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of the peer: it hangs with its sockets open."""
        self._signal(name, signal.SIGSTOP)
        self.frozen.add(name)
        self._note("sigstop", name, round=self.round_of(name))

    def thaw(self, name: str) -> None:
        self._signal(name, signal.SIGCONT)
        self.frozen.discard(name)
        self._note("sigcont", name, round=self.round_of(name))

    def partition(self, name: str) -> None:
        """Take the peer's link down: it and the swarm cannot reach each other."""
        self.lab.link_down(self.hosts[name])
        self.partitioned.add(name)
        self._note("link_down", name, round=self.round_of(name))

    def heal(self, name: str) -> None:
        self.lab.link_up(self.hosts[name])
        self.partitioned.discard(name)
        self._note("link_up", name, round=self.round_of(name))

    def restart(self, name: str, *, initial_peers: Sequence[str] | None = None) -> Child:
        """Start a killed peer again with the same identity and data directory.

        Raises:
            RuntimeError: it is still running.
        """
        child = self.members[name]
        argv = None
        if initial_peers is not None:
            argv = list(child.argv)
            while "--initial-peers" in argv:
                i = argv.index("--initial-peers")
                del argv[i : i + 2]
            argv += [a for p in initial_peers for a in ("--initial-peers", p)]
        child.start(argv)
        self._note("restart", name)
        return child

    def kill_bootstrap(self) -> None:
        if self.bootstrap is not None:
            self._signal("bootstrap", signal.SIGKILL)
            self.bootstrap.wait(30)
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
        for name, child in self.members.items():
            for e in child.of("round"):
                if len(e.get("agreeing", [])) > 1:
                    digests.setdefault((e.round, tuple(e["agreeing"])), {})[name] = e["state_digest"]
        return [
            f"round {r}, group of {len(g)}: {by_peer}"
            for (r, g), by_peer in sorted(digests.items())
            if len(set(by_peer.values())) > 1
        ]

    def live_peers(self) -> list[Child]:
        return [c for n, c in self.members.items() if c.alive and n not in self.frozen and n not in self.partitioned]

    def wait_rounds(self, names: Sequence[str], round_: int, timeout_s: float) -> None:
        """Wait until every named peer reports round ``round_`` (or later)."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            self.members[name].wait_event(
                lambda e: e.kind in ("round", "adopted_state") and e.round >= round_,
                max(1.0, deadline - time.monotonic()),
            )

    def close(self) -> None:
        """Stop everything (SIGCONT first, so frozen processes can die) and remove the lab."""
        everyone = {**self.members, **({"bootstrap": self.bootstrap} if self.bootstrap else {})}
        for name, child in everyone.items():
            if child.alive:
                self._signal(name, signal.SIGCONT)
                self._signal(name, signal.SIGKILL)
        self.lab.close()
        for child in everyone.values():
            if child.popen is not None:
                child.wait()
                child.join_output()

    def __enter__(self) -> ChaosSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_rig_bench(parser, args, prefix: str) -> Path:
    """Common start of a benchmark on the rig (bench/overlap_rig.py, bench/pipeline_rig.py): refuse
    (``parser.error``) where network namespaces are unavailable or ``args.rounds`` leaves nothing
    after ``args.warmup``; make SIGTERM unwind (so the lab's namespaces go away); return the work
    directory (``args.workdir`` or a new temporary one named ``prefix``...)."""
    import sys
    import tempfile

    from lab.netlab import available

    ok, why = available()
    if not ok:
        parser.error(f"the network-namespace rig is not available here: {why}")
    if args.rounds < args.warmup + 2:
        parser.error(f"--rounds {args.rounds}: need at least --warmup + 2 = {args.warmup + 2}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
