"""Benchmark: validation loss at equal tokens, DiLoCo with 4 peers on the round engine, per codec.

    python bench/codec_training.py [--threads 1] [--rounds 32] [--codecs none int4 adaptive]
    python bench/codec_training.py --codecs fp4 --set compression.block_size=256 --json /tmp/fp4_256.json

The setup of bench/compare.py (its run manifest bench/compare.toml: 139,968-parameter Llama,
H = 25, its global batch and outer optimizer; the recorded results used the file of commit 4e901d8:
2,048 tokens per step, DiLoCo Nesterov 0.7/0.9; ``--rounds`` defaults to 32), N = 4
peers, seed 0, once per codec: the same φ_0, data shards and schedule, so the runs differ only
in what the all-reduce carries. Each lossy codec runs with error feedback
(``compression.error_feedback``, the default) and its default parameters (block 64, top-k 1 %,
rank 4); 'adaptive' gets a sync budget of 1/8 of the fp32 butterfly bytes per round.

Prints validation loss (bits per byte), its change vs uncompressed, the bytes each peer sent and
the reduction vs fp32; writes every number and loss curve to ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import apply_overrides, corpus_or_exit, load_config, manifest_for  # (bench/ is not a package)

from lab.engine_sim import run_engine_simulation
from lab.inprocess import butterfly_bytes
from peer.train.model import build_model, parameter_count
from protocol.errors import ManifestError
from protocol.manifest import CODECS  # every codec a run may name

ADAPTIVE_RATIO = 8.0
"""'adaptive' gets a budget of fp32 bytes / this, per round."""
UPLINK_MBPS = 50.0
"""Every simulated peer's uplink, Mbit/s: the adaptive codec's budget is a time at this rate."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, help="override bench.rounds")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field (TOML value), e.g. --set compression.block_size=256",
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "data" / "codec_training.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("peer.sync.adaptive").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)

    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    rounds = args.rounds or bench["rounds"]
    m0 = manifest_for(base, "diloco", args.peers, args.seed, bench["global_batch_tokens"], rounds)
    fp32_round = butterfly_bytes(parameter_count(build_model(m0.model)), args.peers)
    uplink = UPLINK_MBPS * 1e6 / 8
    corpus = corpus_or_exit(parser, base.data, args.config)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = []
    for codec in args.codecs:
        compression = {"codec": codec}
        if codec == "adaptive":
            compression["sync_time_budget_s"] = fp32_round / ADAPTIVE_RATIO / uplink
        m = m0.replace(compression=compression)
        r = run_engine_simulation(
            m,
            corpus,
            peers=args.peers,
            rounds=rounds,
            seed=args.seed,
            eval_every_rounds=bench["eval_every_rounds"],
            uplink_mbps=UPLINK_MBPS,
        )
        rows.append(
            {
                "codec": codec,
                "loss_bpb": r.history[-1].loss_bpb,
                "bytes_per_peer": r.bytes_sent_per_peer,
                "fp32_bytes_per_peer": fp32_round * rounds,
                "wall_s": r.wall_s,
                "compression": dataclasses.asdict(m.compression),
                "history": [dataclasses.asdict(h) for h in r.history],
            }
        )
        print(
            f"{codec}: {r.history[-1].loss_bpb:.4f} bpb, {r.bytes_sent_per_peer / 1e6:.2f} MB per peer, "
            f"{r.wall_s:.0f} s",
            flush=True,
        )
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["python", *sys.argv]),
                    "rounds": rounds,
                    "overrides": args.set,
                    "peers": args.peers,
                    "seed": args.seed,
                    "threads": args.threads,
                    "tokens": r.history[-1].tokens,
                    "runs": rows,
                },
                indent=1,
            )
            + "\n"
        )

    ref = next((r["loss_bpb"] for r in rows if r["codec"] == "none"), None)
    print(
        f"\nDiLoCo, N = {args.peers}, seed {args.seed}, {rounds} rounds, {rows[-1]['history'][-1]['tokens']:,} "
        f"tokens per run, {args.threads} thread(s), total {time.perf_counter() - start:.0f} s\n"
    )
    print("| codec | val bpb | vs none | MB sent per peer | bytes vs fp32 | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        change = "—" if ref is None or r["codec"] == "none" else f"{100 * (r['loss_bpb'] / ref - 1):+.2f} %"
        print(
            f"| {r['codec']} | {r['loss_bpb']:.4f} | {change} | {r['bytes_per_peer'] / 1e6:.2f} | "
            f"{r['fp32_bytes_per_peer'] / r['bytes_per_peer']:.1f}x fewer | {r['wall_s']:.0f} |"
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
