"""The pieces docs/results.md's registry (bench/results_registry.py) is made of: a table's rows and
columns, an entry per result file, the row pickers for nested result files, and the plots.

A row picker takes a result file's parsed JSON (a dict) and returns its rows (dicts); a plot takes the
parsed file and a folder, draws a PNG there (matplotlib, Agg backend) and returns its path. Neither
writes anything else.
"""

from __future__ import annotations

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
    note: bool = True
    """Print the file's ``results_note`` under its tables (False where the note is about columns the
    entry does not show)."""


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
