"""Writes docs/results.md from bench/results/*.json: per benchmark what it measures, the command,
the device, its table, and a plot (docs/img/) where a curve says more than a table.

    python bench/results_doc.py [--results bench/results] [--out docs/results.md] [--img docs/img]

Each benchmark is one entry of :data:`REGISTRY`, keyed by its result file's name: a title, what it
measures, the command that reproduces it (the file's own ``command`` key wins when it has one), the
device (else the file's ``device`` key) and which rows and keys make its table. A result file with
no entry is still listed, with a generic table of its rows, so nothing is silently dropped. Adding
a benchmark is an entry here and a rerun of this script.

Raises:
    KeyError: an entry names rows or keys its file lacks (the message names the file and key).
    json.JSONDecodeError: a result file does not parse.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class Table:
    """One markdown table of a result file."""

    rows: Callable[[dict], list[Row]]
    """The file's rows (each a dict)."""
    columns: Sequence[tuple[str, str]]
    """(key in a row, column heading)."""
    caption: str = ""


@dataclass(frozen=True)
class Entry:
    """What docs/results.md says about one result file."""

    title: str
    measures: str
    command: str
    tables: Sequence[Table]
    device: str = ""
    """Empty: the file's ``device`` key."""
    plot: Callable[[dict, Path], Path] | None = None
    """Draws the figure into the given folder and returns its path."""
    extra: Sequence[str] = field(default_factory=tuple)
    """Further result files this entry covers (listed, not tabled)."""


def key(name: str) -> Callable[[dict], list[Row]]:
    """Rows under top-level ``name``."""
    return lambda d: list(d[name])


def flat(d: dict) -> list[Row]:
    """A flat record as (key, value) rows, nested dicts written inline."""
    return [{"key": k, "value": v} for k, v in d.items() if not isinstance(v, list)]


def codec_rows(d: dict) -> list[Row]:
    return [{"input": name, **r} for name, rows in d["inputs"].items() for r in rows]


def round_end_rows(d: dict) -> list[Row]:
    return [{"host_allocator": run["host_allocator"], **p} for run in d["runs"] for p in run["parts"]]


def adoption_rows(d: dict) -> list[Row]:
    return [{"seed": run["seed"], **r} for run in d["runs"] for r in run["rows"] if r["round"] % 10 == 0]


def eager_outer_rows(d: dict) -> list[Row]:
    return [{"outer": run["outer_optimizer"], **q} for run in d["runs"] for q in run["quality"]]


def from_round_rows(d: dict) -> list[Row]:
    return [{"command": b["command"], **q} for b in d["batches"] for q in b["quality"]]


def sweep_best(d: dict) -> list[Row]:
    """The best setting per (method, peers), then the data-parallel rows."""
    best: dict[tuple, Row] = {}
    for r in d["results"]:
        k = (r["method"], r["peers"])
        if k not in best or r["final_bpb"] < best[k]["final_bpb"]:
            best[k] = r
    return sorted(best.values(), key=lambda r: (r["peers"], r["final_bpb"]))


def gpu_fit_rows(d: dict) -> list[Row]:
    out = []
    for r in d["results"]:
        row = dict(r)
        for card, fit in r["fit"].items():
            row[f"{card} GiB"] = f"{fit['micro_batch']} ({fit['micro_batch_ckpt']})"
        out.append(row)
    return out


