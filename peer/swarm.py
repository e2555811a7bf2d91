"""`peer swarm`: a bootstrap node and N peers as separate OS processes on 127.0.0.1.

Each child runs in its own process group (so a terminal's Ctrl-C reaches only this launcher,
which forwards exactly one SIGINT to each child: they finish their step and checkpoint) and dies
with the launcher (PR_SET_PDEATHSIG). Whatever is still alive at the end is killed by process
group, which takes the children's DHT, averager and p2pd processes with it: no orphans.

The run's data is read once here before any process starts (peer/swarm_data.py: a bad path fails in
seconds, and the peers find the token cache, or a sharded run's list and validation shards, filled). A
corpus on this machine (``--data PATH``, or the run file's ``data.path``: a corpus, or a directory of
shards) never travels: the bootstrap node announces the run with its corpus named by content
(``data.path = ""``) and each peer, a process of this launcher on this machine, is told the path
(``peer join --data PATH``); a remote ``data.path`` stays refused. When a peer fails, the others are stopped and the launcher
exits with that peer's exit code and prints its one-line reason. A temporary working directory
(no ``--workdir``) is removed at the end unless ``keep`` is set or a peer failed (its logs stay,
and the launcher says where).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from peer.events import Event
from peer.launch import Child, bootstrap_argv, peer_argv, stop_all
from peer.progress import Waiting
from peer.reporting import device_text, format_bytes, round_line
from peer.swarm_data import (  # noqa: F401 (SwarmConfig, check_data, ...: callers import them from here)
    SwarmConfig,
    check_data,
    check_data_path,
    shard_list_in,
    source_of,
    with_sharded_data,
    with_swarm_data,
)
from peer.train.sources import describe
from protocol.errors import ChildExited, ChildTimeout, NetworkError
from protocol.manifest import dump_toml
from protocol.signing import OWNER_KEY_FILE, load_owner_key

STOP_GRACE_S = 60.0
"""How long children get to checkpoint and exit after SIGINT before they are killed."""

HEARTBEAT_S = 4.0
"""Until every peer printed its first round, the longest the launcher stays silent: past it, one line
says what each peer is doing (its latest status line), so no wait looks like a hang."""


class Swarm:
    """Starts, watches and stops the processes of a local swarm."""

    def __init__(self, cfg: SwarmConfig, workdir: Path):
        self.cfg, self.workdir = cfg, workdir
        self.events: queue.Queue[tuple[str, Event | None]] = queue.Queue()
        """Every peer's events as they arrive, then (name, None) when its output ended."""
        self.children: dict[str, Child] = {}
        self.failure: tuple[str, int, str] | None = None
        """The first child that failed: (name, exit code, its one-line reason)."""

    def _start(self, name: str, argv: list[str], *, watched: bool) -> Child:
        on_event = (lambda child, event: self.events.put((child.name, event))) if watched else None
        child = Child(name, argv, log_path=self.workdir / f"{name}.log", cwd=self.workdir, on_event=on_event)
        self.children[name] = child
        return child.start()

    def start_bootstrap(self, manifest_path: Path, on_wait: Callable[[float], None] | None = None) -> list[str]:
        """Start the bootstrap node and wait for its ``ready`` event; ``on_wait(seconds)`` is called
        every :data:`HEARTBEAT_S` while it has not come (the launcher says it still waits)."""
        child = self._start(
            "bootstrap", bootstrap_argv(identity=self.workdir / "bootstrap.key", run=manifest_path), watched=False
        )
        start = time.monotonic()
        deadline = start + self.cfg.bootstrap_timeout_s
        try:
            while True:
                try:
                    ready = child.wait_event(
                        lambda e: e.kind == "ready", max(0.0, min(HEARTBEAT_S, deadline - time.monotonic()))
                    )
                    break
                except ChildTimeout:
                    if time.monotonic() >= deadline:
                        raise
                    if on_wait is not None:
                        on_wait(time.monotonic() - start)
        except ChildExited as exc:
            code, reason = shell_exit(exc.returncode or 1, error_line(child) or f"see {child.log_path}")
            self.failure = ("bootstrap", code, reason)
            failed = NetworkError(f"the bootstrap node exited with code {code}: {self.failure[2]}")
            failed.exit_code = code  # the launcher ends as its child did (78 stays 78 for restart policies)
            raise failed from None
        except ChildTimeout:
            self.failure = ("bootstrap", 1, f"did not start within {self.cfg.bootstrap_timeout_s:.0f} s")
            raise NetworkError(
                f"the bootstrap node did not start within {self.cfg.bootstrap_timeout_s:.0f} s; see {child.log_path}"
            ) from None
        return ready.addresses_on("127.0.0.1") or list(ready.maddrs)

    def start_peer(self, index: int, initial_peers: list[str], threads: int) -> None:
        stages = self.cfg.manifest.pipeline.stages
        # a pipelined run: peers serve the stages in turn (peer 0 stage 0, peer 1 stage 1, ...) and
        # each waits for the peers of its own stage
        wait = len(range(index % stages, self.cfg.num_peers, stages))
        extra = [
            "--max-rounds",
            str(self.cfg.rounds),
            "--threads",
            str(threads),
            "--eval-every",
            str(self.cfg.eval_every_rounds),
            "--wait-for-peers",
            str(wait),
            "--device",
            self.cfg.device,
        ]
        if stages > 1:
            extra += ["--stage", str(index % stages)]
        if self.cfg.data_path is not None:  # this machine's corpus, given to its own processes only
            extra += ["--data", str(self.cfg.data_path)]
        self._start(
            f"peer-{index}",
            peer_argv(data_dir=self.workdir / f"peer-{index}", initial_peers=initial_peers, extra=extra),
            watched=True,
        )

    def interrupt(self) -> None:
        for child in self.children.values():
            child.send(signal.SIGINT)

    def stop_all(self, grace_s: float) -> None:
        """SIGINT the bootstrap (peers stop by themselves), then kill every leftover process group."""
        boot = self.children.get("bootstrap")
        if boot is not None:
            boot.send(signal.SIGINT)
        stop_all(self.children.values(), grace_s)


