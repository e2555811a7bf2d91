"""Benchmark: what overlapping each sync with the next round costs in loss (issue #18, quality half).

    python bench/overlap.py [--config bench/compare.toml] [--methods diloco noloco] \
        [--modes none delayed eager streaming] [--peers 4] [--seeds 0 1] [--rounds 16] [--jobs 2] \
        [--threads 1] [--set sync.fragments=2] [--from-round K] [--merge]

Runs N peers in one process with bench/compare.py's run manifest and its fixed global batch, once
per ``sync.overlap`` mode, so every run sees the same tokens; the mode is the only difference. Every
run is the round engine (lab/engine_sim.py: N real round loops, peer/round/, over the in-process
hub, with the thread timing pinned to the lockstep (``run_engine_simulation(..., pinned=True)``), so
where a mean lands does not depend on the machine's load and the figures are deterministic).
NoLoCo's random groups follow each run's id, which the mode is part of: each mode draws its own
pairs, as swarms of different manifests would (rows recorded before NoLoCo ran on the engine, with
``"runner": "simulation"``, drew none's pairs in every mode). The
final validation loss (bits per byte, after the last in-flight sync landed) is compared with
overlap "none" at the same method, N and seeds. Writes ``bench/results/overlap.json``:
``{"results": [...], "quality": [{"overlap", "peers", "final_bpb", "vs_none", ...}]}``. "results"
(compute utilization on the network-namespace rig, bench/overlap_rig.py) are never touched here:
those of an existing ``--out`` are kept. ``--merge`` also keeps the existing quality rows (and runs)
that this invocation does not measure again, e.g. to add streaming rows beside none/delayed/eager;
without it the quality rows are this invocation's alone. A streaming row names its fragments P,
delay τ, α and merge rule (``sync.fragments``, ``fragment_delay_steps``, ``fragment_alpha``,
``fragment_merge``, set with ``--set``; the compare model has 2 blocks, so P ≤ 2 there), and rows
of different settings are kept apart. ``--from-round K`` runs delayed and eager without overlap for
the first K rounds (the manifest's ``sync.overlap_from_round``, as the swarm's peers run it; their
rows are kept apart too). Prints a markdown table (docs/results.md: bench/results_doc.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ and bench/ are repo tooling
from bench.compare import apply_overrides, corpus_or_exit, load_config, manifest_for
from lab.engine_sim import run_engine_simulation
from peer.train.data import load_corpus
from protocol.errors import ManifestError
from protocol.manifest import RunManifest
from protocol.specs import OVERLAP_MODES, STREAMING_FIELDS, SyncSpec

RESULTS = Path(__file__).with_name("results") / "overlap.json"
DEFAULT_MERGE = SyncSpec().fragment_merge
"""What a streaming row recorded before ``sync.fragment_merge`` existed ran with (rows from before
2026-11-29 lack the key)."""


def run_manifest(
    base: RunManifest, method: str, mode: str, peers: int, seed: int, bench: dict, rounds: int
) -> RunManifest:
    """The manifest of one simulation: bench/compare.py's (fixed global batch, seeded φ_0, cosine
    ending with the run) with ``sync.overlap = mode``.

    Raises:
        ManifestError: the mode does not fit the run (e.g. streaming with more fragments than blocks).
        ValueError: the global batch does not split over ``peers``.
    """
    return manifest_for(base, method, peers, seed, bench["global_batch_tokens"], rounds).replace(sync={"overlap": mode})


def _one(
    base: RunManifest,
    method: str,
    mode: str,
    peers: int,
    seed: int,
    bench: dict,
    rounds: int,
    threads: int,
    from_round: int = 0,
) -> dict:
    torch.set_num_threads(threads)
    blocking_rounds = from_round if mode != "none" else 0
    m = run_manifest(base, method, mode, peers, seed, bench, rounds).replace(
        sync={"overlap_from_round": blocking_rounds}
    )
    r = run_engine_simulation(
        m, load_corpus(base.data), peers=peers, rounds=rounds, seed=seed, eval_every_rounds=rounds, pinned=True
    )
    run = {
        "runner": "engine",
        "method": method,
        "overlap": mode,
        "peers": peers,
        "seed": seed,
        "final_bpb": r.history[-1].loss_bpb,
        "tokens": r.history[-1].tokens,
        "wall_s": r.wall_s,
    }
    if mode == "streaming":
        run["streaming"] = {k: getattr(m.sync, k) for k in STREAMING_FIELDS}
    if blocking_rounds:
        run["from_round"] = blocking_rounds
    return run


def _variant(row: dict) -> tuple:
    """What tells rows of one mode apart: a streaming row's (P, τ, α, merge), then ``from_round`` K
    where the first K rounds ran without overlap; () for a plain delayed or eager row."""
    settings = {"fragment_merge": DEFAULT_MERGE, **row.get("streaming", {})}
    streaming = tuple(settings.get(k) for k in STREAMING_FIELDS) if row["overlap"] == "streaming" else ()
    return streaming + ((row["from_round"],) if row.get("from_round") else ())


def row_key(row: dict) -> tuple:
    """What a quality row (or run) measures: runner (rows from before the engine ran it: the
    simulation), method, overlap, N and streaming's settings."""
    return row.get("runner", "simulation"), row["method"], row["overlap"], row["peers"], _variant(row)


