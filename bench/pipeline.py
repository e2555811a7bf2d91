"""Benchmark: pipeline stages against the unpipelined swarm at equal tokens (issue #19, simulation half).

    python bench/pipeline.py [--config bench/compare.toml] [--stages 2] [--replicas 2] \
        [--routings random fastest] [--methods diloco] [--seeds 0 1] [--rounds 16] [--jobs 2]

In one process per run (lab/pipeline.py): S stages × R replicas, each micro-batch routed to a
replica of the next stage, activations and their gradients in ``pipeline.activation_dtype`` at
each boundary, each stage's replicas running the outer algorithm among themselves; against the
unpipelined swarm of the same run (the round engine, lab/engine_sim.py). The model, data and schedule are
bench/compare.py's (fixed global batch, split over the R replicas of stage 0). Two references at equal tokens: the unpipelined swarm of S·R peers (as many peers as the
pipeline: ``unpipelined_bpb``) and of R peers (its width, on the same shards and batches:
``unpipelined_r_peers_bpb``). Writes ``bench/results/pipeline.json``: ``{"results": [{"stages",
"replicas_per_stage", "routing", "tokens_per_s", "activation_bytes_per_token", "final_bpb",
"unpipelined_bpb", ...}]}`` with seed means, and prints a markdown table (docs/results.md: bench/results_doc.py).

Not measured here: throughput across real peers (bench/pipeline_rig.py measures it on the
network-namespace rig; its rows, ``"measured": "rig"``, are kept in the same file).
``tokens_per_s`` is the simulation's own, one process, one CPU thread, no network: the cost of
the stage split and bf16 boundaries in compute, nothing about the network.
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
from bench.compare import corpus_or_exit, load_config, manifest_for
from lab.engine_sim import run_engine_simulation
from lab.pipeline import run_pipeline
from peer.train.data import load_corpus
from protocol.manifest import RunManifest
from protocol.specs import ROUTINGS

RESULTS = Path(__file__).with_name("results") / "pipeline.json"


def _one(
    base: RunManifest, method: str, stages: int, routing: str, replicas: int, seed: int, bench: dict, rounds: int
) -> dict:
    """One run: ``stages`` = 1 is the unpipelined swarm of ``replicas`` peers (the round engine,
    lab/engine_sim.py, pinned to the lockstep)."""
    torch.set_num_threads(1)
    m = manifest_for(base, method, replicas, seed, bench["global_batch_tokens"], rounds)
    corpus = load_corpus(m.data)
    start = time.perf_counter()
    if stages == 1:
        r = run_engine_simulation(
            m, corpus, peers=replicas, rounds=rounds, seed=seed, eval_every_rounds=rounds, pinned=True
        )
        history, boundary = r.history, 0.0
    else:
        m = m.replace(pipeline={"stages": stages, "routing": routing})
        p = run_pipeline(m, corpus, replicas=replicas, rounds=rounds, seed=seed, eval_every_rounds=rounds)
        history, boundary = p.history, p.activation_bytes_per_token
    wall = time.perf_counter() - start
    return {
        "method": method,
        "stages": stages,
        "routing": routing if stages > 1 else "-",
        "replicas": replicas,
        "seed": seed,
        "final_bpb": history[-1].loss_bpb,
        "tokens": history[-1].tokens,
        "activation_bytes_per_token": boundary,
        "wall_s": wall,
    }


def rows_of(runs: list[dict]) -> list[dict]:
    """Seed means per (method, stages, routing, R), each with the unpipelined mean of its seeds."""
    plain = {(r["method"], r["replicas"], r["seed"]): r["final_bpb"] for r in runs if r["stages"] == 1}
    keys = sorted({(r["method"], r["stages"], r["routing"], r["replicas"]) for r in runs if r["stages"] > 1})
    rows = []
    for method, stages, routing, replicas in keys:
        mine = [
            r
            for r in runs
            if (r["method"], r["stages"], r["routing"], r["replicas"]) == (method, stages, routing, replicas)
        ]
        peers = stages * replicas
        seeds = sorted(
            r["seed"] for r in mine if (method, replicas, r["seed"]) in plain and (method, peers, r["seed"]) in plain
        )
        mine = [r for r in mine if r["seed"] in seeds]
        if not mine:
            continue
        final = statistics.mean(r["final_bpb"] for r in mine)
        unpiped = statistics.mean(plain[(method, peers, s)] for s in seeds)
        same_width = statistics.mean(plain[(method, replicas, s)] for s in seeds)
        rows.append(
            {
                "stages": stages,
                "replicas_per_stage": replicas,
                "routing": routing,
                "method": method,
                "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine),
                "activation_bytes_per_token": mine[0]["activation_bytes_per_token"],
                "final_bpb": final,
                "unpipelined_bpb": unpiped,
                "vs_unpipelined": 100 * (final / unpiped - 1),
                "unpipelined_r_peers_bpb": same_width,
                "vs_unpipelined_r_peers": 100 * (final / same_width - 1),
                "seeds": seeds,
                "per_seed_bpb": [r["final_bpb"] for r in sorted(mine, key=lambda r: r["seed"])],
                "unpipelined_per_seed_bpb": [plain[(method, peers, s)] for s in seeds],
                "unpipelined_r_peers_per_seed_bpb": [plain[(method, replicas, s)] for s in seeds],
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        (
            "| method | stages × replicas | routing | final bpb | unpipelined S·R peers | vs it | unpipelined R "
            "peers | vs it | boundary bytes/token | sim tokens/s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['stages']} × {r['replicas_per_stage']} | {r['routing']} | "
            f"{r['final_bpb']:.4f} | {r['unpipelined_bpb']:.4f} | {r['vs_unpipelined']:+.2f} % | "
            f"{r['unpipelined_r_peers_bpb']:.4f} | {r['vs_unpipelined_r_peers']:+.2f} % | "
            f"{r['activation_bytes_per_token']:.0f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).parents[0] / "compare.toml")
    parser.add_argument("--methods", nargs="+", default=["diloco"], choices=["diloco", "noloco"])
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, help="override bench.rounds of the config")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (separate processes)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    base, bench = load_config(args.config)
    corpus_or_exit(parser, base.data, args.config)
    rounds = args.rounds or bench["rounds"]
    # the references: R unpipelined peers (the pipeline's width) and S·R (as many peers as the pipeline)
    widths = sorted({args.replicas} | {s * args.replicas for s in args.stages if s > 1})
    work = [(method, 1, "-", peers, seed) for method in args.methods for peers in widths for seed in args.seeds]
    work += [
        (method, s, routing, args.replicas, seed)
        for method in args.methods
        for s in args.stages
        if s > 1
        for routing in args.routings
        for seed in args.seeds
    ]
    start = time.perf_counter()
    command = " ".join(["python", *sys.argv])
    runs: list[dict] = []
    with concurrent.futures.ProcessPoolExecutor(
        max(1, args.jobs), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = [
            pool.submit(_one, base, method, s, routing, peers, seed, bench, rounds)
            for method, s, routing, peers, seed in work
        ]
        for f in concurrent.futures.as_completed(futures):
            runs.append(f.result())
            r = runs[-1]
            print(
                f"{r['method']} S={r['stages']} R={r['replicas']} {r['routing']} seed {r['seed']}: "
                f"{r['final_bpb']:.4f} bpb ({r['wall_s']:.0f} s)",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            # the rig's rows (bench/pipeline_rig.py: real peers) are kept beside the simulation's
            earlier = json.loads(args.out.read_text()) if args.out.exists() else {}
            kept = {k: v for k, v in earlier.items() if k.startswith("rig_")}
            args.out.write_text(
                json.dumps(
                    {
                        "results": [{"measured": "simulation", **r} for r in rows_of(runs)]
                        + [r for r in earlier.get("results", []) if r.get("measured") == "rig"],
                        **kept,
                        "where": "in-process simulation (lab/pipeline.py vs the round engine, lab/engine_sim.py), one CPU thread per run, no "
                        "network; tokens_per_s is the simulation's compute throughput, not a swarm's",
                        "vs_unpipelined_unit": "percent above the unpipelined swarm of S·R peers (as many peers as the "
                        "pipeline; vs_unpipelined_r_peers: of R peers, its width), same method, "
                        "seeds and tokens",
                        "complete": len(runs) == len(work),
                        "command": command,
                        "device": f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores), torch {torch.__version__}",
                        "config": {**base.to_dict(), "bench": {**bench, "rounds": rounds}},
                        "runs": runs,
                        "wall_s_total": time.perf_counter() - start,
                    },
                    indent=1,
                )
                + "\n"
            )
    print()
    print(markdown(rows_of(runs)))
    print(f"\nwrote {args.out}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
