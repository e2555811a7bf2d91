"""Benchmark: 8 peers of which 1 (then 2) are malicious, loss at equal tokens against the clean run,
on the round engine (issues #17, #51 item 7).

    nice -n 5 python bench/byzantine.py [--rounds 10] [--seeds 0 1] [--algorithms diloco noloco]
        [--attacks ...] [--malicious 1 2] [--jobs 2] [--resume]

Every run is lab/engine_sim.py: 8 real round loops (peer/round/ ``Trainer``) in threads over the
in-process hub, which deals each group's pieces to owners and screens and checks them as the
network's all-reduce does (peer/sync/inprocess_means.py); lab/adversary.py's hooks forge what the
malicious peers contribute, the means they send as owners (per receiver), the records they publish
and the states they serve. The manifest is bench/compare.py's (its inner lr, fixed global batch,
cosine schedule ending with the run), so every run trains on the same tokens.

Each result row compares the honest peers' final validation loss (the mean of each honest peer's
own loss, bits per byte) with the clean run of the same seed and algorithm (8 honest peers, the
hub screening as the network does): ``loss_change`` is (attacked − clean) / clean, a fraction,
averaged over seeds. ``takeovers`` counts, summed over seeds, the honest peers' adoptions of a
state the attacker forged plus the honest peers whose final φ is not finite or whose loss exceeds
:data:`TAKEOVER_LOSS_FACTOR` × the clean run's; ``non_finite_rounds`` the rounds at whose end an
honest φ was not finite; ``honest_exits`` the honest round loops that raised or stopped early.
``clean_overhead`` is (clean, screened − clean, plain mean) / clean plain mean, averaged over
algorithms and seeds. ``sybil`` holds the rows of bench/results/sybil.json (bench/sybil.py: the
record floods on real DHT nodes, a run of its own), copied with the issue's keys. ``--attacks bogus-announcement`` also runs bench/byzantine_announce.py (real DHT nodes
on 127.0.0.1); a joiner's run choice has no loss, so those results go to the detail file only.

Writes ``bench/results/byzantine.json`` with the issue's keys only, and
``bench/results/byzantine.detail.json`` with every run, the definitions and the config. Prints a
markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ and bench/ are repo tooling
from bench.compare import apply_overrides, corpus_or_exit, load_config, manifest_for
from lab.adversary import ATTACKS, Adversary
from lab.engine_sim import run_engine_simulation
from peer.train.data import load_corpus
from protocol.errors import ManifestError
from protocol.manifest import RunManifest

RESULTS = Path(__file__).with_name("results") / "byzantine.json"
PEERS = 8
ALGORITHMS = ("diloco", "noloco")
TAKEOVER_LOSS_FACTOR = 1.5
FRESH_IDENTITIES = 8
"""Identities the fake-progress attacker adds to its malicious peers: more than the honest peers'
own class (7 or 6), so that counting records alone would follow it."""
TAKEOVER = (
    "per honest peer and seed: each adoption of a state the attacker forged (fake-progress, tie-break), "
    f"plus 1 if its final φ is not finite or its validation loss exceeds {TAKEOVER_LOSS_FACTOR}x the clean "
    "run's (same seed and algorithm)"
)
BOGUS = "bogus-announcement"


def _train(
    base: RunManifest,
    bench: dict,
    *,
    rounds: int,
    seed: int,
    algorithm: str,
    attack: str | None,
    malicious: int,
    screening: bool,
    threads: int,
    matchmaking_s: float,
) -> dict:
    """One engine run; the malicious peers are the last ``malicious`` of :data:`PEERS` (who owns which
    piece is drawn per group, as matchmaking orders a group)."""
    torch.set_num_threads(threads)
    logging.getLogger("peer").setLevel(logging.ERROR)
    m = manifest_for(base, algorithm, PEERS, seed, bench["global_batch_tokens"], rounds)
    adversary = None
    if attack is not None:
        adversary = Adversary(
            attack=attack,
            peers=tuple(range(PEERS - malicious, PEERS)),
            fresh_identities=FRESH_IDENTITIES if attack == "fake-progress" else 0,
        )
    r = run_engine_simulation(
        m,
        load_corpus(base.data),
        peers=PEERS,
        rounds=rounds,
        seed=seed,
        eval_every_rounds=rounds,
        screening=screening,
        adversary=adversary,
        matchmaking_s=matchmaking_s,
    )
    h = r.history[-1]
    return {
        "attack": attack or "none",
        "algorithm": algorithm,
        "malicious": malicious,
        "seed": seed,
        "screening": screening,
        "final_bpb": h.loss_bpb,
        "per_peer_bpb": h.per_peer_bpb,
        "tokens": h.tokens,
        "adopted_forged": r.takeovers,
        "non_finite_rounds": r.non_finite_rounds,
        "honest_exits": r.honest_exits,
        "counts": r.screening,
        "train_s": r.train_s,
        "wall_s": r.wall_s,
    }


def _takeovers(run: dict, clean_bpb: float) -> int:
    losses = run["per_peer_bpb"] or [run["final_bpb"]]
    broken = sum(1 for x in losses if not math.isfinite(x) or x > TAKEOVER_LOSS_FACTOR * clean_bpb)
    return run["adopted_forged"] + broken


def _key(run: dict) -> tuple:
    return (run["attack"] or "none", run["algorithm"], run["malicious"], run["seed"], run["screening"])


SYBIL_KEYS = ("records", "algorithm", "grouped_rounds_frac", "rss_growth_mib")


def sybil_rows(path: Path) -> tuple[list[dict], dict]:
    """The record floods on real DHT nodes as bench/sybil.py measured them (its rows, with the
    issue's keys) and where they came from; no rows where it has not been run."""
    if not path.exists():
        return [], {"measured": f"not yet: {path.name} is written by bench/sybil.py"}
    data = json.loads(path.read_text())
    rows = [{k: row[k] for k in SYBIL_KEYS} for row in data["rows"]]
    return rows, {"from": path.name, "command": data.get("command"), "setup": data.get("setup")}


def summarize(runs: list[dict]) -> tuple[list[dict], float | None, list[dict]]:
    """(rows with the issue's keys, clean_overhead, detail rows with per-seed figures)."""
    clean = {(r["algorithm"], r["seed"]): r["final_bpb"] for r in runs if r["attack"] == "none" and r["screening"]}
    plain = {(r["algorithm"], r["seed"]): r["final_bpb"] for r in runs if r["attack"] == "none" and not r["screening"]}
    paired = sorted(set(clean) & set(plain))
    overhead = statistics.fmean((clean[k] - plain[k]) / plain[k] for k in paired) if paired else None
    rows, detail = [], []
    keys = sorted(
        {(r["attack"], r["algorithm"], r["malicious"]) for r in runs if r["attack"] != "none" and r["screening"]},
        key=lambda k: (ATTACKS.index(k[0]), ALGORITHMS.index(k[1]), k[2]),
    )
    for attack, algorithm, malicious in keys:
        mine = sorted(
            (
                r
                for r in runs
                if (r["attack"], r["algorithm"], r["malicious"]) == (attack, algorithm, malicious)
                and r["screening"]
                and (algorithm, r["seed"]) in clean
            ),
            key=lambda r: r["seed"],
        )
        if not mine:  # its clean run is not done yet
            continue
        base = [clean[(algorithm, r["seed"])] for r in mine]
        changes = [(r["final_bpb"] - c) / c for r, c in zip(mine, base)]
        rows.append(
            {
                "attack": attack,
                "algorithm": algorithm,
                "peers": PEERS,
                "malicious": malicious,
                "loss_change": statistics.fmean(changes),
                "takeovers": sum(_takeovers(r, c) for r, c in zip(mine, base)),
                "non_finite_rounds": sum(r["non_finite_rounds"] for r in mine),
                "honest_exits": sum(r["honest_exits"] for r in mine),
            }
        )
        detail.append(
            {
                **rows[-1],
                "seeds": [r["seed"] for r in mine],
                "loss_change_per_seed": changes,
                "final_bpb_per_seed": [r["final_bpb"] for r in mine],
                "clean_bpb_per_seed": base,
                "counts": [r["counts"] for r in mine],
            }
        )
    return rows, overhead, detail


def markdown(rows: list[dict], detail: list[dict], overhead: float | None) -> str:
    lines = [
        (
            "| attack | algorithm | malicious of N | loss change vs clean (mean over seeds) | per seed | takeovers "
            "| non-finite rounds | honest exits |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, d in zip(rows, detail):
        per_seed = ", ".join(f"{100 * x:+.2f} %" for x in d["loss_change_per_seed"])
        lines.append(
            f"| {row['attack']} | {row['algorithm']} | {row['malicious']} of {row['peers']} | "
            f"{100 * row['loss_change']:+.2f} % | {per_seed} | {row['takeovers']} | {row['non_finite_rounds']} "
            f"| {row['honest_exits']} |"
        )
    if overhead is not None:
        lines.append(
            f"\nclean_overhead (hub screening as the network vs plain mean, no attacker): {100 * overhead:+.3f} %"
        )
    return "\n".join(lines)


def _train_task(task: tuple[RunManifest, dict, dict]) -> dict:
    base, bench, kwargs = task
    return _train(base, bench, **kwargs)


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--attacks", nargs="+", choices=[*ATTACKS, BOGUS], default=list(ATTACKS))
    parser.add_argument("--malicious", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="engine runs at once (separate processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument(
        "--matchmaking-s", type=float, default=60.0, help="how long a group waits for the members it expects, s"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field (TOML value)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of an earlier invocation with the same manifest and rounds (read from the "
        "detail file next to --out) and run only the others",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    if any(not 1 <= k < PEERS for k in args.malicious):
        parser.error(f"--malicious {args.malicious}: expected counts from 1 to {PEERS - 1}")
    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    corpus_or_exit(parser, base.data, args.config)
    start = time.perf_counter()
    attacks = [a for a in args.attacks if a != BOGUS]
    # seed-major: an interrupted invocation has every attack at the first seed
    work = []
    for s in args.seeds:
        for algorithm in args.algorithms:
            work += [dict(attack=None, algorithm=algorithm, malicious=0, seed=s, screening=sc) for sc in (True, False)]
            work += [
                dict(attack=a, algorithm=algorithm, malicious=k, seed=s, screening=True)
                for a in attacks
                for k in args.malicious
            ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    detail_path = args.out.with_name(args.out.stem + ".detail.json")
    config = json.loads(
        json.dumps(
            {
                **manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds).to_dict(),
                "bench": bench,
            }
        )
    )
    runs: list[dict] = []
    if args.resume and detail_path.exists():
        earlier = json.loads(detail_path.read_text())
        if earlier.get("config") != config:
            parser.error(f"--resume: {detail_path} holds runs of another manifest or round count")
        wanted = {_key(w) for w in work}
        runs = [r for r in earlier.get("runs", []) if _key(r) in wanted]
        print(f"kept {len(runs)} run(s) from {detail_path}", flush=True)
    announcements: list[dict] = []
    if BOGUS in args.attacks:
        from bench.byzantine_announce import announcement_attack

        for malicious in args.malicious:
            announcements += announcement_attack(
                manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds), malicious=malicious
            )
    done = {_key(r) for r in runs}
    todo = [w for w in work if _key(w) not in done]

    def write() -> tuple[list[dict], list[dict], float | None]:
        rows, overhead, detail = summarize(runs)
        sybil, sybil_source = sybil_rows(args.out.parent / "sybil.json")
        args.out.write_text(
            json.dumps({"source": "engine", "results": rows, "sybil": sybil, "clean_overhead": overhead}, indent=1)
            + "\n"
        )
        detail_path.write_text(
            json.dumps(
                {
                    "source": "engine",
                    "results": detail,
                    "clean_overhead": overhead,
                    "sybil": sybil_source,
                    "announcements": announcements,
                    "units": {
                        "loss_change": "fraction: (attacked - clean) / clean, final val bits per byte, mean over "
                        "the honest peers' own losses",
                        "clean_overhead": "fraction: (hub screening - plain mean) / plain mean, no attacker",
                    },
                    "takeover_definition": TAKEOVER,
                    "complete": {_key(w) for w in work} <= {_key(r) for r in runs},
                    "command": " ".join(["python", *sys.argv]),
                    "device": f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores, shared), torch "
                    f"{torch.__version__}, {args.jobs} run(s) at once, {args.threads} thread(s) each",
                    "rounds": args.rounds,
                    "config": config,
                    "runs": runs,
                    "wall_s_total": time.perf_counter() - start,
                },
                indent=1,
            )
            + "\n"
        )
        return rows, detail, overhead

    # a pool whose workers end with this process: SIGTERM (`timeout`, kill) raises here and the
    # finally terminates them (a ProcessPoolExecutor's spawned workers outlived a killed parent)
    signal.signal(signal.SIGTERM, _stop)
    pool = multiprocessing.get_context("spawn").Pool(max(1, args.jobs))
    try:
        tasks = [
            (base, bench, dict(rounds=args.rounds, threads=args.threads, matchmaking_s=args.matchmaking_s, **w))
            for w in todo
        ]
        for r in pool.imap_unordered(_train_task, tasks):
            runs.append(r)
            print(
                f"{r['attack']} {r['algorithm']} ({r['malicious']} malicious, screening "
                f"{'on' if r['screening'] else 'off'}) seed {r['seed']}: {r['final_bpb']:.4f} bpb, "
                f"adopted forged {r['adopted_forged']}, non-finite rounds {r['non_finite_rounds']}, "
                f"exits {r['honest_exits']}, {r['counts']} ({r['wall_s']:.0f} s)",
                flush=True,
            )
            write()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
    rows, detail, overhead = write()
    print()
    print(markdown(rows, detail, overhead))
    print(f"\nwrote {args.out} and {detail_path}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
