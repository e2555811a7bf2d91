"""Benchmark: sweep the outer optimizer (DiLoCo Nesterov or heavy-ball, lr, momentum; NoLoCo α, β = γ)
and H at equal tokens, against data-parallel, to choose the shipped defaults (issue #15 item 3).

    python bench/sweep_outer.py [--config bench/compare.toml] [--peers 2 4 8] [--seeds 0 1] [--jobs 2]
    python bench/sweep_outer.py --peers 4 --seeds 0 --settings nesterov:0.7:0.9 heavy-ball:1.0:0.5:50
    python bench/sweep_outer.py --peers 4 --global-batch 16384 --settings heavy-ball:1.0:0.0   # twice the batch
    python bench/sweep_outer.py --peers 4 --set inner_optimizer.lr=0.003 --settings            # data-parallel only

Every run is a swarm in one process, on the round engine a peer runs (lab/engine_sim.py), or the
data-parallel ceiling (lab/data_parallel.py), at
the scale of bench/compare.toml: the same global batch and the same number of inner steps per
peer (``bench.rounds`` × the manifest's H), so a setting with another H runs more or fewer rounds
of the same tokens. A setting is ``KIND:LR:MOMENTUM[:H]``, KIND ``nesterov`` or ``heavy-ball`` (DiLoCo)
or ``noloco`` (LR is β = γ, MOMENTUM α).
Prints one row per setting and N (mean and per-seed final validation bits per byte, gap to
data-parallel) and writes ``bench/results/sweep-outer.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ is repo tooling, not installed
from bench.compare import (
    GLOBAL_BATCH_HINT,
    apply_overrides,
    check_global_batch,
    corpus_or_exit,
    load_config,
    manifest_for,
)
from lab.data_parallel import run_data_parallel
from lab.engine_sim import run_engine_simulation
from peer.train.data import load_corpus
from protocol.errors import ManifestError

DEFAULT_SETTINGS = [
    "nesterov:0.7:0.9",  # DiLoCo paper (H = 500, pretrained start); ~7× plain averaging
    "nesterov:0.1:0.9",  # same momentum, step ~1× plain averaging
    "nesterov:0.3:0.9",
    "nesterov:0.7:0.5",
    "nesterov:1.0:0.3",
    "heavy-ball:1.0:0.0",  # plain averaging
    "heavy-ball:0.7:0.3",  # the NoLoCo repo's DiLoCo baseline
    "heavy-ball:1.0:0.5",
    "heavy-ball:0.7:0.5",
    "noloco:0.7:0.5",  # NoLoCo paper defaults (β = γ = 0.7, α = 0.5)
    "noloco:1.0:0.0",
    "noloco:0.7:0.3",
]


def parse_setting(text: str, default_h: int, steps_per_peer: int) -> dict:
    """One ``KIND:LR:MOMENTUM[:H]`` setting as a dict; SystemExit naming the setting if it is malformed or
    its H does not divide ``steps_per_peer`` (every run must train the same inner steps, so the same tokens)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in ("nesterov", "heavy-ball", "noloco"):
        raise SystemExit(f"bad setting {text!r}: want KIND:LR:MOMENTUM[:H], KIND nesterov, heavy-ball or noloco")
    try:
        lr, momentum = float(parts[1]), float(parts[2])
        h = int(parts[3]) if len(parts) == 4 else default_h
    except ValueError:
        raise SystemExit(f"bad setting {text!r}: LR and MOMENTUM are numbers, H an integer") from None
    if h < 1 or steps_per_peer % h:
        raise SystemExit(
            f"bad setting {text!r}: H = {h} must divide the {steps_per_peer} inner steps per peer of "
            "the config (bench.rounds x sync.inner_steps), so that every run trains on the same tokens"
        )
    if parts[0] == "noloco":  # β = γ = LR, α = MOMENTUM, heavy-ball (docs/algorithms.md §2)
        return {"algorithm": "noloco", "lr": lr, "momentum": momentum, "pull": lr, "inner_steps": h}
    return {"algorithm": "diloco", "nesterov": parts[0] == "nesterov", "lr": lr, "momentum": momentum, "inner_steps": h}


def label(outer: dict | None) -> str:
    if outer is None:
        return "data-parallel"
    if outer["algorithm"] == "noloco":
        return f"NoLoCo β=γ {outer['lr']:g} α {outer['momentum']:g} H {outer['inner_steps']}"
    kind = "Nesterov" if outer["nesterov"] else "heavy-ball"
    return f"DiLoCo {kind} lr {outer['lr']:g} μ {outer['momentum']:g} H {outer['inner_steps']}"


_CORPUS = {}


