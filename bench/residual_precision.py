"""Benchmark: the loss cost of keeping error-feedback residuals in bf16 (issue #67, item 3).

    python bench/residual_precision.py [--seeds 0 1 2] [--peers 4] [--codec int8] [--jobs 2]
    python bench/residual_precision.py --summarize-only --work-dir DIR   # tables from runs made

Two runs of bench/compare.py at the cpu-32k scale (bench/compare-cpu-32k.toml: 139,968-parameter
Llama, H = 10, 40 rounds, a 32,768-token global step), lossy codec ``--codec`` with error feedback:

1. data-parallel (the ceiling), independent peers (the floor: never averaging) and DiLoCo with the
   residuals in fp32 (``compression.residual_dtype = "fp32"``, the default);
2. DiLoCo with the residuals in bf16 (``compression.residual_dtype = "bf16"``: half their memory).

Every run sees the same tokens; DiLoCo's runs differ only in the residuals' dtype (same seeds,
φ_0, shards and schedule). Prints one table and writes ``--out`` (bench/results/
residual-precision.json): per row its final validation bits per byte (mean and per seed), the bf16
row's change against fp32 per seed and its mean (the goal: at most +0.2 %), and the share of the
floor-to-ceiling gap each DiLoCo row recovers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402

GOAL_PCT = 0.2
"""bf16 residuals may cost at most this much validation loss (%, against fp32 residuals)."""


def compare_command(args: argparse.Namespace, name: str, methods: list[str], dtype: str) -> list[str]:
    work = args.work_dir / name
    return [
        sys.executable,
        str(HERE / "compare.py"),
        "--config",
        str(HERE / "compare-cpu-32k.toml"),
        "--methods",
        *methods,
        "--peers",
        str(args.peers),
        "--seeds",
        *map(str, args.seeds),
        "--set",
        f'compression.codec="{args.codec}"',
        "--set",
        f'compression.residual_dtype="{dtype}"',
        "--results",
        str(work.with_suffix(".json")),
        "--out-dir",
        str(work),
        "--no-plot",
        "--jobs",
        str(args.jobs),
        "--threads",
        "1",
    ]


def finals(path: Path, method: str) -> list[float]:
    """The final validation bits per byte per seed of ``method`` in a compare.py results file."""
    rows = [r for r in json.loads(path.read_text())["results"] if r["method"] == method]
    if len(rows) != 1:
        raise SystemExit(f"{path}: expected one {method!r} row, found {len(rows)}")
    return rows[0]["final_bpb_per_seed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--codec", default="int8", help="a lossy codec (error feedback keeps residuals)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/residual-precision"))
    parser.add_argument("--summarize-only", action="store_true", help="read the runs in --work-dir, run nothing")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "residual-precision.json")
    args = parser.parse_args()
    if len(args.seeds) < 3:
        parser.error(f"--seeds {args.seeds}: a quality table needs 3 seeds or more")
    if args.codec == "none":
        parser.error("--codec none keeps no residuals: name a lossy codec, e.g. int8")
    runs = {
        "fp32": ["data-parallel", "independent", "diloco"],
        "bf16": ["diloco"],
    }
    commands = {name: compare_command(args, name, methods, name) for name, methods in runs.items()}
    if not args.summarize_only:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        for name, cmd in commands.items():
            print(f"running {name}: {' '.join(cmd)}", flush=True)
            (args.work_dir / f"{name}.commit").write_text(git_commit(ROOT) + "\n")  # the code it ran
            subprocess.run(cmd, check=True, cwd=ROOT)
    commits = {}
    for name in runs:
        try:
            commits[name] = (args.work_dir / f"{name}.commit").read_text().strip()
        except OSError:
            parser.error(f"{args.work_dir / name}.commit is missing: the commit its run ran at is not known")
    fp32_path, bf16_path = (args.work_dir / f"{name}.json" for name in runs)
    rows = {
        "data-parallel (ceiling)": finals(fp32_path, "data-parallel"),
        "independent (floor)": finals(fp32_path, "independent"),
        f"DiLoCo, {args.codec}, fp32 residuals": finals(fp32_path, "diloco"),
        f"DiLoCo, {args.codec}, bf16 residuals": finals(bf16_path, "diloco"),
    }
    ceiling, floor, fp32, bf16 = rows.values()
    per_seed = [100 * (b / f - 1) for b, f in zip(bf16, fp32)]
    change = statistics.mean(per_seed)
    gap = statistics.mean(floor) - statistics.mean(ceiling)
    meta = json.loads(fp32_path.read_text())
    record = {
        "commit": commits["bf16"],
        "commits": commits,
        "device": meta["device"],
        "command": f"python bench/residual_precision.py --seeds {' '.join(map(str, args.seeds))} --peers "
        f"{args.peers} --codec {args.codec} --jobs {args.jobs}",
        "scale": "cpu-32k",
        "codec": args.codec,
        "peers": args.peers,
        "seeds": args.seeds,
        "tokens_per_run": meta["tokens_per_run"],
        "rows": [
            {
                "row": name,
                "final_bpb": statistics.mean(v),
                "final_bpb_per_seed": v,
                "gap_recovered_pct": (100 * (statistics.mean(floor) - statistics.mean(v)) / gap if gap > 0 else None),
            }
            for name, v in rows.items()
        ],
        "bf16_vs_fp32_pct": change,
        "bf16_vs_fp32_pct_per_seed": per_seed,
        "goal_pct": GOAL_PCT,
        "met": change <= GOAL_PCT,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\ncpu-32k, N = {args.peers}, seeds {args.seeds}, {record['tokens_per_run']:,} tokens per run\n")
    print("| row | final bits/byte | per seed | share of the floor-to-ceiling gap |")
    print("|---|---|---|---|")
    for r in record["rows"]:
        share = "–" if r["gap_recovered_pct"] is None else f"{r['gap_recovered_pct']:.0f} %"
        seeds = ", ".join(f"{x:.4f}" for x in r["final_bpb_per_seed"])
        print(f"| {r['row']} | {r['final_bpb']:.4f} | {seeds} | {share} |")
    print(
        f"\nbf16 residuals against fp32: {change:+.3f} % (per seed "
        f"{', '.join(f'{x:+.3f}' for x in per_seed)}); goal at most +{GOAL_PCT} %: "
        f"{'met' if record['met'] else 'missed'}\nwrote {args.out}"
    )


if __name__ == "__main__":
    main()
