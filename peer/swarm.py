"""`peer swarm`: a bootstrap node and N peers as separate OS processes on 127.0.0.1.

Each child runs in its own process group (so a terminal's Ctrl-C reaches only this launcher,
which forwards exactly one SIGINT to each child: they finish their step and checkpoint) and dies
with the launcher (PR_SET_PDEATHSIG). Whatever is still alive at the end is killed by process
group, which takes the children's DHT, averager and p2pd processes with it: no orphans.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.reporting import format_bytes
from protocol.errors import NetworkError
from protocol.manifest import RunManifest, dump_toml

STOP_GRACE_S = 60.0
"""How long children get to checkpoint and exit after SIGINT before they are killed."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    num_peers: int = 3
    rounds: int = 10
    manifest: RunManifest = field(default_factory=RunManifest)
    eval_every_rounds: int = 0
    summary_path: Path | None = None
    workdir: Path | None = None
    threads_per_peer: int | None = None
    bootstrap_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.num_peers < 1:
            raise ValueError(f"num_peers = {self.num_peers}: must be >= 1")
        if self.rounds < 1:
            raise ValueError(f"rounds = {self.rounds}: must be >= 1")


def _die_with_parent() -> None:
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    events: list[dict[str, Any]] = field(default_factory=list)


class Swarm:
    """Starts, watches and stops the processes of a local swarm."""

    def __init__(self, cfg: SwarmConfig, workdir: Path):
        self.cfg, self.workdir = cfg, workdir
        self.events: queue.Queue[tuple[str, dict[str, Any] | None]] = queue.Queue()
        self.children: dict[str, _Child] = {}

    def _spawn(self, name: str, argv: list[str]) -> _Child:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, cwd=self.workdir)
        log.close()
        child = _Child(name=name, proc=proc, log_path=log_path)
        self.children[name] = child
        threading.Thread(target=self._read, args=(child,), daemon=True).start()
        return child

    def _read(self, child: _Child) -> None:
        assert child.proc.stdout is not None
        for raw in child.proc.stdout:
            try:
                event = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                child.events.append(event)
                self.events.put((child.name, event))
        self.events.put((child.name, None))

    def start_bootstrap(self, manifest_path: Path) -> list[str]:
        child = self._spawn("bootstrap", [sys.executable, "-m", "bootstrap", "run", "--host", "127.0.0.1",
                                          "--port", "0", "--identity", str(self.workdir / "bootstrap.key"),
                                          "--run", str(manifest_path), "--log-format", "json"])
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        while time.monotonic() < deadline:
            try:
                name, event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if event is None:
                raise NetworkError(f"the bootstrap node exited with code {child.proc.wait()}; see {child.log_path}")
            if event.get("event") == "ready":
                return [a for a in event["maddrs"] if "/ip4/127.0.0.1/" in a] or event["maddrs"]
        raise NetworkError(f"the bootstrap node did not start within {self.cfg.bootstrap_timeout_s:.0f} s; "
                           f"see {child.log_path}")

    def start_peer(self, index: int, initial_peers: list[str], threads: int) -> None:
        argv = [sys.executable, "-m", "peer", "join", "--data-dir", str(self.workdir / f"peer-{index}"),
                "--max-rounds", str(self.cfg.rounds), "--threads", str(threads), "--log-format", "json",
                "--eval-every", str(self.cfg.eval_every_rounds),
                "--wait-for-peers", str(self.cfg.num_peers)]
        for address in initial_peers:
            argv += ["--initial-peers", address]
        self._spawn(f"peer-{index}", argv)

    def interrupt(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                try:
                    os.kill(child.proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    def stop_all(self, grace_s: float) -> None:
        """SIGINT the bootstrap (peers stop by themselves), then kill every leftover process group."""
        boot = self.children.get("bootstrap")
        if boot is not None and boot.proc.poll() is None:
            os.kill(boot.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children.values():
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)  # the child's DHT, averager and p2pd too
            except (ProcessLookupError, PermissionError):
                pass
            child.proc.wait()


def run_swarm(cfg: SwarmConfig) -> int:
    """Run the local swarm to completion; print progress and a summary. Returns the exit code.

    Raises:
        NetworkError: the bootstrap node did not start.
    """
    from rich.console import Console

    console = Console(stderr=False, soft_wrap=True)
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="locoswarm-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    manifest_path = workdir / "run.toml"
    manifest_path.write_text(dump_toml(cfg.manifest))
    threads = cfg.threads_per_peer or max(1, (os.cpu_count() or 1) // cfg.num_peers)
    swarm = Swarm(cfg, workdir)
    start = time.monotonic()
    interrupted = False
    console.print(f"local swarm: run {cfg.manifest.run_id} ({cfg.manifest.name}), {cfg.num_peers} peer(s), "
                  f"{cfg.rounds} round(s), H={cfg.manifest.sync.inner_steps}, {threads} thread(s) each; "
                  f"logs in {workdir}")
    try:
        maddrs = swarm.start_bootstrap(manifest_path)
        console.print(f"bootstrap node at {maddrs[0]}")
        for i in range(cfg.num_peers):
            swarm.start_peer(i, maddrs, threads)
        _watch(swarm, console)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: peers finish their step and checkpoint…")
        swarm.interrupt()
    finally:
        try:
            swarm.stop_all(STOP_GRACE_S)
        except KeyboardInterrupt:
            swarm.stop_all(0.0)
    summary = build_summary(swarm, cfg, time.monotonic() - start)
    _print_summary(console, summary)
    if cfg.summary_path is not None:
        cfg.summary_path.write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {cfg.summary_path}")
    if interrupted:
        return 130
    failed = [p for p in summary["peers"] if p["exit_code"] != 0]
    return 1 if failed else 0


def _watch(swarm: Swarm, console) -> None:
    running = {name for name in swarm.children if name != "bootstrap"}
    while running:
        name, event = swarm.events.get()
        if event is None:
            if name in running:
                running.discard(name)
                code = swarm.children[name].proc.wait()
                if code != 0:
                    console.print(f"[red]{name} exited with code {code}; see {swarm.children[name].log_path}[/red]")
            continue
        kind = event.get("event")
        if kind == "round":
            from peer.reporting import round_line

            console.print(f"{name} | {round_line(event)}", markup=False, highlight=False)
        elif kind == "eval":
            console.print(f"{name} | eval ({event['when']}) at round {event['round']}: "
                          f"validation loss {event['loss']:.4f}", markup=False, highlight=False)
        elif kind == "adopted_state":
            console.print(f"{name} | joined at round {event['round']} with the swarm's φ", markup=False)
        elif kind == "warning":
            console.print(f"{name} | warning: {event['message']}", markup=False, highlight=False)


def _last(events: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any] | None:
    for event in reversed(events):
        if event.get("event") == kind and all(event.get(k) == v for k, v in match.items()):
            return event
    return None


def build_summary(swarm: Swarm, cfg: SwarmConfig, wall_s: float) -> dict[str, Any]:
    peers = []
    initial, final = [], []
    for name, child in swarm.children.items():
        if name == "bootstrap":
            continue
        started = _last(child.events, "started") or {}
        stopped = _last(child.events, "stopped") or {}
        rounds = [e for e in child.events if e.get("event") == "round"]
        first_eval = next((e for e in child.events if e.get("event") == "eval" and e.get("when") == "initial"), None)
        last_eval = _last(child.events, "eval", when="final")
        if first_eval:
            initial.append(first_eval["loss"])
        if last_eval:
            final.append(last_eval["loss"])
        peers.append({
            "name": name,
            "peer_id": started.get("peer_id"),
            "rounds_completed": stopped.get("rounds_completed", len(rounds)),
            "max_group_size": stopped.get("max_group_size", max((e["group_size"] for e in rounds), default=0)),
            "bytes_sent": stopped.get("bytes_sent", sum(e["bytes_sent"] for e in rounds)),
            "bytes_received": stopped.get("bytes_received", sum(e.get("bytes_received", 0) for e in rounds)),
            "group_sizes": [e["group_size"] for e in rounds],
            "tokens_per_s": (sum(e["tokens_per_s"] for e in rounds) / len(rounds)) if rounds else 0.0,
            "initial_eval_loss": first_eval["loss"] if first_eval else None,
            "final_eval_loss": last_eval["loss"] if last_eval else None,
            "exit_code": child.proc.returncode,
        })
    return {
        "run_id": cfg.manifest.run_id,
        "run_name": cfg.manifest.name,
        "rounds": cfg.rounds,
        "initial_eval_loss": sum(initial) / len(initial) if initial else None,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "peers": peers,
        "wall_seconds": wall_s,
        "workdir": str(swarm.workdir),
    }


def _print_summary(console, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"swarm summary: run {summary['run_id']} ({summary['run_name']})")
    for column in ("peer", "peer id", "rounds", "max group", "sent", "received", "tok/s", "final eval loss", "exit"):
        table.add_column(column)
    for p in summary["peers"]:
        table.add_row(p["name"], (p["peer_id"] or "?")[:16] + "…", str(p["rounds_completed"]),
                      str(p["max_group_size"]), format_bytes(p["bytes_sent"]),
                      format_bytes(p["bytes_received"]), f"{p['tokens_per_s']:,.0f}",
                      "-" if p["final_eval_loss"] is None else f"{p['final_eval_loss']:.4f}", str(p["exit_code"]))
    console.print(table)
    init, fin = summary["initial_eval_loss"], summary["final_eval_loss"]
    console.print(f"validation loss: {'-' if init is None else f'{init:.4f}'} → {'-' if fin is None else f'{fin:.4f}'}"
                  f" nats/token | wall {summary['wall_seconds']:.0f} s")