def quality(runs: list[dict]) -> list[dict]:
    """Means over seeds per (method, overlap, N, streaming settings); ``vs_none``: % above overlap
    'none' on the same seeds, whose mean is ``none_bpb`` (a row merged from another invocation keeps
    the none it was measured against: NoLoCo's pairs follow the streaming fields, so its none differs)."""
    out = []
    for method, peers in sorted({(r["method"], r["peers"]) for r in runs}):
        mine = [r for r in runs if r["method"] == method and r["peers"] == peers]
        none = {r["seed"]: r["final_bpb"] for r in mine if r["overlap"] == "none"}
        for mode in OVERLAP_MODES:
            for variant in sorted({_variant(r) for r in mine if r["overlap"] == mode}):
                rs = sorted(
                    (r for r in mine if r["overlap"] == mode and _variant(r) == variant), key=lambda r: r["seed"]
                )
                final = statistics.fmean(r["final_bpb"] for r in rs)
                paired = [r for r in rs if r["seed"] in none]
                none_bpb = statistics.fmean(none[r["seed"]] for r in paired) if paired else None
                vs = 100 * (statistics.fmean(r["final_bpb"] for r in paired) / none_bpb - 1) if paired else None
                row = {
                    "runner": rs[0].get("runner", "simulation"),
                    "overlap": mode,
                    "peers": peers,
                    "final_bpb": final,
                    "vs_none": vs,
                    "none_bpb": none_bpb,
                    "method": method,
                    "seeds": [r["seed"] for r in rs],
                    "final_bpb_per_seed": [r["final_bpb"] for r in rs],
                    "tokens_per_run": rs[0]["tokens"],
                }
                if "streaming" in rs[0]:
                    row["streaming"] = dict(rs[0]["streaming"])
                if rs[0].get("from_round"):
                    row["from_round"] = rs[0]["from_round"]
                out.append(row)
    return out


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` and the ``old`` rows whose :func:`row_key` no row of ``new`` has (the fresh
    measurement wins), ordered by method, N, overlap mode (as in OVERLAP_MODES) and settings."""
    fresh = {row_key(r) for r in new}
    rows = [r for r in old if row_key(r) not in fresh] + new
    return sorted(rows, key=lambda r: (r["method"], r["peers"], OVERLAP_MODES.index(r["overlap"]), _variant(r)))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| method | N | overlap | final val bpb (mean over seeds) | per seed | vs none |",
        "|---|---|---|---|---|---|",
    ]
    for q in rows:
        vs = "—" if q["vs_none"] is None else f"{q['vs_none']:+.2f} %"
        seeds = ", ".join(f"{x:.4f}" for x in q["final_bpb_per_seed"])
        mode = q["overlap"]
        if "streaming" in q:
            st = q["streaming"]
            merge = st.get("fragment_merge", DEFAULT_MERGE)
            mode += f" (P = {st['fragments']}, τ = {st['fragment_delay_steps']}, α = {st['fragment_alpha']}" + (
                f", {merge})" if merge != DEFAULT_MERGE else ")"
            )
        if q.get("from_round"):
            mode += f" from round {q['from_round'] + 1} (none before)"
        method = q["method"] + (" (simulation)" if q.get("runner", "simulation") == "simulation" else "")
        lines.append(f"| {method} | {q['peers']} | {mode} | {q['final_bpb']:.4f} | {seeds} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--methods", nargs="+", default=["diloco"], choices=["diloco", "noloco"])
    parser.add_argument("--modes", nargs="+", default=list(OVERLAP_MODES), choices=list(OVERLAP_MODES))
    parser.add_argument("--peers", type=int, nargs="+", default=[4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, help="override bench.rounds of the config")
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
        "--from-round",
        type=int,
        default=0,
        metavar="K",
        help="delayed and eager only: the first K rounds without overlap, the mode from "
        "round K + 1 on (sync.overlap_from_round = K; does overlap cost quality only "
        "early in a run?)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's quality rows and runs that this invocation does not measure again "
        "(its rig 'results' are always kept)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if "none" not in args.modes:
        parser.error("--modes must include 'none': every mode is compared with it")
    if args.from_round < 0 or (args.from_round and "streaming" in args.modes):
        parser.error(
            f"--from-round {args.from_round}: needs K >= 0, and K > 0 only with the modes none, "
            "delayed and eager (streaming's fragments are set up at the start)"
        )

    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    corpus_or_exit(parser, base.data, args.config)
    rounds = args.rounds or bench["rounds"]
    if args.from_round >= rounds:
        parser.error(
            f"--from-round {args.from_round}: the run has {rounds} rounds, so no round would overlap; give K < {rounds}"
        )
    work = [
        (method, mode, peers, seed)
        for method in args.methods
        for peers in args.peers
        for seed in args.seeds
        for mode in args.modes
    ]
    for method, mode, peers, seed in work:  # every run's manifest is checked before any starts
        try:
            run_manifest(base, method, mode, peers, seed, bench, rounds)
        except (ManifestError, ValueError) as exc:
            parser.error(
                f"{method} N={peers} overlap {mode}: {exc}; change it with --set SECTION.FIELD=VALUE "
                "(e.g. --set sync.fragments=2) or leave that mode out of --modes"
            )
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    # the rig's compute-utilization rows (bench/overlap_rig.py) are never this script's to drop
    kept = {k: v for k, v in existing.items() if k.startswith("results")} or {
        "results": [],
        "results_note": "compute utilization on the network-namespace rig (issue #18 item 4): not measured yet",
    }
    command = " ".join(["python", *sys.argv])

    def write(runs: list[dict]) -> list[dict]:
        rows = quality(runs)
        all_rows, all_runs, commands = rows, runs, [command]
        if args.merge and existing:
            all_rows = merged(existing.get("quality", []), rows)
            fresh = {(row_key(r), r["seed"]) for r in runs}
            all_runs = [r for r in existing.get("runs", []) if (row_key(r), r["seed"]) not in fresh] + runs
            before = existing.get("commands") or ([existing["command"]] if "command" in existing else [])
            commands = [c for c in before if c != command] + [command]
        record = {
            **kept,
            "quality": all_rows,
            "vs_none_unit": "percent above overlap 'none' (same method, N and seeds)",
            "complete": len(runs) == len(work),
            "command": command,
            "commands": commands,
            "runner": "engine",
            "device": f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores), torch {torch.__version__}, "
            f"{args.jobs} run(s) at once, {args.threads} thread(s) each",
            "config": {**base.to_dict(), "bench": {**bench, "rounds": rounds}},
            "runs": all_runs,
            "wall_s_total": time.perf_counter() - start,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")  # partial results survive a stop
        return rows

    with concurrent.futures.ProcessPoolExecutor(
        max(1, args.jobs), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = [pool.submit(_one, base, *w, bench, rounds, args.threads, args.from_round) for w in work]
        runs: list[dict] = []
        for f in concurrent.futures.as_completed(futures):
            runs.append(f.result())
            r = runs[-1]
            after = f" from round {r['from_round'] + 1}" if r.get("from_round") else ""
            print(
                f"{r['method']} N={r['peers']} seed {r['seed']} overlap {r['overlap']}{after}: {r['final_bpb']:.4f} bpb "
                f"({r['wall_s']:.0f} s)",
                flush=True,
            )
            rows = write(runs)
    print()
    print(markdown(rows))
    print(f"\nwrote {args.out}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