def one_run(
    config: str,
    outer: dict | None,
    peers: int,
    seed: int,
    steps_per_peer: int,
    overrides: list[str],
    global_batch_tokens: int,
) -> dict:
    """One simulated run in a worker process (1 torch thread); its final validation bpb."""
    torch.set_num_threads(1)
    base, _ = load_config(Path(config))
    base = apply_overrides(base, overrides)
    if config not in _CORPUS:
        _CORPUS[config] = load_corpus(base.data)
    h = outer["inner_steps"] if outer else base.sync.inner_steps
    rounds = steps_per_peer // h
    base = base.replace(sync={"inner_steps": h})
    if outer and outer["algorithm"] == "noloco":
        base = base.replace(noloco={k: outer[k] for k in ("lr", "momentum", "pull")})
    elif outer:
        base = base.replace(outer_optimizer={k: outer[k] for k in ("lr", "momentum", "nesterov")})
    m = manifest_for(
        base, "data-parallel" if outer is None else outer["algorithm"], peers, seed, global_batch_tokens, rounds
    )
    if outer is None:  # the ceiling: no round, one model on every peer's batches (lab/data_parallel.py)
        r = run_data_parallel(m, _CORPUS[config], peers=peers, rounds=rounds, seed=seed, eval_every_rounds=rounds)
    else:  # the round loop a peer runs (lab/engine_sim.py)
        r = run_engine_simulation(
            m, _CORPUS[config], peers=peers, rounds=rounds, seed=seed, eval_every_rounds=rounds, pinned=True
        )
    return {
        "outer": outer,
        "peers": peers,
        "seed": seed,
        "final_bpb": r.history[-1].loss_bpb,
        "tokens": r.history[-1].tokens,
        "params": r.parameters,
        "wall_s": r.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).with_name("compare.toml")))
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--settings",
        nargs="*",
        default=DEFAULT_SETTINGS,
        help="KIND:LR:MOMENTUM[:H] each; none (a bare --settings) runs only the data-parallel baseline",
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one torch thread each")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field for every run, baseline included (TOML value)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the data-parallel runs")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="TOKENS",
        help="override bench.global_batch_tokens of the config (tokens per inner step, all peers)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "sweep-outer.json")
    args = parser.parse_args()
    base, bench = load_config(Path(args.config))
    try:  # each worker applies the overrides again; checked here so that a bad one ends the sweep in one line
        corpus_or_exit(parser, apply_overrides(base, args.set).data, args.config)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    if args.global_batch is not None:
        bench["global_batch_tokens"] = args.global_batch
    try:
        check_global_batch(base, bench["global_batch_tokens"], args.peers, bench["rounds"])
    except ValueError as exc:
        parser.error(f"{exc}; {GLOBAL_BATCH_HINT}")
    steps_per_peer = bench["rounds"] * base.sync.inner_steps
    outers = [
        *([] if args.no_baseline else [None]),
        *(parse_setting(s, base.sync.inner_steps, steps_per_peer) for s in args.settings),
    ]
    if not outers:
        parser.error("--no-baseline with no --settings leaves nothing to run")
    jobs = [(outer, peers, seed) for peers in args.peers for outer in outers for seed in args.seeds]
    start = time.perf_counter()
    runs = []
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = [
            pool.submit(one_run, args.config, o, p, s, steps_per_peer, args.set, bench["global_batch_tokens"])
            for o, p, s in jobs
        ]
        for f in concurrent.futures.as_completed(futures):
            run = f.result()
            runs.append(run)
            print(
                f"{label(run['outer'])} | N {run['peers']} | seed {run['seed']} | {run['final_bpb']:.4f} bpb | "
                f"{run['wall_s']:.0f} s",
                flush=True,
            )

    results = []
    for peers in args.peers:
        for outer in outers:
            mine = sorted((r for r in runs if r["peers"] == peers and r["outer"] == outer), key=lambda r: r["seed"])
            results.append(
                {
                    "method": "data-parallel" if outer is None else outer["algorithm"],
                    "peers": peers,
                    "seeds": [r["seed"] for r in mine],
                    "final_bpb": statistics.fmean(r["final_bpb"] for r in mine),
                    "final_bpb_per_seed": [r["final_bpb"] for r in mine],
                    "outer": outer or {},
                }
            )
    dp = {r["peers"]: r["final_bpb"] for r in results if r["method"] == "data-parallel"}
    for r in results:
        r["vs_data_parallel_pct"] = 100 * (r["final_bpb"] / dp[r["peers"]] - 1) if r["peers"] in dp else None
    print("\n| setting | N | final bpb (mean) | per seed | vs data-parallel |\n|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["peers"], r["final_bpb"])):
        print(
            f"| {label(r['outer'] or None)} | {r['peers']} | {r['final_bpb']:.4f} | "
            f"{' / '.join(f'{x:.4f}' for x in r['final_bpb_per_seed'])} | "
            f"{'—' if r['vs_data_parallel_pct'] is None else format(r['vs_data_parallel_pct'], '+.1f') + ' %'} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "scale": "cpu",
                "device": f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores), torch "
                f"{torch.__version__}, {args.jobs} runs at once, 1 thread each",
                "params": runs[0]["params"],
                "tokens_per_run": runs[0]["tokens"],
                "command": " ".join(["python", *sys.argv]),
                "overrides": args.set,
                "global_batch_tokens": bench["global_batch_tokens"],
                "wall_s": time.perf_counter() - start,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