def plot_curves(d: dict, folder: Path) -> Path:
    """Validation bits per byte against tokens per peer (seed means) of a compare-gpu-proxy file: per
    tokenizer and method, the row with the lowest final loss among the longest runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, tokenizer in zip(axes, ("bpe", "bytes"), strict=True):
        lines = []
        for r in d["results"]:
            seeds = list((r.get("curves") or {}).values())
            if r.get("tokenizer") != tokenizer or not seeds or "not committed" in r["label"]:
                continue
            points = min(len(s) for s in seeds)
            xs = [seeds[0][i][1] for i in range(points)]
            ys = [sum(s[i][2] for s in seeds) / len(seeds) for i in range(points)]
            lines.append((r["method"], f"{r['method']}, {r['peers']} peers", xs, ys))
        longest = max((xs[-1] for _, _, xs, _ in lines), default=0)
        best: dict[str, tuple] = {}
        for method, label, xs, ys in lines:
            if xs[-1] == longest and (method not in best or ys[-1] < best[method][3][-1]):
                best[method] = (method, label, xs, ys)
        for _, label, xs, ys in best.values():
            ax.plot(xs, ys, label=label, linewidth=1.5)
        ax.set_title(f"{tokenizer} tokenizer")
        ax.set_xlabel("tokens per peer")
        ax.set_ylabel("validation bits per byte (seed mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = folder / "compare-gpu-proxy.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_utilization(d: dict, folder: Path) -> Path:
    """Swarm tokens/s of each overlap mode against the uplink, on the rig."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in d["results"]:
        if r.get("host_allocator") != "system" or r.get("checkpoint_every_s"):
            continue
        series.setdefault((r["overlap"], r["peers"]), []).append((r["uplink_mbit"], r["tokens_per_s"]))
    for (mode, peers), points in sorted(series.items()):
        points = sorted(dict(points).items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{mode}, {peers} peers")
    ax.set_xscale("log")
    ax.set_xlabel("uplink per peer (Mbit/s)")
    ax.set_ylabel("swarm tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = folder / "overlap-utilization.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


COMPARE_COLUMNS = [
    ("method", "method"),
    ("peers", "peers"),
    ("seeds", "seeds"),
    ("final_bpb", "final bits/byte"),
    ("vs_data_parallel_pct", "vs data-parallel (%)"),
    ("outer", "outer optimizer"),
]
COMPARE_MEASURES = (
    "Validation bits per byte at equal tokens of DiLoCo, NoLoCo and independent peers against "
    "data-parallel training on the same tokens (in-process simulation: the swarm's own outer "
    "algorithms, group plan and codecs; lower is better)."
)
OVERLAP_QUALITY = Table(
    key("quality"),
    [
        ("overlap", "overlap"),
        ("method", "method"),
        ("peers", "peers"),
        ("final_bpb", "final bits/byte"),
        ("vs_none", "vs blocking (%)"),
        ("tokens_per_run", "tokens"),
    ],
    "validation loss at equal tokens",
)
OVERLAP_VARIANTS = {
    "overlap_alpha": "streaming's mixing weight α",
    "overlap_codec_fp4": "overlap with the fp4 codec",
    "overlap_codec_int8": "overlap with the int8 codec",
    "overlap_cpu32k": "the cpu-32k scale",
    "overlap_cpu32k_from8": "the cpu-32k scale, overlap from round 8",
    "overlap_cpu32k_muon": "the cpu-32k scale with Muon",
    "overlap_cpu32k_p1": "the cpu-32k scale, one streaming fragment",
    "overlap_cpu32k_rounds160": "the cpu-32k scale, 160 rounds",
    "overlap_cpu32k_shift": "the cpu-32k scale, the 'shift' merge",
    "overlap_muon": "with Muon",
    "overlap_rounds192": "192 rounds",
    "overlap_rounds384": "384 rounds",
    "overlap_rounds48": "48 rounds",
    "overlap_rounds96": "96 rounds",
    "overlap_rounds96_from1": "96 rounds, overlap from round 1",
    "overlap_shift": "the 'shift' merge",
}

REGISTRY: dict[str, Entry] = {
    "gpu": Entry(
        "The inner loop on a GPU",
        "Tokens/s, model FLOPs utilisation and peak memory of a peer's inner loop per preset, and its "
        "speed as a share of a bare PyTorch loop on the same model, batches and precision.",
        "python bench/gpu.py --presets llama-125m,default",
        [
            Table(
                key("results"),
                [
                    ("preset", "preset"),
                    ("params", "parameters"),
                    ("precision", "precision"),
                    ("micro_batch", "micro-batch"),
                    ("tokens_per_s", "tokens/s"),
                    ("mfu", "MFU"),
                    ("peak_memory_gib", "peak GiB"),
                    ("inner_vs_bare", "vs bare loop"),
                ],
            )
        ],
    ),
    "gpu_fit": Entry(
        "Which preset fits an 8, 12 or 24 GiB card (computed)",
        "The largest micro-batch (sequences of 1,024 tokens) per preset and card, from the peer's own "
        "memory estimate (peer/train/device.py training_memory_bytes) within the start-up probe's 90 %; "
        "with --activation-checkpointing in brackets. Computed, not measured; the check rows set it "
        "against the measured H200 figure.",
        "python bench/gpu_fit.py",
        [
            Table(
                gpu_fit_rows,
                [
                    ("preset", "preset"),
                    ("params", "parameters"),
                    ("states_gib", "states GiB"),
                    ("activations_gib_per_seq", "GiB per sequence"),
                    ("8 GiB", "8 GiB"),
                    ("12 GiB", "12 GiB"),
                    ("24 GiB", "24 GiB"),
                ],
            ),
            Table(
                key("check"),
                [
                    ("preset", "preset"),
                    ("micro_batch", "micro-batch"),
                    ("measured_gib", "measured GiB"),
                    ("computed_gib", "computed GiB"),
                    ("device", "device"),
                ],
                "the estimate against the measured peak",
            ),
        ],
        device="none (computed)",
    ),
    "compare-cpu": Entry(
        "DiLoCo and NoLoCo against data-parallel: CPU scale",
        COMPARE_MEASURES,
        "python bench/compare.py --jobs 2 --threads 1",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-muon": Entry(
        "DiLoCo and NoLoCo against data-parallel: CPU scale, Muon inner optimizer",
        COMPARE_MEASURES,
        "python bench/compare.py --jobs 2 --threads 1 --set 'inner_optimizer.kind=\"muon\"'",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k": Entry(
        "DiLoCo and NoLoCo against data-parallel: cpu-32k scale (8,192 tokens per peer)",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k-muon": Entry(
        "DiLoCo and NoLoCo against data-parallel: cpu-32k scale, Muon",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1 "
        "--set 'inner_optimizer.kind=\"muon\"'",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k-engine": Entry(
        "cpu-32k rows on the round engine a peer runs",
        "The same comparison with DiLoCo, NoLoCo and independent rows run on N round loops over the "
        "in-process hub (lab/engine_sim.py), the code a peer runs.",
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1",
        [Table(key("results"), [*COMPARE_COLUMNS, ("source", "ran on")])],
    ),
    "compare-cpu-32k-bpe2048": Entry(
        "cpu-32k scale with a 2,048-id BPE",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --methods data-parallel diloco --peers 4 "
        "--set data.vocab_size=2048",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-gpu": Entry(
        "DiLoCo and NoLoCo against data-parallel: GPU scale (partial)",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-gpu.toml --device cuda --jobs 16 --no-compile",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-gpu-proxy": Entry(
        "A CPU proxy of the GPU scale",
        "Validation bits per byte over training of data-parallel and DiLoCo rows at the GPU scale's "
        "shape ratios, shrunk to run on a CPU, with BPE and byte tokenizers (the plot: each method's best "
        "row among the longest runs of committed code, seed means).",
        "python bench/compare.py --config bench/compare-gpu-proxy.toml --jobs 1 --threads 1 --no-plot --peers 4 --seeds 0 1",
        [
            Table(
                key("results"),
                [
                    ("label", "row"),
                    ("tokenizer", "tokenizer"),
                    ("method", "method"),
                    ("peers", "peers"),
                    ("final_bpb", "final bits/byte"),
                    ("finished", "finished"),
                ],
            )
        ],
        plot=plot_curves,
    ),
    "sweep-outer": Entry(
        "Outer optimizer sweep: the defaults",
        "Validation bits per byte at equal tokens of every outer lr × momentum (DiLoCo) and α, β, γ "
        "(NoLoCo) tried; the table shows the best setting per method and peer count.",
        "python bench/sweep_outer.py --peers 4 --seeds 0 1 --jobs 2",
        [
            Table(
                sweep_best,
                [
                    ("method", "method"),
                    ("peers", "peers"),
                    ("outer", "best outer setting"),
                    ("inner_lr", "inner lr"),
                    ("global_batch_tokens", "global batch (tokens)"),
                    ("final_bpb", "final bits/byte"),
                    ("vs_data_parallel_pct", "vs data-parallel (%)"),
                ],
            )
        ],
    ),
    "codecs": Entry(
        "Codecs: ratio, error and speed",
        "Bytes, compression ratio, relative error and encode/decode speed of every pseudo-gradient codec, "
        "on random tensors of the default run's shapes and on a real pseudo-gradient.",
        "python bench/codecs.py --threads 1 --repeats 5",
        [
            Table(
                codec_rows,
                [
                    ("input", "input"),
                    ("codec", "codec"),
                    ("bytes", "bytes"),
                    ("ratio", "ratio"),
                    ("rel_error", "relative error"),
                    ("encode_mb_s", "encode MB/s"),
                    ("decode_mb_s", "decode MB/s"),
                ],
            )
        ],
    ),
    "soak": Entry(
        "Churn soak: 8 peers under a random fault every ~30 s",
        "Loss at equal tokens of a swarm under kill -9, SIGSTOP, link cuts, joins and the bootstrap node "
        "killed, against the same swarm without faults; hangs, NaNs, bad checkpoints and orphan processes.",
        "sudo .venv/bin/python bench/soak.py --peers 8 --rate 50 --minutes 30 --fault-every 30",
        [Table(flat, [("key", "figure"), ("value", "value")])],
        device="2-core CPU, network namespaces with 50 Mbit/s tbf links",
        extra=("soak.detail.json",),
    ),
    "fuzz": Entry(
        "Fuzzing every decoder and handler of what another peer sends",
        "Messages tried, crashes, hangs, memory growth and refusals per decoder and handler.",
        "python bench/fuzz.py",
        [
            Table(
                key("results"),
                [
                    ("target", "target"),
                    ("messages", "messages"),
                    ("crashes", "crashes"),
                    ("hangs", "hangs"),
                    ("memory_growth_mb", "memory growth MB"),
                    ("refused", "refused"),
                ],
            )
        ],
        device="2-core CPU (x86_64)",
    ),
    "byzantine": Entry(
        "Byzantine peers",
        "Change in validation loss and takeovers when malicious peers run each attack, against a clean swarm.",
        "python bench/byzantine.py --seeds 0 1 --attack-seeds 0 1 --jobs 2",
        [
            Table(
                key("results"),
                [
                    ("attack", "attack"),
                    ("malicious", "malicious"),
                    ("peers", "peers"),
                    ("loss_change", "loss change"),
                    ("takeovers", "takeovers"),
                ],
            )
        ],
        extra=("byzantine.detail.json",),
    ),
    "overlap": Entry(
        "Overlapping each sync with the next round",
        "Compute utilization, round and sync time of each overlap mode on the network-namespace rig, and "
        "validation loss at equal tokens against blocking sync (in-process simulation).",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2; "
        "sudo .venv/bin/python bench/overlap_rig.py --peers 8 --rates 100 --inner-steps 40 "
        "--modes none delayed eager streaming",
        [
            Table(
                key("results"),
                [
                    ("overlap", "overlap"),
                    ("peers", "peers"),
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("inner_steps", "H"),
                    ("host_allocator", "allocator"),
                    ("checkpoint_every_s", "checkpoint every s"),
                    ("utilization", "utilization vs no sync"),
                    ("tokens_per_s", "swarm tokens/s"),
                    ("round_s", "round s"),
                    ("sync_s", "sync s"),
                ],
                "utilization on the rig",
            ),
            OVERLAP_QUALITY,
        ],
        plot=plot_utilization,
        extra=("overlap_rig.detail.json",),
    ),
    "overlap_p1": Entry(
        "Streaming with one fragment",
        "Streaming DiLoCo with the whole model as one fragment: rig utilization and loss at equal tokens.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2 --modes none streaming",
        [
            Table(
                key("results"),
                [
                    ("overlap", "overlap"),
                    ("peers", "peers"),
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("compute_utilization", "compute utilization"),
                    ("round_s", "round s"),
                ],
            ),
            OVERLAP_QUALITY,
        ],
        extra=("overlap_p1_rig.detail.json",),
    ),
    **{
        name: Entry(
            f"Overlap at equal tokens: {what}",
            "Validation loss at equal tokens of each overlap mode against blocking sync (in-process simulation).",
            "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --jobs 2",
            [OVERLAP_QUALITY],
        )
        for name, what in OVERLAP_VARIANTS.items()
    },
    "overlap_eager_outer": Entry(
        "Eager overlap with outer momentum",
        "Validation loss at equal tokens of eager overlap against blocking sync, per outer optimizer setting.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2 --modes none eager "
        "--set outer_optimizer.lr=LR --set outer_optimizer.momentum=M --set outer_optimizer.nesterov=true",
        [Table(eager_outer_rows, [("outer", "outer optimizer"), *OVERLAP_QUALITY.columns])],
        device="CPU (x86_64, 2 cores), torch 2.13.0+cpu",
    ),
    "overlap_from_round": Entry(
        "Overlap from round K",
        "Validation loss at equal tokens when rounds 0..K−1 sync blocking and overlap starts at round K.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 24 --jobs 2 "
        "--modes none delayed eager --from-round 8",
        [Table(from_round_rows, [*OVERLAP_QUALITY.columns, ("command", "command")])],
    ),
    "round_end": Entry(
        "The round's end on the training thread",
        "Median milliseconds of each step of a round's end, with glibc's own allocator thresholds and with "
        "the ones a peer sets (LOCOSWARM_HOST_ALLOCATOR).",
        "python bench/round_end.py",
        [
            Table(
                round_end_rows,
                [("host_allocator", "allocator"), ("part", "part"), ("median_ms", "median ms")],
            )
        ],
        device="2-core CPU, 1 thread",
    ),
    "pipeline": Entry(
        "Pipeline stages against the unpipelined swarm",
        "Throughput and validation loss of S stages × R replicas against the unpipelined swarm.",
        "python bench/pipeline.py --methods diloco noloco",
        [
            Table(
                key("results"),
                [
                    ("measured", "measured"),
                    ("stages", "stages"),
                    ("replicas_per_stage", "replicas"),
                    ("routing", "routing"),
                    ("method", "method"),
                    ("tokens_per_s", "tokens/s"),
                    ("final_bpb", "final bits/byte"),
                    ("vs_unpipelined", "vs unpipelined (%)"),
                ],
            )
        ],
        extra=("pipeline_rig.detail.json",),
    ),
    "pipeline_memory": Entry(
        "A model that does not fit one peer trains across stages",
        "Peak memory of the whole model and of each stage under a memory cap.",
        "sudo .venv/bin/python bench/pipeline_memory.py",
        [Table(flat, [("key", "figure"), ("value", "value")])],
    ),
}


def fmt(v: Any) -> str:
    """A table cell: floats to 4 significant figures, dicts as k=v, lists joined."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) or "-"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[Row], columns: Sequence[tuple[str, str]], source: str) -> list[str]:
    """Rows as a markdown table; KeyError naming ``source`` when no row has a column's key."""
    for k, _ in columns:
        if rows and not any(k in r for r in rows):
            raise KeyError(f"{source}: no row has key {k!r}")
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return lines


def generic(name: str, d: Any) -> list[str]:
    """A result file without a registry entry: its top-level keys, and its first list of rows."""
    lines = [f"### {name}", "", f"`bench/results/{name}.json`, no entry in bench/results_doc.py's registry yet."]
    if not isinstance(d, dict):
        return [*lines, ""]
    scalars = {k: v for k, v in d.items() if not isinstance(v, list | dict)}
    if "device" in d:
        lines.append(f"Device: {fmt(d['device'])}.")
    if "command" in d:
        lines.append(f"Command: `{d['command']}`")
    lines.append("")
    for k, v in d.items():
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            cols = [c for c in v[0] if not isinstance(v[0][c], list | dict)][:8]
            lines += [f"{k}:", "", *markdown_table(v[:30], [(c, c) for c in cols], name)]
            if len(v) > 30:
                lines.append(f"\n({len(v) - 30} more rows in the file)")
            break
    else:
        if scalars:
            lines += markdown_table(flat(scalars), [("key", "figure"), ("value", "value")], name)
    return [*lines, ""]


def render(results: Path, img: Path, doc_dir: Path) -> str:
    """docs/results.md's text from every ``results/*.json``; plots written under ``img``."""
    files = {p.name.removesuffix(".json"): p for p in sorted(results.glob("*.json"))}
    covered = {e.removesuffix(".json") for entry in REGISTRY.values() for e in entry.extra}
    out = [
        "# Benchmark results",
        "",
        "Generated by `python bench/results_doc.py` from `bench/results/*.json`; do not edit by hand.",
        "Each section: what the benchmark measures, the command that reproduces it, the device it ran on",
        "and its table. How to run the benchmarks: docs/benchmarks.md; how each figure was reached,",
        "run by run: docs/notes/benchmarks-log.md.",
        "",
    ]
    for name, entry in REGISTRY.items():
        if name not in files:
            continue
        d = json.loads(files[name].read_text())
        command = d.get("command") if isinstance(d.get("command"), str) else entry.command
        device = entry.device or fmt(d.get("device") or d.get("results_device") or "not recorded")
        out += [f"## {entry.title}", "", entry.measures, "", f"Command: `{command}`", "", f"Device: {device}.", ""]
        for table in entry.tables:
            if table.caption:
                out += [f"{table.caption[0].upper()}{table.caption[1:]}:", ""]
            out += [*markdown_table(table.rows(d), table.columns, files[name].name), ""]
        if entry.plot is not None:
            img.mkdir(parents=True, exist_ok=True)
            path = entry.plot(d, img)
            out += [f"![{entry.title}]({path.relative_to(doc_dir).as_posix()})", ""]
        more = list(entry.extra)
        out += [f"Source: `bench/results/{name}.json`" + (", " + ", ".join(f"`{e}`" for e in more) if more else ""), ""]
    rest = [n for n in files if n not in REGISTRY and n not in covered]
    if rest:
        out += ["## Other results", "", "Result files with no registry entry, listed as they are.", ""]
        for name in rest:
            out += generic(name, json.loads(files[name].read_text()))
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write docs/results.md from bench/results/*.json.")
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--out", type=Path, default=Path("docs/results.md"))
    ap.add_argument("--img", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    text = render(args.results, args.img, args.out.parent)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
