"""Benchmark: a pipelined swarm of real peers on the network-namespace rig (issue #19, item 6).

    sudo nice -n 5 .venv/bin/python bench/pipeline_rig.py [--rate 100] [--rounds 16] [--warmup 2]
        [--inner-steps 20] [--routings random fastest] [--repeats 2]

Real ``peer join`` processes, each in its own network namespace behind a tbf uplink of ``--rate``
Mbit/s (lab/chaos.py), train lab/chaos.py's 0.49 M-parameter model (2 blocks, hidden 128, byte
tokenizer, 256-token batches) with DiLoCo and the shipped outer step, ``--rounds`` rounds, each
swarm ``--repeats`` times (new peer ids each time, so new data shards; rows give the means):

* **pipelined**: 2 stages × 2 replicas (``--stage 0/1``), once per routing rule;
* **unpipelined, 4 peers**: the issue's reference, at equal tokens: each of the 4 peers trains on
  half the batch (128 tokens per step), so the swarm sees the pipeline's 2 × 256 tokens per step;
* **unpipelined, 2 peers**: the pipeline's width, on the same 256-token batches.

Figures: ``tokens_per_s`` = tokens the data-reading peers (stage 0; every peer unpipelined)
trained from the end of round ``--warmup`` to the end of the last round ÷ that wall time, summed
over those peers. ``final_bpb``: their training loss over the last 2 rounds in bits per token,
which for the byte tokenizer is bits per byte up to the BOS/EOS tokens (a pipelined peer holds
one stage, so no peer evaluates the whole model; the unpipelined rows use the same training-loss
figure, so the columns compare). ``activation_bytes_per_token``: bytes of the STAGE_REQUEST and
STAGE_REPLY frames (protocol/wire/pipeline.py, bf16) of one micro-batch ÷ its tokens, encoded
from a micro-batch of the run's shape: libp2p's own framing (yamux, noise) is not counted.

Writes the rig rows (``"measured": "rig"``) into bench/results/pipeline.json's ``results`` (the
simulation's rows from bench/pipeline.py are kept), every run's figures to
bench/results/pipeline_rig.detail.json, and prints a markdown table (docs/results.md: bench/results_doc.py). Needs
root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lab.chaos import CHAOS_MODEL, ChaosSwarm, prepare_rig_bench  # noqa: E402
from protocol.manifest import RunManifest, dump_toml  # noqa: E402
from protocol.presets import tiny_run  # noqa: E402
from protocol.specs import ROUTINGS  # noqa: E402
from protocol.wire.pipeline import DTYPE_BY_NAME, StageReply, StageRequest, encode_reply, encode_request  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "pipeline.json"


def rig_manifest(*, stages: int, routing: str, inner_steps: int, batch_tokens: int) -> RunManifest:
    """The benchmark's run (lab/chaos.py's model) with ``stages`` pipeline stages."""
    return tiny_run().replace(
        name=f"pipeline-rig-s{stages}",
        model=CHAOS_MODEL,
        inner_optimizer={"lr": 3e-3, "warmup_steps": 20, "decay_steps": 20000, "batch_size_tokens": batch_tokens},
        sync={
            "inner_steps": inner_steps,
            "matchmaking_time_s": 3.0,
            "allreduce_timeout_s": 60.0,
            "next_chunk_timeout_s": 10.0,
        },
        pipeline={"stages": stages, "routing": routing, "call_timeout_s": 30.0},
    )


def boundary_bytes_per_token(manifest: RunManifest) -> float:
    """Bytes of one micro-batch's STAGE_REQUEST and STAGE_REPLY payloads ÷ its tokens (the whole
    batch as one micro-batch, the run's activation dtype)."""
    b, t, h = manifest.batch_sequences, manifest.data.seq_len_tokens, manifest.model.hidden_size
    dtype = DTYPE_BY_NAME[manifest.pipeline.activation_dtype]
    acts = torch.zeros(b, t, h, dtype=dtype)
    request = encode_request(
        StageRequest(
            request_id=1, micro_batch=1, stage=1, activations=acts, targets=torch.zeros(b, t, dtype=torch.int32)
        )
    )
    reply = encode_reply(StageReply(request_id=1, grad=acts, loss=1.0, tokens=b * t))
    return (len(request) + len(reply)) / (b * t)


