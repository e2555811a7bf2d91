"""Benchmark: 8 peers of which 1 (then 2) are malicious, loss at equal tokens against the clean run (issue #17).

    nice -n 5 python bench/byzantine.py [--rounds 10] [--seeds 0 1] [--attack-seeds 0] [--jobs 2] [--merge]

Gradient attacks, lying owners and fake progress are simulated (lab/simulation.py: 8 DiLoCo peers in one
process, the swarm's own inner loop, outer step, group plan, owner screening
peer/sync/screening.py, the receivers' check of each owner's mean (``owner_mean_problem``) and re-sync rule peer/train/resync.py; lab/adversary.py forges what the
malicious peers send), with bench/compare.py's run manifest and fixed global batch, so every run
trains on the same tokens. The bogus run announcement runs on real DHT nodes on 127.0.0.1 (the
node a peer starts, a stock hivemind node as the attacker, peer/node.py's run choice for fresh
joiners).

Each result row compares the honest peers' final validation loss (mean over them, bits per byte)
with the clean run of the same seed (8 honest peers, screening on): ``loss_change`` is
(attacked − clean) / clean, a fraction, averaged over seeds. ``takeovers`` counts, over seeds, the
honest peers (or joiners) the attacker took over (definitions in :data:`TAKEOVER`).
``clean_overhead`` is (clean with screening − clean without) / clean without, averaged over seeds.

``--merge`` keeps every run (and announcement result) of an earlier invocation with the same
manifest and rounds that this invocation does not run, so new attacks add rows to the files.

Writes ``bench/results/byzantine.json`` with the issue's keys only, and
``bench/results/byzantine.detail.json`` with every run, the definitions and the config. Prints a
markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import logging
import math
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ and bench/ are repo tooling
from bench.compare import apply_overrides, corpus_or_exit, load_config, manifest_for
from lab.adversary import GRADIENT_ATTACKS, OWNER_ATTACKS, Adversary
from lab.simulation import run_simulation
from peer.train.data import load_corpus
from protocol.errors import ManifestError
from protocol.manifest import RunManifest

ORDER = [*GRADIENT_ATTACKS, *OWNER_ATTACKS, "fake-progress"]
CONTROLS = ("fake-progress", "owner-flip-x100")
"""Attacks also run once with the defenses off (first attack seed, fewest malicious): what they do unchecked."""
RESULTS = Path(__file__).with_name("results") / "byzantine.json"
PEERS = 8
TAKEOVER_LOSS_FACTOR = 1.5
FRESH_IDENTITIES = 8
"""Identities the fake-progress attacker adds to its malicious peers: more than the honest peers'
own class (7 or 6), so that counting records alone would follow it."""
TAKEOVER = {
    "gradient": f"an honest peer whose final φ is not finite or whose validation loss exceeds {TAKEOVER_LOSS_FACTOR}x "
    "the clean run's (same seed)",
    "owner": "as gradient: an honest peer whose final φ is not finite or whose validation loss exceeds "
    f"{TAKEOVER_LOSS_FACTOR}x the clean run's (same seed)",
    "fake-progress": "an honest peer that adopted the attacker's all-zero state at least once (re-sync rule)",
    "bogus-announcement": "a fresh joiner (one per way of joining) whose run choice is the attacker's run",
}


def _train(
    base: RunManifest,
    bench: dict,
    *,
    rounds: int,
    seed: int,
    attack: str | None,
    malicious: int,
    screening: bool,
    threads: int,
) -> dict:
    torch.set_num_threads(threads)
    m = manifest_for(base, "diloco", PEERS, seed, bench["global_batch_tokens"], rounds)
    adversary = None
    if attack is not None:
        adversary = Adversary(
            attack=attack,
            peers=tuple(range(PEERS - malicious, PEERS)),
            fresh_identities=FRESH_IDENTITIES if attack == "fake-progress" else 0,
        )
    r = run_simulation(
        m,
        load_corpus(base.data),
        peers=PEERS,
        rounds=rounds,
        seed=seed,
        eval_every_rounds=rounds,
        screening=screening,
        adversary=adversary,
    )
    h = r.history[-1]
    return {
        "attack": attack or "none",
        "malicious": malicious,
        "seed": seed,
        "screening": screening,
        "final_bpb": h.loss_bpb,
        "per_peer_bpb": h.per_peer_bpb,
        "tokens": h.tokens,
        "screening_counts": r.screening,
        "taken_over": {str(k): v for k, v in r.taken_over.items()},
        "wall_s": r.wall_s,
    }


def _takeovers(run: dict, clean_bpb: float) -> int:
    if run["attack"] == "fake-progress":
        return len(run["taken_over"])
    losses = run["per_peer_bpb"] or [run["final_bpb"]]
    return sum(1 for x in losses if not math.isfinite(x) or x > TAKEOVER_LOSS_FACTOR * clean_bpb)


def summarize(runs: list[dict], announcements: list[dict]) -> tuple[list[dict], float | None, list[dict]]:
    """(rows with the issue's keys, clean_overhead, detail rows with per-seed figures)."""
    clean = {r["seed"]: r["final_bpb"] for r in runs if r["attack"] == "none" and r["screening"]}
    bare = {r["seed"]: r["final_bpb"] for r in runs if r["attack"] == "none" and not r["screening"]}
    paired = sorted(set(clean) & set(bare))
    overhead = statistics.fmean((clean[s] - bare[s]) / bare[s] for s in paired) if paired else None
    rows, detail = [], []
    keys = sorted(
        {(r["attack"], r["malicious"]) for r in runs if r["attack"] != "none" and r["screening"]},
        key=lambda k: (ORDER.index(k[0]), k[1]),
    )
    for attack, malicious in keys:
        mine = sorted(
            (
                r
                for r in runs
                if (r["attack"], r["malicious"]) == (attack, malicious) and r["screening"] and r["seed"] in clean
            ),
            key=lambda r: r["seed"],
        )
        if not mine:  # its clean run (same seed) is not done yet: an interrupted or running invocation
            continue
        changes = [(r["final_bpb"] - clean[r["seed"]]) / clean[r["seed"]] for r in mine]
        takeovers = sum(_takeovers(r, clean[r["seed"]]) for r in mine)
        rows.append(
            {
                "attack": attack,
                "malicious": malicious,
                "peers": PEERS,
                "loss_change": statistics.fmean(changes),
                "takeovers": takeovers,
            }
        )
        detail.append(
            {
                **rows[-1],
                "seeds": [r["seed"] for r in mine],
                "loss_change_per_seed": changes,
                "final_bpb_per_seed": [r["final_bpb"] for r in mine],
                "clean_bpb_per_seed": [clean[r["seed"]] for r in mine],
                "screening_counts": [r["screening_counts"] for r in mine],
                "taken_over": [r["taken_over"] for r in mine],
            }
        )
    for r in sorted(
        (r for r in runs if r["attack"] != "none" and not r["screening"] and r["seed"] in clean),
        key=lambda r: (r["attack"], r["malicious"], r["seed"]),
    ):
        detail.append(
            {
                "attack": r["attack"],
                "malicious": r["malicious"],
                "peers": PEERS,
                "control": True,
                "defenses": "off (screening, vouching, sanity check)",
                "seed": r["seed"],
                "loss_change": (r["final_bpb"] - clean[r["seed"]]) / clean[r["seed"]],
                "takeovers": _takeovers(r, clean[r["seed"]]),
                "final_bpb": r["final_bpb"],
                "screening_counts": r["screening_counts"],
                "taken_over": r["taken_over"],
            }
        )
    for malicious in sorted({a["malicious"] for a in announcements}):
        mine = [a for a in announcements if a["malicious"] == malicious]
        takeovers = sum(a["chose"] == "attacker" for a in mine)
        # a joiner that is not taken over trains the clean run (or none, if its join was refused)
        rows.append(
            {
                "attack": "bogus-announcement",
                "malicious": malicious,
                "peers": PEERS,
                "loss_change": 0.0 if takeovers == 0 else math.inf,
                "takeovers": takeovers,
            }
        )
        detail.append({**rows[-1], "joiners": mine})
    return rows, overhead, detail


def markdown(rows: list[dict], detail: list[dict], overhead: float | None) -> str:
    lines = [
        "| attack | malicious of N | loss change vs clean (mean over seeds) | per seed | takeovers |",
        "|---|---|---|---|---|",
    ]
    by_key = {(d["attack"], d["malicious"]): d for d in detail if not d.get("control")}
    for row in rows:
        d = by_key[(row["attack"], row["malicious"])]
        per_seed = ", ".join(f"{100 * x:+.2f} %" for x in d.get("loss_change_per_seed", [])) or "—"
        lines.append(
            f"| {row['attack']} | {row['malicious']} of {row['peers']} | {100 * row['loss_change']:+.2f} % "
            f"| {per_seed} | {row['takeovers']} |"
        )
    for d in (d for d in detail if d.get("control")):
        lines.append(
            f"| control: {d['attack']}, defenses off | {d['malicious']} of {d['peers']} | "
            f"{100 * d['loss_change']:+.2f} % | seed {d['seed']} | {d['takeovers']} |"
        )
    if overhead is not None:
        lines.append(f"\nclean_overhead (screening on vs off, no attacker): {100 * overhead:+.3f} %")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the clean runs (both switches)")
    parser.add_argument("--attack-seeds", type=int, nargs="+", default=[0], help="seeds of the attacked runs")
    parser.add_argument(
        "--attacks", nargs="+", default=[*GRADIENT_ATTACKS, *OWNER_ATTACKS, "fake-progress", "bogus-announcement"]
    )
    parser.add_argument("--malicious", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (separate processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per simulation")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field (TOML value)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control runs (CONTROLS) against the defenses off (every record counts, every "
        "finite mean is applied)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the simulated runs of an earlier, interrupted invocation with the same manifest "
        "and rounds (read from the detail file next to --out) and run only the others; fields "
        "only one of the two manifests has (a newer manifest schema) are not compared",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs and announcement results of an earlier invocation with the same manifest "
        "and rounds (read from the detail file next to --out) that this invocation does not run: "
        "the files then hold both",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    if "fake-progress" in args.attacks and not _resync_takes_vouchers():
        parser.error(
            "fake-progress needs the vouched re-sync rule (resync_target(..., vouchers=...)); "
            "leave it out with --attacks"
        )
    missing = [s for s in args.attack_seeds if s not in args.seeds]
    if missing:
        parser.error(f"--attack-seeds {missing} have no clean run: add them to --seeds")

    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    corpus_or_exit(parser, base.data, args.config)
    start = time.perf_counter()
    work = [dict(attack=None, malicious=0, seed=s, screening=sc) for s in args.seeds for sc in (True, False)]
    # seed-major: an interrupted invocation has every attack at the first seed
    work += [
        dict(attack=a, malicious=k, seed=s, screening=True)
        for s in args.attack_seeds
        for a in args.attacks
        if a != "bogus-announcement"
        for k in args.malicious
    ]
    for control in CONTROLS:  # the attacks on the rules before issue 17, defenses off
        if control in args.attacks and not args.no_control:
            work.append(dict(attack=control, malicious=min(args.malicious), seed=args.attack_seeds[0], screening=False))
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
    announcements: list[dict] = []
    earlier_invocations: list[dict] = []
    """--merge: command and device of the invocations whose runs were kept."""
    if (args.resume or args.merge) and detail_path.exists():
        earlier = json.loads(detail_path.read_text())
        if not _same_settings(earlier.get("config", {}), config):
            parser.error(f"--resume/--merge: {detail_path} holds runs of another manifest or round count")
        wanted = {_key(w) for w in work}
        runs = [
            r for r in earlier["runs"] if (args.resume and _key(r) in wanted) or (args.merge and _key(r) not in wanted)
        ]
        if args.merge:
            earlier_invocations = [
                *earlier.get("earlier_invocations", []),
                {k: earlier.get(k) for k in ("command", "device", "wall_s_simulations_sum")},
            ]
        if args.merge and "bogus-announcement" not in args.attacks:
            announcements = [a for d in earlier["results"] for a in d.get("joiners", [])]
        print(f"kept {len(runs)} run(s) and {len(announcements)} announcement result(s) from {detail_path}", flush=True)
    if "bogus-announcement" in args.attacks:
        from bench.byzantine_announce import announcement_attack

        for malicious in args.malicious:
            announcements += announcement_attack(
                manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds), malicious=malicious
            )
            for a in (a for a in announcements if a["malicious"] == malicious):
                print(
                    f"bogus announcement, {malicious} attacker(s): {a['join']}: {a['chose']} ({a['outcome']})",
                    flush=True,
                )
    done = {_key(r) for r in runs}
    todo = [w for w in work if _key(w) not in done]

    def write() -> tuple[list[dict], list[dict], float | None]:
        rows, overhead, detail = summarize(runs, announcements)
        args.out.write_text(json.dumps({"results": rows, "clean_overhead": overhead}, indent=1) + "\n")
        m = manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds)
        detail_path.write_text(
            json.dumps(
                {
                    "results": detail,
                    "clean_overhead": overhead,
                    "units": {
                        "loss_change": "fraction: (attacked - clean) / clean, final val bits per byte, honest peers",
                        "clean_overhead": "fraction: (screened - unscreened) / unscreened, no attacker",
                    },
                    "takeover_definitions": TAKEOVER,
                    "complete": {_key(w) for w in work} <= {_key(r) for r in runs},
                    "command": " ".join(["python", *sys.argv]),
                    "device": f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores, shared), torch "
                    f"{torch.__version__}, {args.jobs} simulation(s) at once, {args.threads} thread(s) each",
                    "outer_optimizer": m.outer_optimizer.__dict__,
                    "inner_steps": m.sync.inner_steps,
                    "rounds": args.rounds,
                    "config": config,
                    "runs": runs,
                    "wall_s_total": time.perf_counter() - start,
                    "earlier_invocations": earlier_invocations,
                    "wall_s_simulations_sum": sum(r["wall_s"] for r in runs),
                },
                indent=1,
            )
            + "\n"
        )
        return rows, detail, overhead

    with concurrent.futures.ProcessPoolExecutor(
        max(1, args.jobs), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = [pool.submit(_train, base, bench, rounds=args.rounds, threads=args.threads, **w) for w in todo]
        for f in concurrent.futures.as_completed(futures):
            runs.append(f.result())
            r = runs[-1]
            print(
                f"{r['attack']} ({r['malicious']} malicious, screening {'on' if r['screening'] else 'off'}) "
                f"seed {r['seed']}: {r['final_bpb']:.4f} bpb, clipped {r['screening_counts']['clipped']}, "
                f"refused {r['screening_counts'].get('refused')}, "
                f"taken over {r['taken_over']} ({r['wall_s']:.0f} s)",
                flush=True,
            )
            write()
    rows, detail, overhead = write()
    print()
    print(markdown(rows, detail, overhead))
    print(f"\nwrote {args.out} and {detail_path}; total wall {time.perf_counter() - start:.0f} s")


def _same_settings(a, b) -> bool:
    """Whether two configs agree on every field both have (a field added to or dropped from the
    manifest schema since does not count: the simulation never reads such a field)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same_settings(a[k], b[k]) for k in a.keys() & b.keys())
    return a == b


def _key(run: dict) -> tuple:
    return (run["attack"] or "none", run["malicious"], run["seed"], run["screening"])


def _resync_takes_vouchers() -> bool:
    from peer.train import resync

    return "vouchers" in inspect.signature(resync.diloco_resync_target).parameters


if __name__ == "__main__":
    main()
