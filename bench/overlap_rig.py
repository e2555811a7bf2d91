"""Benchmark: utilization with and without overlapping each sync (issues #18 item 4, #54 item 2).

    sudo nice -n 5 .venv/bin/python bench/overlap_rig.py [--peers 4 8] [--rates 100 20]
        [--modes nosync none delayed eager streaming] [--rounds 8] [--warmup 2] [--inner-steps 150]
        [--fragments 2] [--fragment-delay TAU] [--fragment-merge mix|shift] [--fragment-alpha 0.5]
        [--hidden-size 128] [--checkpoint-every SECONDS]
        [--host-allocator tuned|system] [--standin-step-s SECONDS]

For each (peers, uplink, overlap mode): a bootstrap node and N real peers (``peer join``), each
in its own network namespace behind a tbf uplink of the given rate (lab/chaos.py), train the run
below for ``--rounds`` rounds, started together (``--wait-for-peers N``), with no evaluation
between the first and the last (``--eval-every 0``). Every peer's ``round`` events give, per
round, the seconds its inner steps took (``compute_s``), the sync's wall time (``sync_s``:
matchmaking plus all-reduce; with overlap, the sync that landed, which ran in the background) and
when the round ended.

* ``utilization`` of a swarm (issue #54): its tokens/s ÷ the same peers' tokens/s with the sync
  replaced by nothing, the ``nosync`` mode's run of this invocation (or of an earlier one kept with
  ``--keep``) at the same peers, H, width, allocator and stand-in: one round of ``--rounds`` × H
  steps whose only sync comes after them, its tokens ÷ its steps' seconds. A peer's tokens/s: the
  tokens of its rounds after the first ``--warmup`` that averaged with at least one other peer
  (group size ≥ 2: a round whose sync failed trained alone and counts nothing) ÷ the wall time from
  the event ending round ``--warmup`` to the event ending the last round (start-up, the first
  matchmaking and the last in-flight sync's drain are left out). None without a ``nosync`` run.
  ``averaged_share`` (those rounds' share) and ``mean_group_size`` stand beside it. The earlier ratio, Σ
  ``compute_s`` ÷ wall time, is gone: a sync slowing the steps on shared cores raised it (the
  steps' own seconds grew with the wall time) while the swarm trained no more tokens.
* idle seconds per round, means over peers: ``sync_wait`` (the training thread waited for a sync's
  mean: blocking, the whole sync; with overlap, what a background sync still had to do),
  ``resync_wait`` (the re-sync rule's catch-up after a round: waiting for finishing groupmates'
  records, downloads), ``other`` (the rest: records, snapshots, checkpoint encoding, the outer step).
* ``--standin-step-s S``: every peer runs lab/standin.py's compute stand-in (its inner step a
  wait of S seconds without CPU, as on a card; bench/rig125m.py) instead of the real inner step.
* ``round_s``: that wall time ÷ the rounds in it, mean over peers. ``sync_s``: mean over peers and
  rounds. ``blocking_share`` (detail, table): mean ``sync_s`` ÷ mean ``compute_s``: the issue asks
  for a payload whose blocking sync takes at least a third of a round's compute.

The run: lab/chaos.py's 0.49 M-parameter model (a 1.97 MB fp32 payload, no codec; ``--hidden-size``
widens it, the feed-forward at 3× the width: 256 gives 1.84 M parameters, a 7.35 MB payload, and
rounds about 4× as long at the same sync ÷ compute), 256 tokens per inner step, ``--inner-steps``
H, DiLoCo with the default outer step. Every peer's torch uses one
thread (``--threads 1``); on a machine with fewer cores than peers they share the cores, which
makes ``compute_s`` longer than on an idle core, the ``nosync`` reference's steps included.

Writes the issue's ``results`` rows into bench/results/overlap.json (its ``quality`` rows, from
bench/overlap.py, are kept), every peer's figures to bench/results/overlap_rig.detail.json (beside ``--out``), and
prints a markdown table (docs/results.md: bench/results_doc.py). Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.chaos import CHAOS_MODEL, ChaosSwarm, prepare_rig_bench  # noqa: E402
from lab.standin import StandInConfig  # noqa: E402
from peer.train.host_memory import ENV as HOST_ALLOCATOR_ENV  # noqa: E402
from peer.train.model import spec_parameter_count  # noqa: E402
from protocol.manifest import RunManifest, dump_toml  # noqa: E402
from protocol.presets import tiny_run  # noqa: E402
from protocol.specs import FRAGMENT_MERGES, OVERLAP_MODES  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "overlap.json"
NOSYNC = "nosync"
"""The reference mode: the same peers with the sync replaced by nothing (see the docstring)."""


CHAOS_HIDDEN = CHAOS_MODEL["hidden_size"]


def rig_model(hidden_size: int = CHAOS_HIDDEN) -> dict:
    """lab/chaos.py's model at ``hidden_size`` (feed-forward 3× as wide, the same 2 blocks, 2 heads
    and sequence length): a larger payload, so each sync and round is longer at the same H·tokens.

    Raises:
        ValueError: ``hidden_size`` not a positive multiple of the 2 heads' count.
    """
    heads = CHAOS_MODEL["num_heads"]
    if hidden_size <= 0 or hidden_size % heads:
        raise ValueError(f"hidden_size = {hidden_size}: need a positive multiple of num_heads = {heads}")
    return {**CHAOS_MODEL, "hidden_size": hidden_size, "intermediate_size": 3 * hidden_size}


def rig_manifest(
    mode: str,
    inner_steps: int,
    fragments: int = 2,
    fragment_delay: int = 2,
    hidden_size: int = CHAOS_HIDDEN,
    fragment_merge: str = "mix",
    fragment_alpha: float = 0.5,
) -> RunManifest:
    """The benchmark's run with ``sync.overlap = mode`` (a swarm-wide fact of the manifest); with
    streaming, ``fragments`` P and τ = ``fragment_delay``, the earliest a mean lands (a slower sync
    lands when it arrives: the round events' ``overlap_steps`` say after how many steps), merged by
    ``fragment_merge`` with α = ``fragment_alpha``; the model of :func:`rig_model` at ``hidden_size``."""
    sync = {
        "inner_steps": inner_steps,
        "matchmaking_time_s": 2.0,
        "allreduce_timeout_s": 60.0,
        "next_chunk_timeout_s": 10.0,
        "overlap": mode,
    }
    if mode == "streaming":
        sync.update(
            fragments=fragments,
            fragment_delay_steps=fragment_delay,
            fragment_merge=fragment_merge,
            fragment_alpha=fragment_alpha,
        )
    return tiny_run().replace(
        name=f"overlap-rig-{mode}",
        model=rig_model(hidden_size),
        inner_optimizer={"lr": 3e-3, "warmup_steps": 20, "decay_steps": 20000, "batch_size_tokens": 256},
        sync=sync,
    )


def peer_figures(rounds: list[dict], warmup: int) -> dict:
    """One peer's figures from its ``round`` events (dicts with ``time``, ``compute_s``, ``sync_s``,
    ``tokens``, ``group_size``), in the order printed.

    Raises:
        ValueError: fewer than ``warmup`` + 2 round events (nothing to measure).
    """
    if len(rounds) < warmup + 2:
        raise ValueError(f"{len(rounds)} round event(s): need at least warmup + 2 = {warmup + 2}")
    first = max(warmup, 1)  # no warm-up: from the first event, its own round left out
    start, measured = rounds[first - 1], rounds[first:]
    wall = measured[-1]["time"] - start["time"]
    compute = sum(e["compute_s"] for e in measured)
    averaged = [e for e in measured if e["group_size"] >= 2]
    return {
        "rounds": len(measured),
        # rounds whose sync averaged with at least one other peer, and their tokens over the whole wall
        # time: the utilization counts only these (a sync that failed fast trained alone)
        "averaged_rounds": len(averaged),
        "averaged_tokens_per_s": sum(e["tokens"] for e in averaged) / wall,
        "wall_s": wall,
        "compute_s": compute,
        "round_s": wall / len(measured),
        "sync_s": statistics.fmean(e["sync_s"] for e in measured),
        # of sync_s, the all-reduce itself and this peer's sending (round events since 2026-12-04)
        "allreduce_s": statistics.fmean(e.get("allreduce_s", 0.0) for e in measured),
        "send_s": statistics.fmean(e.get("send_s", 0.0) for e in measured),
        "compute_s_per_round": compute / len(measured),
        # where the rest of the wall time went, per round (round events' sync_wait_s, resync_wait_s)
        "sync_wait_s_per_round": statistics.fmean(e.get("sync_wait_s", 0.0) for e in measured),
        "resync_wait_s_per_round": statistics.fmean(e.get("resync_wait_s", 0.0) for e in measured),
        "other_s_per_round": (
            wall - compute - sum(e.get("sync_wait_s", 0.0) + e.get("resync_wait_s", 0.0) for e in measured)
        )
        / len(measured),
        "tokens_per_s": sum(e["tokens"] for e in measured) / wall,
        "group_sizes": [e["group_size"] for e in measured],
        "overlap_steps": [s for e in measured for s in e.get("overlap_steps", ())],
        "notes": sorted({e.get("note") or "" for e in measured} - {""}),
    }


def run_one(
    workdir: Path,
    *,
    peers: int,
    rate: float,
    mode: str,
    rounds: int,
    warmup: int,
    inner_steps: int,
    timeout_s: float,
    fragments: int = 2,
    fragment_delay: int = 2,
    hidden_size: int = CHAOS_HIDDEN,
    checkpoint_every_s: float = 0.0,
    host_allocator: str = "tuned",
    fragment_merge: str = "mix",
    fragment_alpha: float = 0.5,
    standin_step_s: float | None = None,
) -> dict:
    """One swarm on the rig until every peer stopped at ``rounds``; its figures. ``host_allocator``
    goes to every peer as ``LOCOSWARM_HOST_ALLOCATOR`` (peer/train/host_memory.py). Mode ``nosync``:
    one blocking round of ``rounds`` × ``inner_steps`` steps; its figures are its tokens ÷ its
    steps' seconds. ``standin_step_s``: the peers run lab/standin.py's stand-in of that step time."""
    os.environ[HOST_ALLOCATOR_ENV] = host_allocator  # the peers' processes inherit it
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    nosync = mode == NOSYNC
    manifest = rig_manifest(
        "none" if nosync else mode,
        inner_steps * rounds if nosync else inner_steps,
        fragments,
        fragment_delay,
        hidden_size,
        fragment_merge,
        fragment_alpha,
    )
    entry = None
    if standin_step_s is not None:
        os.environ.update(StandInConfig(step_s=standin_step_s).to_env())
        entry = [sys.executable, str(ROOT / "lab" / "standin.py")]
    run.write_text(dump_toml(manifest))
    started = time.time()
    with ChaosSwarm(
        workdir,
        run,
        rate_mbit=rate,
        prefix="lso",
        subnet="10.213.83",
        peer_args=[
            "--max-rounds",
            str(1 if nosync else rounds),
            "--eval-every",
            "0",
            "--wait-for-peers",
            str(peers),
            "--uplink-mbps",
            str(rate),
            "--checkpoint-every",
            f"{checkpoint_every_s:g}",
        ],
        peer_entry=entry,
    ) as swarm:
        swarm.start_bootstrap()
        for i in range(peers):
            swarm.add_peer(f"p{i}")
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, child in swarm.members.items():
            codes[name] = child.wait(max(1.0, deadline - time.monotonic()))
        events = {name: [dict(e.fields) for e in child.of("round")] for name, child in swarm.members.items()}
        adoptions = {name: len(child.of("adopted_state")) for name, child in swarm.members.items()}
    failed = {n: c for n, c in codes.items() if c != 0}
    if failed:
        raise RuntimeError(f"peers exited with {failed}: see {workdir}/<peer>.log")
    if nosync:
        per_peer = {
            name: {"tokens_per_s": ev[0]["tokens"] / ev[0]["compute_s"], "compute_s": ev[0]["compute_s"]}
            for name, ev in events.items()
        }
    else:
        per_peer = {name: peer_figures(ev, warmup) for name, ev in events.items()}
    out = {
        "overlap": mode,
        "peers": peers,
        "uplink_mbit": rate,
        "inner_steps": inner_steps,
        "hidden_size": hidden_size,
        "payload_mb": payload_mb(manifest),
        "checkpoint_every_s": checkpoint_every_s,
        "host_allocator": host_allocator,
        "standin_step_s": standin_step_s,
        "per_peer": per_peer,
        "adoptions": adoptions,
        "wall_s_total": time.time() - started,
    }
    if mode == "streaming":
        out["streaming"] = {
            k: getattr(manifest.sync, k)
            for k in ("fragments", "fragment_delay_steps", "fragment_alpha", "fragment_merge")
        }
    return out


def payload_mb(manifest: RunManifest) -> float:
    """The fp32 DiLoCo payload of ``manifest``'s model (byte-level tokenizer, as the rig's run), MB
    (10^6 bytes): 4 bytes per parameter."""
    return 4 * spec_parameter_count(manifest.model, 259) / 1e6


CHAOS_PAYLOAD_MB = payload_mb(tiny_run().replace(model=CHAOS_MODEL))


def fragments_of(run: dict) -> int | None:
    """A streaming run's P (runs from before it was recorded streamed with the rig's P = 2); None
    for the other modes."""
    return run.get("streaming", {}).get("fragments", 2) if run["overlap"] == "streaming" else None


def reference_key(run: dict) -> tuple:
    """What a ``nosync`` reference must share with a run: peers, H, width, allocator, stand-in."""
    return (
        run["peers"],
        run["inner_steps"],
        run.get("hidden_size", CHAOS_HIDDEN),
        run.get("host_allocator", "system"),
        run.get("standin_step_s"),
    )


def reference_tokens_per_s(run: dict, runs: list[dict]) -> float | None:
    """The swarm tokens/s of the latest ``nosync`` run in ``runs`` with ``run``'s
    :func:`reference_key`; None if there is none."""
    found = [r for r in runs if r["overlap"] == NOSYNC and reference_key(r) == reference_key(run)]
    return sum(p["tokens_per_s"] for p in found[-1]["per_peer"].values()) if found else None


def averaged_tokens_per_s(figures: dict) -> float:
    """One peer's tokens/s counting only the rounds that averaged with ≥ 1 other peer (``peer_figures``).

    Figures recorded before ``averaged_tokens_per_s`` existed give it only when every measured round
    averaged (then it is their ``tokens_per_s``).

    Raises:
        ValueError: older figures with a round that did not average (rerun the swarm to measure it).
    """
    if "averaged_tokens_per_s" in figures:
        return figures["averaged_tokens_per_s"]
    alone = [g for g in figures["group_sizes"] if g < 2]
    if alone:
        raise ValueError(
            f"{len(alone)} of {len(figures['group_sizes'])} measured round(s) did not average and these figures "
            "predate per-round averaged tokens: rerun the swarm to measure its utilization"
        )
    return figures["tokens_per_s"]


def averaged_figures(per: list[dict]) -> dict:
    """``averaged_tokens_per_s`` (the swarm's, rounds with group size ≥ 2 only), ``averaged_share`` (those
    rounds' share of the peers' measured rounds) and ``mean_group_size`` of a run's measured peers
    (:func:`peer_figures` each).

    Raises:
        ValueError: figures recorded before per-round averaged tokens, with a round that did not average.
    """
    sizes = [g for p in per for g in p["group_sizes"]]
    return {
        "averaged_tokens_per_s": sum(averaged_tokens_per_s(p) for p in per),
        "averaged_share": sum(g >= 2 for g in sizes) / len(sizes),
        "mean_group_size": statistics.fmean(sizes),
    }


def row(run: dict, reference: float | None = None) -> dict:
    """The issue's ``results`` row of one swarm (means over its peers); ``utilization`` its swarm
    tokens/s in rounds that averaged with ≥ 1 other peer ÷ ``reference`` (the ``nosync`` run's swarm
    tokens/s; None: no such run), ``averaged_share`` those rounds' share, ``mean_group_size`` beside it."""
    per = list(run["per_peer"].values())
    tokens_per_s = sum(p["tokens_per_s"] for p in per)
    averaged = averaged_figures(per)
    compute = statistics.fmean(p["compute_s_per_round"] for p in per)
    sync = statistics.fmean(p["sync_s"] for p in per)
    return {
        "overlap": run["overlap"],
        "peers": run["peers"],
        "uplink_mbit": run["uplink_mbit"],
        "inner_steps": run["inner_steps"],
        "payload_mb": run.get("payload_mb", CHAOS_PAYLOAD_MB),
        "fragments": fragments_of(run),
        "checkpoint_every_s": run.get("checkpoint_every_s", 0.0),
        # runs from before peer/train/host_memory.py existed ran with glibc's own thresholds
        "host_allocator": run.get("host_allocator", "system"),
        "standin_step_s": run.get("standin_step_s"),
        "utilization": averaged["averaged_tokens_per_s"] / reference if reference else None,
        "averaged_share": averaged["averaged_share"],
        "reference_tokens_per_s": reference,
        "round_s": statistics.fmean(p["round_s"] for p in per),
        "sync_s": sync,
        "compute_s_per_round": compute,
        "blocking_share": sync / compute,
        **{
            k: statistics.fmean(p.get(k, 0.0) for p in per)
            for k in ("sync_wait_s_per_round", "resync_wait_s_per_round", "other_s_per_round")
        },
        "tokens_per_s": tokens_per_s,
        "mean_group_size": averaged["mean_group_size"],
        "median_overlap_steps": (
            statistics.median(s for p in per for s in p.get("overlap_steps", ()))
            if any(p.get("overlap_steps") for p in per)
            else None
        ),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        (
            "| payload MB | peers | uplink Mbit/s | H | overlap | utilization (vs no sync) | round s | compute s | "
            "sync s | sync ÷ compute | idle s per round: sync wait / re-sync / other | swarm tokens/s | mean group |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = r["overlap"]
        if r.get("fragments") not in (None, 2):  # streaming with another P than the rig's 2 blocks
            mode += f", P = {r['fragments']}"
        if r.get("checkpoint_every_s"):
            mode += f", checkpoint every {r['checkpoint_every_s']:g} s"
        if r.get("host_allocator") == "tuned":
            mode += ", tuned host allocator"
        if r.get("median_overlap_steps") is not None:  # streaming: how many steps a fragment's sync overlapped
            mode += f" (median {r['median_overlap_steps']:g} steps)"
        if r.get("standin_step_s"):
            mode += f", stand-in step {r['standin_step_s']:g} s"
        utilization = "—" if r.get("utilization") is None else f"{100 * r['utilization']:.1f} %"
        lines.append(
            f"| {r.get('payload_mb', CHAOS_PAYLOAD_MB):.1f} | {r['peers']} | {r['uplink_mbit']:g} | {r['inner_steps']} | {mode} | "
            f"{utilization} | {r['round_s']:.2f} | {r['compute_s_per_round']:.2f} | "
            f"{r['sync_s']:.2f} | {r['blocking_share']:.2f} | "
            f"{r.get('sync_wait_s_per_round', 0.0):.2f} / {r.get('resync_wait_s_per_round', 0.0):.2f} / "
            f"{r.get('other_s_per_round', 0.0):.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['mean_group_size']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 20.0], help="uplinks, Mbit/s")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=[NOSYNC, "none", "delayed", "eager"],
        choices=[NOSYNC, *OVERLAP_MODES],
        help=f"{NOSYNC}: the reference, the same peers with the sync replaced by nothing (run it first)",
    )
    parser.add_argument(
        "--standin-step-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run every peer with lab/standin.py's compute stand-in of this step time (a card's step)",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out at the start")
    parser.add_argument("--inner-steps", type=int, default=150, help="H")
    parser.add_argument("--fragments", type=int, default=2, help="streaming: P (the rig's model has 2 blocks)")
    parser.add_argument(
        "--fragment-delay",
        type=int,
        default=2,
        help="streaming: τ, the earliest a fragment's mean lands, in inner steps (the manifest's default)",
    )
    parser.add_argument(
        "--fragment-merge",
        choices=list(FRAGMENT_MERGES),
        default="mix",
        help="streaming: how a fragment's mean enters θ (the manifest's default: mix)",
    )
    parser.add_argument("--fragment-alpha", type=float, default=0.5, help="streaming: α (the manifest's default)")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=CHAOS_HIDDEN,
        help="the model's width (lab/chaos.py's 128: 0.49 M parameters; 256: 1.84 M): a larger payload",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the peers' --checkpoint-every (0: a checkpoint every round, peer join's default)",
    )
    parser.add_argument(
        "--host-allocator",
        choices=["tuned", "system"],
        default="tuned",
        help="the peers' LOCOSWARM_HOST_ALLOCATOR (peer/train/host_memory.py; tuned: peer join's default)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one swarm may take")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows and runs of earlier invocations (in --out and its detail file) that this "
        "one does not measure again (same peers, uplink, H and mode)",
    )
    args = parser.parse_args()
    workdir = prepare_rig_bench(parser, args, "locoswarm-overlap-rig-")
    detail = args.out.with_name(args.out.stem + "_rig.detail.json")
    runs, rows = [], []
    earlier: list[dict] = []
    if args.keep and detail.exists():
        planned = {
            (
                m,
                n,
                r,
                args.inner_steps,
                args.hidden_size,
                args.checkpoint_every,
                args.host_allocator,
                args.fragments if m == "streaming" else None,
                args.standin_step_s,
            )
            for n in args.peers
            for r in args.rates
            for m in args.modes
        }
        earlier = [
            run
            for run in json.loads(detail.read_text())["runs"]
            if (
                run["overlap"],
                run["peers"],
                run["uplink_mbit"],
                run.get("inner_steps"),
                run.get("hidden_size", CHAOS_HIDDEN),
                run.get("checkpoint_every_s", 0.0),
                run.get("host_allocator", "system"),
                fragments_of(run),
                run.get("standin_step_s"),
            )
            not in planned
        ]
        print(f"kept {len(earlier)} run(s) of earlier invocations from {detail}", flush=True)
    # the streaming fields, the same for the swarms run and the manifests written to the detail file
    streaming = {
        "fragments": args.fragments,
        "fragment_delay": args.fragment_delay,
        "fragment_merge": args.fragment_merge,
        "fragment_alpha": args.fragment_alpha,
    }
    start = time.perf_counter()
    for peers in args.peers:
        for rate in args.rates:
            for mode in args.modes:
                if mode == NOSYNC and rate != args.rates[0]:
                    continue  # no sync, no link: once per peer count
                run = run_one(
                    workdir / f"n{peers}-r{rate:g}-{mode}",
                    peers=peers,
                    rate=rate,
                    mode=mode,
                    rounds=args.rounds,
                    warmup=args.warmup,
                    inner_steps=args.inner_steps,
                    timeout_s=args.timeout,
                    hidden_size=args.hidden_size,
                    checkpoint_every_s=args.checkpoint_every,
                    host_allocator=args.host_allocator,
                    standin_step_s=args.standin_step_s,
                    **streaming,
                )
                run["command"] = " ".join(["python", *sys.argv])
                runs.append(run)
                every = earlier + runs
                rows = [row(x, reference_tokens_per_s(x, every)) for x in every if x["overlap"] != NOSYNC]
                if mode == NOSYNC:
                    tokens_per_s = sum(p["tokens_per_s"] for p in run["per_peer"].values())
                    print(f"N={peers} {NOSYNC}: {tokens_per_s:.0f} tokens/s ({run['wall_s_total']:.0f} s)", flush=True)
                else:
                    r = rows[-1]
                    utilization = "—" if r["utilization"] is None else f"{100 * r['utilization']:.1f} %"
                    print(
                        f"N={peers} {rate:g} Mbit/s {mode}: utilization {utilization}, {r['tokens_per_s']:.0f} "
                        f"tokens/s, round {r['round_s']:.2f} s, compute {r['compute_s_per_round']:.2f} s, "
                        f"sync {r['sync_s']:.2f} s ({run['wall_s_total']:.0f} s)",
                        flush=True,
                    )
                device = (
                    f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores shared by every peer), "
                    f"network namespaces with tbf uplinks"
                )
                record = json.loads(args.out.read_text()) if args.out.exists() else {"quality": []}
                record.pop("results_note", None)
                record["results"] = [
                    {
                        k: x[k]
                        for k in (
                            "overlap",
                            "peers",
                            "uplink_mbit",
                            "utilization",
                            "tokens_per_s",
                            "round_s",
                            "sync_s",
                            "inner_steps",
                            "payload_mb",
                            "checkpoint_every_s",
                            "host_allocator",
                            "standin_step_s",
                        )
                    }
                    for x in rows
                ]
                record["results_commands"] = sorted(
                    {*(x.get("command", "") for x in earlier), " ".join(["python", *sys.argv])} - {""}
                )
                record.pop("results_command", None)
                record["results_device"] = device
                args.out.write_text(json.dumps(record, indent=1) + "\n")
                detail.write_text(
                    json.dumps(
                        {
                            "command": " ".join(["python", *sys.argv]),
                            "device": device,
                            "definitions": __doc__,
                            "manifest (this invocation's H)": {
                                m: rig_manifest(
                                    "none" if m == NOSYNC else m,
                                    args.inner_steps * (args.rounds if m == NOSYNC else 1),
                                    hidden_size=args.hidden_size,
                                    **streaming,
                                ).to_dict()
                                for m in args.modes
                            },
                            "rows": rows,
                            "runs": earlier + runs,
                            "wall_s_total": time.perf_counter() - start,
                        },
                        indent=1,
                    )
                    + "\n"
                )
    print()
    print(markdown(rows))
    print(f"\nwrote {args.out} and {detail}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