def reader_figures(rounds: list[dict], warmup: int) -> dict:
    """One data-reading peer's figures from its ``round`` events (in the order printed)."""
    if len(rounds) < warmup + 2:
        raise ValueError(f"{len(rounds)} round event(s): need at least warmup + 2 = {warmup + 2}")
    start, measured = rounds[max(warmup, 1) - 1], rounds[max(warmup, 1) :]
    wall = measured[-1]["time"] - start["time"]
    tail = [e["train_loss"] for e in rounds[-2:]]
    return {
        "tokens_per_s": sum(e["tokens"] for e in measured) / wall,
        "wall_s": wall,
        "final_train_loss": statistics.fmean(tail),
        "group_sizes": [e["group_size"] for e in rounds],
        "notes": sorted({e.get("note") or "" for e in rounds} - {""}),
    }


def run_one(
    workdir: Path,
    *,
    label: str,
    manifest: RunManifest,
    stages_of: list[int],
    rate: float,
    rounds: int,
    warmup: int,
    timeout_s: float,
) -> dict:
    """One swarm (peer i serves stage ``stages_of[i]``; [] entries: unpipelined) until every peer stopped."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    run.write_text(dump_toml(manifest))
    started = time.time()
    per_stage = {k: stages_of.count(k) for k in set(stages_of)}
    with ChaosSwarm(
        workdir,
        run,
        rate_mbit=rate,
        prefix="lsp",
        subnet="10.213.84",
        peer_args=["--max-rounds", str(rounds), "--eval-every", "0", "--uplink-mbps", str(rate)],
    ) as swarm:
        swarm.start_bootstrap()
        for i, stage in enumerate(stages_of):
            extra = ["--wait-for-peers", str(per_stage[stage])]
            if manifest.pipeline.stages > 1:
                extra += ["--stage", str(stage)]
            swarm.add_peer(f"p{i}", extra=extra)
        deadline = time.monotonic() + timeout_s
        codes = {name: child.wait(max(1.0, deadline - time.monotonic())) for name, child in swarm.members.items()}
        events = {name: [dict(e.fields) for e in child.of("round")] for name, child in swarm.members.items()}
    failed = {n: c for n, c in codes.items() if c != 0}
    if failed:
        raise RuntimeError(f"{label}: peers exited with {failed}: see {workdir}/<peer>.log")
    readers = {f"p{i}": reader_figures(events[f"p{i}"], warmup) for i, k in enumerate(stages_of) if k == 0}
    others = {name: [e["group_size"] for e in ev] for name, ev in events.items() if name not in readers}
    final = statistics.fmean(r["final_train_loss"] for r in readers.values())
    return {
        "label": label,
        "stages": manifest.pipeline.stages,
        "routing": manifest.pipeline.routing,
        "peers": len(stages_of),
        "uplink_mbit": rate,
        "batch_size_tokens": manifest.inner_optimizer.batch_size_tokens,
        "tokens_per_s": sum(r["tokens_per_s"] for r in readers.values()),
        "final_train_loss": final,
        "final_bpb": final / math.log(2),
        "readers": readers,
        "other_group_sizes": others,
        "wall_s_total": time.time() - started,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        (
            "| swarm | routing | uplink Mbit/s | swarm tokens/s | boundary bytes/token | final train bpb | "
            "vs unpipelined 4 peers | vs unpipelined 2 peers |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['routing']} | {r['uplink_mbit']:g} | {r['tokens_per_s']:,.0f} | "
            f"{r['activation_bytes_per_token']:.0f} | {r['final_bpb']:.4f} | {r['vs_unpipelined']:+.2f} % | "
            f"{r['vs_unpipelined_2']:+.2f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="every host's uplink, Mbit/s")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out of the throughput")
    parser.add_argument("--inner-steps", type=int, default=20, help="H")
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    parser.add_argument("--repeats", type=int, default=2, help="swarms per row (each with new peer ids: new shards)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one swarm may take")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    workdir = prepare_rig_bench(parser, args, "locoswarm-pipeline-rig-")
    H, batch = args.inner_steps, 256
    plan = [
        (
            "unpipelined, 4 peers",
            rig_manifest(stages=1, routing="random", inner_steps=H, batch_tokens=batch // 2),
            [0, 0, 0, 0],
        ),
        ("unpipelined, 2 peers", rig_manifest(stages=1, routing="random", inner_steps=H, batch_tokens=batch), [0, 0]),
    ]
    plan += [
        (
            "2 stages × 2 replicas",
            rig_manifest(stages=2, routing=routing, inner_steps=H, batch_tokens=batch),
            [0, 0, 1, 1],
        )
        for routing in args.routings
    ]
    start = time.perf_counter()
    repeats: list[list[dict]] = []
    for repeat in range(args.repeats):
        runs = []
        for label, manifest, stages_of in plan:
            run = run_one(
                workdir / f"{repeat}-{len(runs)}",
                label=label,
                manifest=manifest,
                stages_of=stages_of,
                rate=args.rate,
                rounds=args.rounds,
                warmup=args.warmup,
                timeout_s=args.timeout,
            )
            runs.append(run)
            print(
                f"repeat {repeat}: {label} ({manifest.pipeline.routing if manifest.pipeline.stages > 1 else '-'}): "
                f"{run['tokens_per_s']:,.0f} tokens/s, final train loss {run['final_train_loss']:.4f} "
                f"({run['wall_s_total']:.0f} s)",
                flush=True,
            )
        repeats.append(runs)
    # each row: the mean over repeats (new peer ids each time, so new data shards and routing)
    runs = [
        {
            **same[0],
            "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in same),
            "final_bpb": statistics.fmean(r["final_bpb"] for r in same),
            "final_bpb_per_repeat": [r["final_bpb"] for r in same],
            "tokens_per_s_per_repeat": [r["tokens_per_s"] for r in same],
        }
        for same in zip(*repeats)
    ]
    four, two = runs[0], runs[1]
    rows = []
    for run in runs[2:]:
        m = rig_manifest(stages=2, routing=run["routing"], inner_steps=H, batch_tokens=batch)
        rows.append(
            {
                "measured": "rig",
                "label": run["label"],
                "stages": 2,
                "replicas_per_stage": 2,
                "routing": run["routing"],
                "uplink_mbit": args.rate,
                "tokens_per_s": run["tokens_per_s"],
                "activation_bytes_per_token": boundary_bytes_per_token(m),
                "final_bpb": run["final_bpb"],
                "unpipelined_bpb": four["final_bpb"],
                "vs_unpipelined": 100 * (run["final_bpb"] / four["final_bpb"] - 1),
                "unpipelined_tokens_per_s": four["tokens_per_s"],
                "unpipelined_2_peers_bpb": two["final_bpb"],
                "vs_unpipelined_2": 100 * (run["final_bpb"] / two["final_bpb"] - 1),
                "unpipelined_2_peers_tokens_per_s": two["tokens_per_s"],
                "repeats": args.repeats,
                "final_bpb_per_repeat": run["final_bpb_per_repeat"],
                "unpipelined_bpb_per_repeat": four["final_bpb_per_repeat"],
                "unpipelined_2_peers_bpb_per_repeat": two["final_bpb_per_repeat"],
            }
        )
    references = [
        {
            "label": r["label"],
            "routing": "-",
            "uplink_mbit": args.rate,
            "tokens_per_s": r["tokens_per_s"],
            "activation_bytes_per_token": 0.0,
            "final_bpb": r["final_bpb"],
            "vs_unpipelined": 100 * (r["final_bpb"] / four["final_bpb"] - 1),
            "vs_unpipelined_2": 100 * (r["final_bpb"] / two["final_bpb"] - 1),
        }
        for r in (four, two)
    ]
    device = (
        f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores shared by every peer), network "
        f"namespaces with {args.rate:g} Mbit/s tbf uplinks"
    )
    command = " ".join(["python", *sys.argv])
    record = json.loads(args.out.read_text()) if args.out.exists() else {"results": []}
    record["results"] = [r for r in record.get("results", []) if r.get("measured") != "rig"] + rows
    record["rig_command"], record["rig_device"] = command, device
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    detail = args.out.with_name("pipeline_rig.detail.json")
    detail.write_text(
        json.dumps(
            {
                "command": command,
                "device": device,
                "definitions": __doc__,
                "runs": [r for same in repeats for r in same],
                "wall_s_total": time.perf_counter() - start,
            },
            indent=1,
        )
        + "\n"
    )
    print()
    print(markdown(references + rows))
    print(f"\nwrote {args.out} and {detail}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
