"""Soak benchmark: a swarm under random faults for a long time, against the same swarm without faults.

    sudo .venv/bin/python bench/soak.py --peers 8 --rate 50 --minutes 30 --fault-every 30

Phase 1: a bootstrap node and N peers, each in its own network namespace behind a tbf uplink of
``--rate`` Mbit/s (lab/chaos.py). Every ``--fault-every`` seconds (±1/3, at random) one fault:
kill -9 of a peer (restarted from its checkpoint 30-60 s later), SIGSTOP for 10-30 s, link down
for 10-30 s, a new peer joining, or (once) the bootstrap node killed. At least N-2 peers stay
up. At the end every peer is stopped with SIGTERM (it checkpoints) and φ of the state most peers
hold is evaluated on the validation windows.

Phase 2: the same swarm with no faults, for the number of rounds that processes the same number
of tokens as phase 1 did (equal tokens), then φ is evaluated the same way.

Also counted, for issue #13's targets: hangs (a peer not exiting within 60 s of SIGTERM, or a
sync that ran over its deadline by more than 5 s), NaN events (a round discarded or restarted for
a non-finite value, a non-finite checkpoint), checkpoints that do not load at the end, orphans
(processes left in a peer's namespace 10 s after it exited) and memory growth (PSS of a peer's
whole namespace at the end against its level after its first ten rounds, worst peer).

Prints a table and writes the issue's summary keys as JSON to ``--out`` and everything else to
``--out`` with the suffix ``.detail.json``. Needs root.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.chaos import CHAOS_MODEL, ChaosSwarm  # noqa: E402
from peer.launch import stop_all  # noqa: E402
from protocol.errors import ChildTimeout  # noqa: E402
from protocol.manifest import RunManifest, dump_toml  # noqa: E402
from protocol.presets import tiny_run  # noqa: E402

FAULTS = ("kill9", "sigstop", "link_down", "join", "kill_bootstrap")
"""Fault kinds as ChaosSwarm notes them (restart, sigcont and link_up end a fault)."""


def soak_manifest() -> RunManifest:
    return tiny_run().replace(
        name="soak",
        model=CHAOS_MODEL,
        inner_optimizer={"lr": 3e-3, "warmup_steps": 20, "decay_steps": 20000, "batch_size_tokens": 256},
        sync={"inner_steps": 30, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 30.0, "next_chunk_timeout_s": 5.0},
    )


def checkpoint_of(workdir: Path, name: str) -> tuple[Path, str]:
    """(checkpoint path, run id) of peer ``name``: the one run in its data dir. The run id is the
    signed one (the bootstrap node's owner key is part of it), not ``manifest.run_id``.

    Raises:
        FileNotFoundError: no run directory, or several.
    """
    runs = sorted((workdir / name / "runs").glob("*/checkpoint.safetensors"))
    if len(runs) != 1:
        raise FileNotFoundError(f"{workdir / name / 'runs'}: expected one run's checkpoint, found {len(runs)}")
    return runs[0], runs[0].parent.name


def evaluate_checkpoint(workdir: Path, name: str, manifest: RunManifest) -> float:
    """Validation loss (nats/token) of φ in ``name``'s checkpoint."""
    from peer.state.checkpoint import load_checkpoint
    from peer.train.data import load_corpus, validation_batch
    from peer.train.model import build_model, evaluate

    model = build_model(manifest.model)
    named = list(model.named_parameters())
    path, run_id = checkpoint_of(workdir, name)
    state = load_checkpoint(path, run_id=run_id, names=[n for n, _ in named], shapes=[p.shape for _, p in named])
    import torch

    with torch.no_grad():
        for (_, p), phi in zip(named, state.phi):
            p.copy_(phi)
    return evaluate(model, validation_batch(load_corpus(manifest.data), manifest.data))


def namespace_pids(swarm: ChaosSwarm, name: str) -> list[int]:
    """Every process in member ``name``'s network namespace: the peer, its DHT and averager
    processes and p2pd (nothing else runs there)."""
    out = subprocess.run(["ip", "netns", "pids", swarm.hosts[name].netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def pss_mib(pids: Sequence[int]) -> float:
    """Proportional set size of ``pids`` together, MiB (shared pages split between sharers, so
    forked children are not counted twice)."""
    total_kib = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
        except (OSError, ValueError):
            pass  # exited meanwhile
    return total_kib / 1024


class MemoryWatch:
    """Samples each peer's memory (PSS of its whole namespace) with the rounds its current start has
    completed; ``growth`` compares the end with the level after the first ten rounds."""

    def __init__(self, swarm: ChaosSwarm, every_s: float = 15.0):
        self.swarm, self.every_s, self.next = swarm, every_s, 0.0
        self.samples: dict[tuple[str, int], list[tuple[int, float]]] = {}

    def poll(self) -> None:
        if time.time() < self.next:
            return
        self.next = time.time() + self.every_s
        for name, child in list(self.swarm.members.items()):
            if child.alive and name not in self.swarm.frozen:
                done = sum(1 for e in child.of("round") if e.start == child.starts)
                self.samples.setdefault((name, child.starts), []).append(
                    (done, pss_mib(namespace_pids(self.swarm, name)))
                )

    def growth(self) -> tuple[float, dict[str, tuple[float, float]]]:
        """(largest relative growth, {peer: (MiB after 10 rounds, MiB at the end)}) over the starts
        that lived past their tenth round and were still running at the end."""
        levels = {}
        for name, child in self.swarm.members.items():
            samples = self.samples.get((name, child.starts), [])
            after_ten = [mib for done, mib in samples if done >= 10]
            if len(after_ten) >= 2:
                levels[name] = (after_ten[0], samples[-1][1])
        worst = max(((end - first) / first for first, end in levels.values()), default=0.0)
        return worst, levels


def stop_peers(swarm: ChaosSwarm, timeout_s: float = 60.0) -> tuple[list[str], int]:
    """SIGTERM every live peer (it finishes its step and checkpoints); kill those still running after
    ``timeout_s``. Returns (peers that did not exit in time: hangs, processes left in the peers'
    namespaces 10 s after the last peer exited: orphans)."""
    for name in sorted(swarm.frozen):
        swarm.thaw(name)
    for name in sorted(swarm.partitioned):
        swarm.heal(name)
    for child in swarm.members.values():
        child.send(signal.SIGTERM)
    deadline = time.time() + timeout_s
    hung = []
    for name, child in swarm.members.items():
        try:
            child.wait(max(0.1, deadline - time.time()))
        except ChildTimeout:
            hung.append(name)
    stop_all(swarm.members.values(), 5.0)
    time.sleep(10.0)  # p2pd follows its DHT process on a watchdog; give it that long
    orphans = sum(len(namespace_pids(swarm, name)) for name in swarm.members)
    return hung, orphans


def check_checkpoints(workdir: Path, swarm: ChaosSwarm, manifest: RunManifest) -> tuple[list[str], list[str]]:
    """(peers whose checkpoint does not load, peers whose checkpointed φ is not finite)."""
    import torch

    from peer.state.checkpoint import load_checkpoint
    from peer.train.model import build_model

    named = list(build_model(manifest.model).named_parameters())
    bad, nonfinite = [], []
    for name in swarm.members:
        try:
            path, run_id = checkpoint_of(workdir, name)
            state = load_checkpoint(
                path, run_id=run_id, names=[n for n, _ in named], shapes=[p.shape for _, p in named]
            )
        except Exception as exc:  # any failure to load is what this counts
            print(f"checkpoint of {name} does not load: {exc}", flush=True)
            bad.append(name)
            continue
        if not all(torch.isfinite(t).all() for t in state.phi):
            nonfinite.append(name)
    return bad, nonfinite


def majority_peer(swarm: ChaosSwarm) -> tuple[str, int, str]:
    """(peer, round, digest) of the state most peers published last."""
    last = {}
    for name, child in swarm.members.items():
        rounds = child.of("round")
        if rounds:
            last[name] = (rounds[-1].round, rounds[-1]["state_digest"])
    (round_, digest), _ = Counter(last.values()).most_common(1)[0]
    name = next(n for n, v in last.items() if v == (round_, digest))
    return name, round_, digest


def classify(note: str) -> str:
    if not note:
        return "completed"
    for key, cause in (
        ("incomplete", "all-reduce incomplete (groupmate failed)"),
        ("no group formed", "no group formed in time"),
        ("did not finish", "sync deadline passed"),
        ("alone", "alone (no live peer)"),
        ("averaged without", "partial pieces, failed groupmate excluded"),
        ("discarded", "round discarded (non-finite)"),
        ("cancelled by shutdown", "stopped at the end of the run"),
    ):
        if key in note:
            return cause
    return "other: " + note[:60]


def fault_windows(swarm: ChaosSwarm, end: float) -> dict[str, list[tuple[float, float]]]:
    """Per peer, the intervals during which a fault was acting on it (not a stall of the swarm)."""
    windows: dict[str, list[tuple[float, float]]] = {}
    open_: dict[tuple[str, str], float] = {}
    pairs = {"sigstop": "sigcont", "link_down": "link_up", "kill9": "restart"}
    for f in swarm.faults:
        if f["fault"] in pairs:
            open_[(f["target"], pairs[f["fault"]])] = f["time"]
        elif (f["target"], f["fault"]) in open_:
            start = open_.pop((f["target"], f["fault"]))
            windows.setdefault(f["target"], []).append((start, f["time"]))
    for (target, _), start in open_.items():
        windows.setdefault(target, []).append((start, end))
    return windows


def report(swarm: ChaosSwarm, started: float, ended: float) -> dict:
    windows = fault_windows(swarm, ended)
    per_peer, causes, adoptions, longest = {}, Counter(), Counter(), (0.0, "", 0)
    tokens = 0
    longest_sync = (0.0, 0.0, "")
    for name, child in swarm.members.items():
        rounds = child.of("round")
        per_peer[name] = len(rounds)
        tokens += sum(e.get("tokens", 0) for e in rounds)
        for e in rounds:
            causes[classify(e.get("note") or "")] += 1
            if e["sync_s"] > longest_sync[0]:
                longest_sync = (e["sync_s"], e["deadline_s"], name)
        for e in child.of("adopted_state"):
            adoptions[e["reason"]] += 1
        # stall: gap between consecutive round ends of a peer that no fault was acting on; a gap
        # that overlaps one of its own fault windows (or its restart) is not counted
        times = [e["time"] for e in rounds]
        for a, b in zip(times, times[1:]):
            if any(s < b and a < t for s, t in windows.get(name, [])):
                continue
            if b - a > longest[0]:
                longest = (b - a, name, next(e["round"] for e in rounds if e["time"] == b))
    # one round's deadline: a round's inner compute plus its sync deadline (medians over all
    # rounds); a peer past it has neither completed nor abandoned its round in time
    compute = sorted(
        e["tokens"] / e["tokens_per_s"]
        for c in swarm.members.values()
        for e in c.of("round")
        if e.get("tokens") and e.get("tokens_per_s")
    )
    deadlines = [e["deadline_s"] for c in swarm.members.values() for e in c.of("round") if e.get("deadline_s")]
    deadlines.sort()
    round_deadline = (compute[len(compute) // 2] if compute else 0.0) + (
        deadlines[len(deadlines) // 2] if deadlines else 0.0
    )
    overdue_syncs = sum(
        1
        for c in swarm.members.values()
        for e in c.of("round")
        if e.get("deadline_s") and e["sync_s"] > e["deadline_s"] + 5.0
    )
    nan_events = sum(
        1
        for c in swarm.members.values()
        for e in c.events
        if (e.kind == "warning" and "restarting the round from" in str(e.get("message", "")))
        or (e.kind == "round" and "discarded" in str(e.get("note") or ""))
    )
    return {
        "minutes": (ended - started) / 60,
        "faults": Counter(f["fault"] for f in swarm.faults if f["time"] >= started and f["fault"] in FAULTS),
        "round_deadline_s": round_deadline,
        "overdue_syncs": overdue_syncs,
        "nan_events": nan_events,
        "rounds_per_peer": per_peer,
        "round_outcomes": dict(causes),
        "adoptions": dict(adoptions),
        "longest_gap_between_rounds_s": longest[0],
        "longest_gap_peer": longest[1],
        "longest_sync_s": longest_sync[0],
        "its_deadline_s": longest_sync[1],
        "tokens": tokens,
    }


def start_swarm(workdir: Path, args, manifest: RunManifest, peer_args: Sequence[str] = ()) -> ChaosSwarm:
    """The lab with its bootstrap node and ``args.peers`` peers started together (p0, p1, ...)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    run.write_text(dump_toml(manifest))
    swarm = ChaosSwarm(workdir, run, rate_mbit=args.rate, prefix="lsk", subnet="10.213.81", peer_args=peer_args)
    try:
        swarm.start_bootstrap()
        for i in range(args.peers):
            swarm.add_peer(f"p{i}", extra=["--wait-for-peers", str(args.peers)])
    except BaseException:
        swarm.close()
        raise
    return swarm


def contacts(swarm: ChaosSwarm, exclude: str = "") -> list[str] | None:
    """Addresses of up to three live peers (what a volunteer gets from the swarm's page), or the
    bootstrap node's while it lives."""
    live = [m for m in swarm.live_peers() if m.name != exclude][:3]
    if not live:
        return None
    return [swarm.peer_addr(m.name) for m in live]


def run_faulted(workdir: Path, args, manifest: RunManifest, rng: random.Random) -> dict:
    with start_swarm(workdir, args, manifest) as swarm:
        names = list(swarm.members)
        swarm.wait_rounds(names, 1, 300)
        started = time.time()
        end = started + 60 * args.minutes
        pending: list[tuple[float, str, str]] = []  # (when, action, peer)
        joined = 0
        bootstrap_dead = False
        next_fault = started + args.fault_every
        memory = MemoryWatch(swarm)
        while time.time() < end:
            memory.poll()
            now = time.time()
            for item in sorted(pending):
                when, action, name = item
                if when <= now:
                    pending.remove(item)
                    if action == "thaw":
                        swarm.thaw(name)
                    elif action == "heal":
                        swarm.heal(name)
                    elif action == "restart":
                        swarm.restart(name, initial_peers=contacts(swarm, exclude=name))
            if now >= next_fault:
                healthy = [m for m in swarm.live_peers() if not any(p[2] == m.name for p in pending)]
                choices = ["kill9", "sigstop", "partition", "join"] + ([] if bootstrap_dead else ["kill_bootstrap"])
                fault = rng.choice(choices)
                if fault in ("kill9", "sigstop", "partition") and len(healthy) <= args.peers - 2:
                    fault = "join"
                if fault == "join" and len([m for m in swarm.members.values() if m.alive]) >= args.peers + 2:
                    # enough joiners for the machine: another fault, if enough peers are healthy
                    fault = "sigstop" if len(healthy) > args.peers - 2 else "none"
                victim = rng.choice(healthy).name if healthy else None
                print(
                    f"{(now - started) / 60:5.1f} min: {fault} {victim if fault not in ('join', 'kill_bootstrap') else ''}",
                    flush=True,
                )
                if fault == "kill9" and victim:
                    swarm.kill(victim)
                    pending.append((now + rng.uniform(30, 60), "restart", victim))
                elif fault == "sigstop" and victim:
                    swarm.freeze(victim)
                    pending.append((now + rng.uniform(10, 30), "thaw", victim))
                elif fault == "partition" and victim:
                    swarm.partition(victim)
                    pending.append((now + rng.uniform(10, 30), "heal", victim))
                elif fault == "kill_bootstrap":
                    swarm.kill_bootstrap()
                    bootstrap_dead = True
                elif fault == "join":
                    joined += 1
                    swarm.add_peer(f"j{joined}", initial_peers=contacts(swarm))
                next_fault = now + args.fault_every * rng.uniform(2 / 3, 4 / 3)
            time.sleep(0.5)
        ended = time.time()
        growth, levels = memory.growth()
        hung, orphans = stop_peers(swarm)
        result = report(swarm, started, ended)
        bad, nonfinite = check_checkpoints(workdir, swarm, manifest)
        name, round_, digest = majority_peer(swarm)
        result.update(
            hung_at_stop=hung,
            orphans=orphans,
            bad_checkpoints=bad,
            nonfinite_checkpoints=nonfinite,
            rss_growth=growth,
            memory_mib=levels,
        )
        result.update(
            eval_peer=name,
            final_round=round_,
            final_digest=digest,
            final_holders=sum(
                1 for c in swarm.members.values() if c.last("round") and c.last("round")["state_digest"] == digest
            ),
            peers_total=len(swarm.members),
            fault_log=swarm.faults,
        )
    result["validation_loss"] = evaluate_checkpoint(workdir, name, manifest)
    return result


def run_clean(workdir: Path, args, manifest: RunManifest, rounds: int) -> dict:
    with start_swarm(workdir, args, manifest, peer_args=["--max-rounds", str(rounds)]) as swarm:
        names = list(swarm.members)
        started = time.time()
        for name in names:
            swarm.members[name].wait()
        ended = time.time()
        result = report(swarm, started, ended)
        hung, orphans = stop_peers(swarm)
        bad, nonfinite = check_checkpoints(workdir, swarm, manifest)
        result.update(hung_at_stop=hung, orphans=orphans, bad_checkpoints=bad, nonfinite_checkpoints=nonfinite)
        name, round_, digest = majority_peer(swarm)
        result.update(eval_peer=name, final_round=round_, final_digest=digest)
    result["validation_loss"] = evaluate_checkpoint(workdir, name, manifest)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=50.0, help="uplink of every host, Mbit/s")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=30.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    # SIGTERM (e.g. `kill`) unwinds like Ctrl-C, so the lab's namespaces and iptables rule go away
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    manifest = soak_manifest()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="locoswarm-soak-"))
    faulted = run_faulted(workdir / "faulted", args, manifest, random.Random(args.seed))
    per_round = args.peers * manifest.sync.inner_steps * manifest.inner_optimizer.batch_size_tokens
    rounds = max(1, round(faulted["tokens"] / per_round))
    clean = run_clean(workdir / "clean", args, manifest, rounds)
    change = (faulted["validation_loss"] - clean["validation_loss"]) / clean["validation_loss"]
    print()
    print("| | with faults | no faults |")
    print("|---|---|---|")
    print(f"| minutes | {faulted['minutes']:.1f} | {clean['minutes']:.1f} |")
    print(f"| tokens (all peers) | {faulted['tokens']:,} | {clean['tokens']:,} |")
    print(f"| faults | {dict(faulted['faults'])} | none |")
    print(f"| rounds completed per peer | {faulted['rounds_per_peer']} | {clean['rounds_per_peer']} |")
    print(f"| round outcomes | {faulted['round_outcomes']} | {clean['round_outcomes']} |")
    print(f"| state adoptions by reason | {faulted['adoptions']} | {clean['adoptions']} |")
    print(
        f"| longest gap between rounds of a peer no fault acted on | {faulted['longest_gap_between_rounds_s']:.1f} s "
        f"({faulted['longest_gap_peer']}) | {clean['longest_gap_between_rounds_s']:.1f} s |"
    )
    print(
        f"| longest sync / its deadline | {faulted['longest_sync_s']:.1f} s / {faulted['its_deadline_s']:.1f} s | "
        f"{clean['longest_sync_s']:.1f} s / {clean['its_deadline_s']:.1f} s |"
    )
    print(
        f"| validation loss of φ (nats/token) | {faulted['validation_loss']:.4f} (round {faulted['final_round']}, "
        f"held by {faulted['final_holders']} of {faulted['peers_total']} peers) | {clean['validation_loss']:.4f} "
        f"(round {clean['final_round']}) |"
    )
    print(f"| loss change from faults | {100 * change:+.2f} % | |")
    print(
        f"| one round's deadline (median compute + median sync deadline) | {faulted['round_deadline_s']:.1f} s | "
        f"{clean['round_deadline_s']:.1f} s |"
    )
    for key in ("overdue_syncs", "hung_at_stop", "nan_events", "nonfinite_checkpoints", "bad_checkpoints", "orphans"):
        print(f"| {key.replace('_', ' ')} | {faulted[key]} | {clean[key]} |")
    print(f"| memory growth after round 10 (worst peer) | {100 * faulted['rss_growth']:+.1f} % | |")
    summary = {
        "minutes": faulted["minutes"],
        "peers": args.peers,
        "faults": dict(faulted["faults"]),
        "loss_faults": faulted["validation_loss"],
        "loss_clean": clean["validation_loss"],
        "loss_change": change,
        "longest_stall_s": faulted["longest_gap_between_rounds_s"],
        "round_deadline_s": faulted["round_deadline_s"],
        "hangs": len(faulted["hung_at_stop"])
        + faulted["overdue_syncs"]
        + len(clean["hung_at_stop"])
        + clean["overdue_syncs"],
        "nan_events": faulted["nan_events"] + len(faulted["nonfinite_checkpoints"]) + clean["nan_events"],
        "bad_checkpoints": len(faulted["bad_checkpoints"]) + len(clean["bad_checkpoints"]),
        "orphans": faulted["orphans"] + clean["orphans"],
        "rss_growth": faulted["rss_growth"],
    }
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        args.out.with_suffix(".detail.json").write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "faulted": faulted,
                    "clean": clean,
                    "loss_change": change,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
