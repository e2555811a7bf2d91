"""Benchmark: data-parallel vs DiLoCo vs NoLoCo vs independent peers, at equal tokens.

    python bench/compare.py [--config bench/compare.toml] [--out-dir docs] [--threads 1] [--jobs 2]
    python bench/compare.py --peers 4 --seeds 0 --methods diloco --set outer_optimizer.momentum=0.0 \
        --out-dir /tmp/diag --results /tmp/diag/compare.json   # a diagnostic run; bench/results/ untouched
    python bench/compare.py --config bench/compare-gpu.toml --device cuda --jobs 16   # the GPU scale
    python bench/compare.py --no-plot ...     # where matplotlib is not installed: no compare_loss.png
    python bench/compare.py --global-batch 65536 ...  # another global batch (tokens per inner step, all peers)

Runs N peers in one process for every method, N in ``bench.peers`` and seed in ``bench.seeds``:
DiLoCo, NoLoCo and independent peers as N real round loops (``peer.round.Trainer``, the code a peer
runs) over the in-process transport (lab/engine_sim.py, its timing pinned to the lockstep: where an
overlapped mean lands does not follow the threads), with every codec and schedule (the hub encodes
and screens each piece as the wire does); data-parallel, which has no round loop, as one model on
every peer's batches (lab/data_parallel.py). All at a fixed global batch: each peer's
batch is ``global_batch_tokens / N``, so every run trains on the same number of tokens. Prints a
table and a mean-over-seeds summary, writes ``compare_results.json`` (every curve) and
``compare_loss.png`` (validation loss vs tokens) to the output directory, and the finals to
``bench/results/compare-<bench.scale>.json`` or ``--results PATH`` (rewritten as each run ends, so a run cut short keeps
the finished ones), and appends every evaluation of every run as it is made to
``compare_progress.jsonl`` in the output directory (one JSON object a line: method, peers, seed and
the evaluation point), so a run stopped before it ends keeps its curve so far. SIGTERM or Ctrl-C
ends the workers too. ``--jobs`` runs that many simulations at once, each with ``--threads`` torch
threads. ``--device cuda`` trains every simulation's replicas on the card (the precision the card
gets in ``peer join``, bf16 on compute capability >= 8.0; torch.compile on, as ``peer join`` has it
on CUDA, unless ``--no-compile``); φ, the outer steps
and the means stay fp32 on the host. Simulations at once then share the one card.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ is repo tooling, not installed
from bench.provenance import git_commit
from lab.data_parallel import DataParallelResult, run_data_parallel
from lab.engine_sim import EngineResult, run_engine_simulation
from lab.sim_results import EvalPoint, SimulationResult
from peer.train.data import Corpus, load_corpus
from peer.train.device import place
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import RunManifest, from_dict
from protocol.specs import DataSpec

LABELS = {
    "data-parallel": "data-parallel (the inner optimizer on the all-reduced gradient, every step)",
    "diloco": "DiLoCo (outer SGD as in the manifest)",
    "noloco": "NoLoCo (outer heavy-ball + pull as in the manifest)",
    "independent": "independent (never syncs)",
}


def load_config(path: Path) -> tuple[RunManifest, dict]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    bench = data.pop("bench")
    return from_dict(data), bench


def apply_overrides(base: RunManifest, items: list[str]) -> RunManifest:
    """Apply ``--set SECTION.FIELD=VALUE`` overrides (VALUE in TOML syntax) to a manifest.

    All overrides are applied in one replace, so fields that are only valid together (e.g.
    ``data.tokenizer="bpe"`` with ``data.vocab_size=2048``) can be set in any order; a later
    override of the same field wins.

    Raises:
        ValueError: an item not of the form SECTION.FIELD=VALUE or whose VALUE is not TOML (a
            string needs quotes), naming the item.
        ManifestError: a value the manifest refuses, naming the field.
    """
    sections: dict[str, dict] = {}
    for item in items:
        key, equals, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not (equals and dot and section and name and value.strip()):
            raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. --set sync.fragments=2")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError(
                f"--set {item!r}: {value!r} is not a TOML value; a string needs quotes, "
                f"e.g. --set '{key.strip()}=\"{value.strip()}\"'"
            ) from None
        sections.setdefault(section, {})[name] = parsed
    return base.replace(**sections) if sections else base


def manifest_for(
    base: RunManifest, method: str, peers: int, seed: int, global_batch_tokens: int, rounds: int
) -> RunManifest:
    """The run manifest of one benchmark run: fixed global batch, seed-dependent φ_0, and the
    cosine schedule ending with the run (decay_steps = H × rounds)."""
    per_peer = global_batch_tokens // peers
    if per_peer * peers != global_batch_tokens:
        raise ValueError(f"global_batch_tokens = {global_batch_tokens} is not divisible by {peers} peers")
    algorithm = "diloco" if method == "data-parallel" else method
    return base.replace(
        sync={"algorithm": algorithm},
        model={"init_seed": seed},
        inner_optimizer={"batch_size_tokens": per_peer, "decay_steps": base.sync.inner_steps * rounds},
    )


def corpus_or_exit(parser: argparse.ArgumentParser, data: DataSpec, config: Path | str) -> Corpus:
    """Load a bench script's corpus in its main process, or end it in one line.

    Every bench script that trains calls this before it starts any run: a corpus path that is not
    there (a GPU-scale config before ``bench/linux_doc_corpus.py`` ran), an empty folder or a file
    that is not text then ends the script with the :class:`ConfigError`'s message, the config it
    came from and the sysexits code 78, not a traceback from every worker. The token cache this
    load leaves on disk is what the workers then read.

    Returns:
        the :class:`Corpus` of ``data``.

    Raises:
        SystemExit: code 78 (``parser.exit``) on the corpus's :class:`ConfigError`; nothing written.
    """
    try:
        return load_corpus(data)
    except ConfigError as exc:
        parser.exit(
            ConfigError.exit_code, f"{parser.prog}: {exc} (the header of {config} says how its corpus is made)\n"
        )


GLOBAL_BATCH_HINT = (
    "give --global-batch (or bench.global_batch_tokens) a positive multiple of every --peers "
    "value, each peer's share a whole number of sequences"
)


def check_global_batch(base: RunManifest, global_batch_tokens: int, peer_counts: list[int], rounds: int) -> None:
    """Each run's batch rule (:func:`manifest_for`) for every N, checked before any run starts.

    Raises:
        ValueError: N below 1, a global batch below 1 token, one not divisible by N, or a per-peer
            share the manifest refuses (not a whole number of sequences), naming the value.
    """
    for n in peer_counts:
        if n < 1:
            raise ValueError(f"--peers {n}: need at least one peer")
        if global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens = {global_batch_tokens} with {n} peers: both must be positive")
        try:
            manifest_for(base, "diloco", n, 0, global_batch_tokens, rounds)
        except ManifestError as exc:
            raise ValueError(str(exc)) from None


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def row(r: SimulationResult) -> list[str]:
    h = r.history[-1]
    return [
        r.method,
        str(r.peers),
        str(r.seed),
        f"{h.loss_bpb:.4f}",
        fmt(h.replica_mean_bpb, ".4f"),
        fmt(h.averaged_bpb if r.method in ("noloco", "independent") else None, ".4f"),
        f"{h.sigma:.2e}",
        f"{r.bytes_sent_per_peer / 1e6:.1f}",
        f"{r.wall_s:.0f}",
    ]


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print()


def summarize(results: list[SimulationResult]) -> list[dict]:
    """Means over seeds per (method, N)."""
    out = []
    keys = sorted({(r.peers, r.method) for r in results}, key=lambda k: (k[0], list(LABELS).index(k[1])))
    for peers, method in keys:
        rs = [r for r in results if r.peers == peers and r.method == method]

        def mean(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        out.append(
            {
                "method": method,
                "peers": peers,
                "seeds": len(rs),
                "loss_bpb": mean([r.history[-1].loss_bpb for r in rs]),
                "loss_bpb_seed_range": max(r.history[-1].loss_bpb for r in rs)
                - min(r.history[-1].loss_bpb for r in rs),
                "replica_mean_bpb": mean([r.history[-1].replica_mean_bpb for r in rs]),
                "averaged_bpb": mean([r.history[-1].averaged_bpb for r in rs]),
                "sigma": mean([r.history[-1].sigma for r in rs]),
                "mb_sent_per_peer": mean([r.bytes_sent_per_peer / 1e6 for r in rs]),
                "wall_s": mean([r.wall_s for r in rs]),
            }
        )
    dp = {s["peers"]: s["loss_bpb"] for s in out if s["method"] == "data-parallel"}
    for s in out:
        s["vs_data_parallel_pct"] = 100 * (s["loss_bpb"] / dp[s["peers"]] - 1) if s["peers"] in dp else None
    return out


def plot(results: list[SimulationResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peer_counts = sorted({r.peers for r in results})
    fig, axes = plt.subplots(1, len(peer_counts), figsize=(6 * len(peer_counts), 4.5), sharey=True, squeeze=False)
    finals = [r.history[-1].loss_bpb for r in results]
    for ax, peers in zip(axes[0], peer_counts):
        for i, method in enumerate(LABELS):
            rs = [r for r in results if r.peers == peers and r.method == method]
            if not rs:
                continue
            tokens = [h.tokens / 1e6 for h in rs[0].history]
            loss = [statistics.fmean(r.history[k].loss_bpb for r in rs) for k in range(len(tokens))]
            ax.plot(tokens, loss, color=f"C{i}", label=LABELS[method])
            if method == "noloco":
                avg = [statistics.fmean(r.history[k].averaged_bpb for r in rs) for k in range(len(tokens))]
                ax.plot(tokens, avg, color=f"C{i}", linestyle="--", label="NoLoCo, averaged weights φ̄")
        ax.set_title(f"N = {peers} peers (fixed global batch)")
        ax.set_xlabel("training tokens, all peers (millions)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (bits per byte), mean over seeds")
    axes[0][0].set_ylim(min(finals) - 0.1, min(finals) + 1.5)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def outer_of(m: RunManifest, method: str) -> dict:
    """The outer optimizer of one method, named exactly (issue #15: Nesterov or heavy-ball, lr, μ)."""
    if method == "diloco":
        o = m.outer_optimizer
        return {
            "kind": "Nesterov" if o.nesterov else "heavy-ball",
            "lr": o.lr,
            "momentum": o.momentum,
            "inner_steps": m.sync.inner_steps,
        }
    if method == "noloco":
        n = m.noloco
        return {
            "kind": "heavy-ball + pull",
            "lr": n.lr,
            "momentum": n.momentum,
            "pull": n.pull,
            "group_size": n.group_size,
            "inner_steps": m.sync.inner_steps,
        }
    return {}


def results_record(
    results: list[SimulationResult], scale: str, base: RunManifest, device: str, commit: str = "unknown"
) -> dict:
    """bench/results/compare-<scale>.json: one entry per (method, N), finals per seed; the commit the
    runs started at and the command."""
    out = []
    for s in summarize(results):
        rs = sorted((r for r in results if r.peers == s["peers"] and r.method == s["method"]), key=lambda r: r.seed)
        out.append(
            {
                "method": s["method"],
                "peers": s["peers"],
                "seeds": [r.seed for r in rs],
                "source": source_of(rs),
                "final_bpb": s["loss_bpb"],
                "final_bpb_per_seed": [r.history[-1].loss_bpb for r in rs],
                "vs_data_parallel_pct": s["vs_data_parallel_pct"],
                "outer": outer_of(base, s["method"]),
            }
        )
    spec = base.inner_optimizer
    inner = {"kind": spec.kind, "lr": spec.lr}
    if spec.kind == "muon":
        inner["muon_lr_ratio"] = spec.muon_lr_ratio
    return {
        "scale": scale,
        "commit": commit,
        "command": " ".join(["python", *sys.argv]),
        "device": device,
        "params": results[0].parameters,
        "tokens_per_run": results[0].history[-1].tokens,
        "inner": inner,
        "results": out,
    }


def _progress(path: Path, method: str, peers: int, seed: int, point: EvalPoint) -> None:
    """Append one evaluation to ``path`` as a JSON line (one short write: lines of workers don't mix)."""
    line = json.dumps({"method": method, "peers": peers, "seed": seed, **point.__dict__}) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def source_of(results: list[SimulationResult]) -> str:
    """What a row's runs ran on: ``engine`` (lab/engine_sim.py) or ``one model`` (the data-parallel
    loop, lab/data_parallel.py); ``mixed`` where they differ."""
    if all(isinstance(r, EngineResult) for r in results):
        return "engine"
    if all(isinstance(r, DataParallelResult) for r in results):
        return "one model"
    return "mixed"


def _one(
    base: RunManifest,
    method: str,
    peers: int,
    seed: int,
    bench: dict,
    rounds: int,
    threads: int,
    corpus=None,
    device: str = "cpu",
    progress: Path | None = None,
    compile: bool | None = None,
) -> SimulationResult:
    torch.set_num_threads(threads)
    # many simulations compile at once: one compile thread each (inductor's default is one per core)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    placement, _ = place(device, compile=compile)
    m = manifest_for(base, method, peers, seed, bench["global_batch_tokens"], rounds)
    on_eval = None if progress is None else functools.partial(_progress, progress, method, peers, seed)
    corpus = corpus if corpus is not None else load_corpus(base.data)
    run = dict(peers=peers, rounds=rounds, seed=seed, eval_every_rounds=bench["eval_every_rounds"], on_eval=on_eval)
    if method == "data-parallel":  # no round: one model on every peer's batches
        where = dict(device=placement.device, precision=placement.precision, compile=placement.compile)
        return run_data_parallel(m, corpus, **run, **where)
    return run_engine_simulation(m, corpus, placement=placement, pinned=True, **run)


def _one_of(task: tuple) -> SimulationResult:
    return _one(*task)


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per simulation")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (separate processes)")
    parser.add_argument("--device", default="cpu", help="where the replicas train: cpu, cuda, cuda:N, auto")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the replicas (default: on CUDA, as peer join)",
    )
    parser.add_argument("--rounds", type=int, help="override bench.rounds (quick trials)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override bench.seeds")
    parser.add_argument("--peers", type=int, nargs="+", help="override bench.peers")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="TOKENS",
        help="override bench.global_batch_tokens (tokens per inner step, all peers together)",
    )
    parser.add_argument("--methods", nargs="+", choices=list(LABELS), help="override bench.methods")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field (TOML value), e.g. --set outer_optimizer.lr=1.0",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="PATH",
        help="where the finals go (default bench/results/compare-<bench.scale>.json, the recorded "
        "results: give trials their own path)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip compare_loss.png (no matplotlib needed)")
    args = parser.parse_args()
    if not args.no_plot:  # the plot is drawn after every run: a missing matplotlib must stop us before them
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "matplotlib is not installed, and the loss plot at the end needs it: "
                "pip install -e '.[bench]', or pass --no-plot"
            )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)

    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    if args.global_batch is not None:
        bench["global_batch_tokens"] = args.global_batch
    rounds = args.rounds or bench["rounds"]
    seeds, peer_counts = args.seeds or bench["seeds"], args.peers or bench["peers"]
    methods = args.methods or bench["methods"]
    try:
        check_global_batch(base, bench["global_batch_tokens"], peer_counts, rounds)
    except ValueError as exc:
        parser.error(f"{exc}; {GLOBAL_BATCH_HINT}")
    start, commit = time.perf_counter(), git_commit(Path(__file__).resolve().parents[1])  # the code the runs use
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out_dir / "compare_results.json", args.out_dir / "compare_loss.png"
    progress = args.out_dir / "compare_progress.jsonl"
    progress.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, _stop)  # `timeout` and kill: end the workers too (the finally below)
    scale = bench.get("scale", "cpu")
    placement, _ = place(args.device, compile=args.compile)
    if placement.device.type == "cuda":
        device = (
            f"{placement.info.name} ({placement.precision.name} autocast, "
            f"{'compiled' if placement.compile else 'eager'}), torch {torch.__version__}, "
            f"{args.jobs} simulation(s) at once sharing the card"
        )
    else:
        device = (
            f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores), torch {torch.__version__}, "
            f"{args.jobs} simulation(s) at once, {args.threads} thread(s) each"
        )
    corpus = corpus_or_exit(parser, base.data, args.config)
    final = args.results or Path(__file__).with_name("results") / f"compare-{scale}.json"
    final.parent.mkdir(parents=True, exist_ok=True)

    header = ["method", "N", "seed", "val bpb", "replica-mean", "avg weights", "σ", "MB sent/peer", "wall s"]
    results: list[SimulationResult] = []
    work = [(method, peers, seed) for peers in peer_counts for seed in seeds for method in methods]
    if args.jobs > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.jobs)
        done = pool.imap_unordered(
            _one_of,
            [
                (
                    base,
                    method,
                    peers,
                    seed,
                    bench,
                    rounds,
                    args.threads,
                    None,
                    args.device,
                    progress,
                    args.compile,
                )
                for method, peers, seed in work
            ],
        )
    else:
        pool = None
        done = (
            _one(
                base,
                method,
                peers,
                seed,
                bench,
                rounds,
                args.threads,
                corpus,
                args.device,
                progress,
                args.compile,
            )
            for method, peers, seed in work
        )
    try:
        for r in done:
            results.append(r)
            print(" | ".join(row(r)), flush=True)
            record = {
                "command": " ".join(["python", *sys.argv]),
                "config": {
                    **base.to_dict(),
                    "bench": {**bench, "rounds": rounds, "seeds": seeds, "peers": peer_counts, "methods": methods},
                },
                "overrides": args.set,
                "threads": args.threads,
                "tokens_per_run": r.history[-1].tokens,
                "wall_s_total": time.perf_counter() - start,
                "summary": summarize(results),
                "runs": [x.to_dict() for x in results],
            }
            json_path.write_text(json.dumps(record, indent=1) + "\n")  # partial results survive a stop
            final.write_text(json.dumps(results_record(results, scale, base, device, commit), indent=1) + "\n")
    finally:
        if pool is not None:
            pool.terminate()  # a stopped benchmark leaves no worker behind
            pool.join()
    order = {(p, s, m): i for i, (m, p, s) in enumerate(work)}
    results.sort(key=lambda r: order[(r.peers, r.seed, r.method)])

    print()
    print_table(header, [row(r) for r in results])
    summary = summarize(results)
    print(
        "Mean over seeds (val bpb: the one model for data-parallel and DiLoCo, the replica mean for "
        "NoLoCo and independent):"
    )
    print_table(
        ["method", "N", "val bpb", "vs DP", "replica-mean", "avg weights", "σ", "MB sent/peer", "wall s"],
        [
            [
                LABELS[s["method"]],
                str(s["peers"]),
                f"{s['loss_bpb']:.4f}",
                f"{s['vs_data_parallel_pct']:+.1f} %" if s["vs_data_parallel_pct"] is not None else "—",
                fmt(s["replica_mean_bpb"], ".4f"),
                fmt(s["averaged_bpb"] if s["method"] in ("noloco", "independent") else None, ".4f"),
                f"{s['sigma']:.2e}",
                f"{s['mb_sent_per_peer']:.1f}",
                f"{s['wall_s']:.0f}",
            ]
            for s in summary
        ],
    )
    tokens = results[-1].history[-1].tokens
    if not args.no_plot:
        plot(
            results,
            png_path,
            f"{base.model.hidden_size}-wide {base.model.num_layers}-layer Llama "
            f"({results[0].parameters:,} params), H = {base.sync.inner_steps}, {rounds} rounds, "
            f"{tokens / 1e6:.2f}M tokens per run, global batch {bench['global_batch_tokens']} tokens",
        )
    final.write_text(json.dumps(results_record(results, scale, base, device, commit), indent=1) + "\n")
    wrote = f"{json_path}, {final}" + ("" if args.no_plot else f" and {png_path}")
    print(f"wrote {wrote}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as exc:
        sys.exit(
            f"stopped ({exc or 'Ctrl-C'}): the runs that ended are in bench/results and the output directory, "
            "every evaluation so far in compare_progress.jsonl"
        )