def error_line(child: Child) -> str | None:
    """The one-line reason a child printed on its way out (``error: ...`` from our errors, ``Error:
    ...`` from click's usage errors, on its stderr), without the prefix; None when it printed none."""
    for line in reversed(child.tail(200).splitlines()):
        if line.startswith(("error: ", "Error: ")):
            return line.split(": ", 1)[1]
    return None


HIVEMIND_SOCKETS = "/tmp/hivemind-*.sock"
"""Where hivemind's p2pd and its clients make their unix sockets (a fixed path, not $TMPDIR)."""


def remove_stale_sockets(since: float, pattern: str = HIVEMIND_SOCKETS) -> int:
    """Remove the hivemind sockets made since ``since`` (wall time, s) that nothing listens on any
    more: a killed DHT process leaves its p2pd client socket behind. A socket another program still
    listens on (another swarm on this machine) accepts the probe and is left alone.

    Returns:
        How many were removed.
    """
    import glob
    import socket
    import stat

    removed = 0
    for path in glob.glob(pattern):
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_mtime < since:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        except OSError:
            continue
    return removed


def run_swarm(cfg: SwarmConfig) -> int:
    """Run the local swarm to completion; print progress and a summary. Returns the exit code:
    0, 130 when interrupted, or the exit code of the first peer that failed.

    Raises:
        ConfigError: the run's data cannot be read (nothing was started).
        NetworkError: the bootstrap node did not start (its exit code when it exited).
    """
    from rich.console import Console

    console = Console(stderr=False, soft_wrap=True)
    check_data_path(cfg.data_path)  # a missing --data: one line, before anything starts
    console.print(f"local swarm: reading the data of run {cfg.manifest.name}", markup=False, highlight=False)
    with Waiting("reading the data", every_s=HEARTBEAT_S):  # hashing (at first tokenizing) a corpus takes a while
        cfg, corpus = with_swarm_data(cfg)
    if cfg.manifest.data.source == "shards":
        console.print(
            f"local swarm: the peers stream the {corpus.train_files:,} training shard(s) of "
            f"{describe(dataclasses.replace(cfg.manifest.data, path=str(cfg.data_path or '')))}, each peer its "
            f"own ({corpus.validation_files:,} validation shard(s) shared); the run names its shards by "
            f"content (data.shards_sha256 = {cfg.manifest.data.shards_sha256})",
            markup=False,
            highlight=False,
        )
    elif cfg.data_path is not None:
        console.print(
            f"local swarm: the peers train on {cfg.data_path} ({corpus.train_files:,} + "
            f"{corpus.validation_files:,} documents, {corpus.corpus_bytes:,} bytes; each peer gets --data); "
            f"the run names its corpus by content (data.corpus_sha256 = {corpus.corpus_sha256})",
            markup=False,
            highlight=False,
        )
    temporary = cfg.workdir is None
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="locoswarm-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # The bootstrap node signs the run with the owner key beside its identity, and the run id binds the
    # owner: made here first, so every line of this command names the id the peers, `peer status` and
    # the monitor show.
    if not cfg.manifest.owner:  # a run file naming another owner is refused by the bootstrap node, as before
        owner = load_owner_key(workdir / OWNER_KEY_FILE)
        cfg = dataclasses.replace(cfg, manifest=cfg.manifest.with_owner(owner.public_hex))
    manifest_path = workdir / "run.toml"
    manifest_path.write_text(dump_toml(cfg.manifest))
    threads = cfg.threads_per_peer or max(1, (os.cpu_count() or 1) // cfg.num_peers)
    swarm = Swarm(cfg, workdir)
    start, started_at = time.monotonic(), time.time() - 1.0
    interrupted = False
    console.print(
        f"local swarm: run {cfg.manifest.run_id} ({cfg.manifest.name}), {cfg.num_peers} peer(s), "
        f"{cfg.rounds} round(s), H={cfg.manifest.sync.inner_steps}, {threads} thread(s) each; "
        f"logs in {workdir}" + (" (removed at the end unless --keep)" if temporary and not cfg.keep else ""),
        markup=False,
        highlight=False,
    )
    try:
        try:
            console.print("local swarm: starting the bootstrap node", markup=False, highlight=False)
            maddrs = swarm.start_bootstrap(
                manifest_path,
                on_wait=lambda s: console.print(
                    f"local swarm: still starting the bootstrap node ({s:.0f} s)", markup=False, highlight=False
                ),
            )
            console.print(f"bootstrap node at {maddrs[0]}", markup=False, highlight=False)
            for i in range(cfg.num_peers):
                swarm.start_peer(i, maddrs, threads)
            console.print(
                f"local swarm: started {cfg.num_peers} peer(s); each says what it does until its first round",
                markup=False,
                highlight=False,
            )
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
            remove_stale_sockets(started_at)
        summary = build_summary(swarm, cfg, time.monotonic() - start)
        _print_summary(console, summary)
        if cfg.summary_path is not None:
            cfg.summary_path.write_text(json.dumps(summary, indent=2))
            console.print(f"summary written to {cfg.summary_path}", markup=False, highlight=False)
    finally:
        if swarm.failure is not None:
            name, code, reason = swarm.failure
            console.print(f"logs kept in {workdir}", markup=False, highlight=False)
            if name != "bootstrap":  # the bootstrap's reason is the error this function raises
                print(f"error: {name} exited with code {code}: {reason}", file=sys.stderr, flush=True)
        elif temporary and not cfg.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if interrupted:
        return 130
    return swarm.failure[1] if swarm.failure is not None else 0


def _signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number this platform does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def shell_exit(code: int, reason: str) -> tuple[int, str]:
    """A child's exit as a shell reports it: ``Popen``'s ``-N`` (killed by signal N) becomes 128 + N,
    with the signal named in front of ``reason``; other codes and reasons are returned as they are."""
    if code >= 0:
        return code, reason
    return 128 - code, f"killed by {_signal_name(-code)}; {reason}"


def _watch(swarm: Swarm, console) -> None:
    """Print the peers' progress until every peer's output ended; on the first peer that fails,
    record it (``swarm.failure``) and stop the others: a local swarm short of a peer tests nothing.

    Until every peer printed its first round, each peer's status lines are printed as they come
    (loading, starting the DHT node, reading the data, building the model, training), and after
    :data:`HEARTBEAT_S` without a line, one line with each peer's latest (:func:`waiting_line`)."""
    running = {name for name in swarm.children if name != "bootstrap"}
    total = len(running)
    doing: dict[str, str] = {name: "starting" for name in sorted(running)}
    """Peer → its latest status line, until its first round."""
    start = last_line = time.monotonic()

    def say(text: str, **style: Any) -> None:
        nonlocal last_line
        console.print(text, markup=False, highlight=False, **style)
        last_line = time.monotonic()

    while running:
        try:
            name, event = swarm.events.get(timeout=max(0.1, last_line + HEARTBEAT_S - time.monotonic()))
        except queue.Empty:
            if doing:
                say(waiting_line(doing, total, time.monotonic() - start))
            else:
                last_line = time.monotonic()  # every peer trains: its rounds are the lines from now on
            continue
        if event is None:
            doing.pop(name, None)
            if name in running:
                running.discard(name)
                child = swarm.children[name]
                code = child.wait()
                if code != 0 and swarm.failure is None:
                    code, reason = shell_exit(code, error_line(child) or f"no error line; see {child.log_path}")
                    swarm.failure = (name, code, reason)
                    say(f"{name} exited with code {code}: {reason}; stopping the others", style="red")
                    swarm.interrupt()
            continue
        kind = event.kind
        if kind == "status" and name in doing:
            doing[name] = str(event.get("message", ""))
            say(f"{name} | {doing[name]}")
            continue
        if kind == "started" and name in doing:
            say(f"{name} | started: peer {event.get('peer_id')} on {device_text(dict(event))}")
            continue
        if kind in ("round", "adopted_state"):
            doing.pop(name, None)
        last_line = time.monotonic()
        if kind == "round":
            console.print(f"{name} | {round_line(event)}", markup=False, highlight=False)
        elif kind == "eval":
            bpb = f" nats/token ({event['bpb']:.3f} bits/byte)" if event.get("bpb") is not None else ""
            console.print(
                f"{name} | eval ({event['when']}) at round {event['round']}: validation loss {event['loss']:.4f}{bpb}",
                markup=False,
                highlight=False,
            )
        elif kind == "adopted_state":
            console.print(
                f"{name} | joined at round {event['round']} with the swarm's φ", markup=False, highlight=False
            )
        elif kind == "warning":
            console.print(f"{name} | warning: {event['message']}", markup=False, highlight=False)


def waiting_line(doing: Mapping[str, str], peers: int, elapsed_s: float) -> str:
    """One line saying what each peer that has not trained a round yet is doing, e.g. ``local swarm:
    1/3 peer(s) finished a round; peer-1: building the model and starting the averager; peer-2:
    training: ... (12 s)`` (``doing``: peer → its latest status line; ``peers``: how many the swarm
    has; a peer that exited before its first round counts as done: its error line said why)."""
    done = peers - len(doing)
    what = "; ".join(f"{name}: {line}" for name, line in sorted(doing.items()))
    return f"local swarm: {done}/{peers} peer(s) finished a round; {what} ({elapsed_s:.0f} s)"


def final_state(events: list[Event]) -> tuple[str | None, int | None]:
    """(digest, round) of the state a peer ended on: the last ``state_digest`` its ``round``,
    ``adopted_state`` or ``resumed`` events carried up to its final evaluation of φ (or up to its
    last event, without one); (None, None) when none carried one."""
    end = next(
        (i for i in range(len(events) - 1, -1, -1) if events[i].kind == "eval" and events[i].get("when") == "final"),
        len(events) - 1,
    )
    for event in reversed(events[: end + 1]):
        if event.get("state_digest"):
            return str(event["state_digest"]), event.round
    return None, None


def build_summary(swarm: Swarm, cfg: SwarmConfig, wall_s: float) -> dict[str, Any]:
    """The run's summary (``--summary`` writes it as JSON). ``final_eval_loss`` is the mean of the
    peers' final validation losses; ``final_states`` (distinct final state digests among the peers
    that evaluated φ at their end) and ``final_eval_loss_spread`` (max − min of those losses) say
    whether that mean stands for one φ: with DiLoCo every peer that completed the last round in the
    group holds the same φ bit for bit; a peer that missed it (under load) ends on another."""
    peers = []
    initial, final = [], []
    final_digests: set[str] = set()
    for name, child in swarm.children.items():
        if name == "bootstrap":
            continue
        started: Mapping[str, Any] = child.last("started") or {}
        stopped: Mapping[str, Any] = child.last("stopped") or {}
        rounds = child.of("round")
        first_eval = next((e for e in child.of("eval") if e.get("when") == "initial"), None)
        last_eval = child.last("eval", when="final")
        if first_eval:
            initial.append(first_eval["loss"])
        digest, digest_round = final_state(child.events)
        if last_eval:
            final.append(last_eval["loss"])
            if digest is not None:
                final_digests.add(digest)
        peers.append(
            {
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
                "final_state_digest": digest,
                "final_state_round": digest_round,
                # as a shell reports it (137 for SIGKILL), as the error line names it; None: still running
                "exit_code": None if child.returncode is None else shell_exit(child.returncode, "")[0],
            }
        )
    return {
        "run_id": cfg.manifest.run_id,
        "run_name": cfg.manifest.name,
        "rounds": cfg.rounds,
        "initial_eval_loss": sum(initial) / len(initial) if initial else None,
        "final_eval_loss": sum(final) / len(final) if final else None,
        "final_eval_loss_peers": len(final),
        "final_eval_loss_spread": max(final) - min(final) if final else None,
        "final_states": len(final_digests),
        "algorithm": cfg.manifest.sync.algorithm,
        "peers": peers,
        "wall_seconds": wall_s,
        "workdir": str(swarm.workdir),
    }


def _print_summary(console, summary: dict[str, Any]) -> None:
    """The summary's table; its names (run name, peer ids, paths) reach rich as text, never markup."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"swarm summary: run {summary['run_id']} ({summary['run_name']})"))
    for column in ("peer", "peer id", "rounds", "max group", "sent", "received", "tok/s", "final eval loss", "exit"):
        table.add_column(column)
    for p in summary["peers"]:
        table.add_row(
            Text(p["name"]),
            Text((p["peer_id"] or "?")[:16] + "…"),
            str(p["rounds_completed"]),
            str(p["max_group_size"]),
            format_bytes(p["bytes_sent"]),
            format_bytes(p["bytes_received"]),
            f"{p['tokens_per_s']:,.0f}",
            "-" if p["final_eval_loss"] is None else f"{p['final_eval_loss']:.4f}",
            str(p["exit_code"]),
        )
    console.print(table)
    init, fin = summary["initial_eval_loss"], summary["final_eval_loss"]
    evaluated = summary.get("final_eval_loss_peers", 0)
    mean = f" (mean of {evaluated} peers)" if evaluated > 1 else ""
    console.print(
        f"validation loss: {'-' if init is None else f'{init:.4f}'} → {'-' if fin is None else f'{fin:.4f}'}"
        f" nats/token{mean} | wall {summary['wall_seconds']:.0f} s",
        markup=False,
        highlight=False,
    )
    line = final_phi_line(summary)
    if line is not None:
        console.print(
            line, markup=False, highlight=False, style="yellow" if summary.get("final_states", 0) > 1 else None
        )


def final_phi_line(summary: dict[str, Any]) -> str | None:
    """Whether the peers ended on one φ, and each peer's final validation loss, e.g.
    ``final φ: all 3 peers on the same state (3f2a9c1e…, round 10): peer-0 2.0962, ...`` or
    ``final φ: the peers ended on 2 different states, validation loss 2.0725 to 2.1547 (spread
    0.0822 nats/token): peer-0 2.1547 (state 3f2a9c1e…, round 10), ...``. None with fewer than two
    peers that evaluated φ at their end (a single peer, a pipelined run, a failed one)."""
    peers = summary["peers"]
    evaluated = [p for p in peers if p.get("final_eval_loss") is not None]
    if len(evaluated) < 2:
        return None
    states = summary.get("final_states", 0)

    def state(p: dict[str, Any]) -> str:
        digest = p.get("final_state_digest")
        return "state ?" if digest is None else f"state {digest[:8]}…, round {p.get('final_state_round')}"

    def loss(p: dict[str, Any]) -> str:
        return "no final evaluation" if p.get("final_eval_loss") is None else f"{p['final_eval_loss']:.4f}"

    if states == 1:
        first = evaluated[0]
        every = "both" if len(evaluated) == 2 else f"all {len(evaluated)}"
        head = (
            f"final φ: {every} peers on the same state ({state(first).removeprefix('state ')})"
            if len(evaluated) == len(peers)
            else f"final φ: the {len(evaluated)} peers that evaluated it on the same state "
            f"({state(first).removeprefix('state ')})"
        )
        return f"{head}: " + ", ".join(f"{p['name']} {loss(p)}" for p in peers)
    losses = [p["final_eval_loss"] for p in evaluated]
    spread = summary.get("final_eval_loss_spread")
    spread = max(losses) - min(losses) if spread is None else spread
    what = f"{states} different states" if states > 1 else "states this summary cannot compare (no digests)"
    line = (
        f"final φ: the peers ended on {what}, validation loss {min(losses):.4f} to {max(losses):.4f} "
        f"(spread {spread:.4f} nats/token; the loss above is their mean): "
        + ", ".join(f"{p['name']} {loss(p)} ({state(p)})" for p in peers)
    )
    if summary.get("algorithm") == "noloco" and states > 1:
        line += "; expected with NoLoCo, which averages with one partner a round"
    return line
