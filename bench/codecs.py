"""Benchmark: every codec's compression ratio, relative error and speed on this CPU.

    python bench/codecs.py [--threads 1] [--regenerate]

Two inputs, both shaped like the default run's parameters (protocol.presets.default_run(),
919,424 fp32 values in 39 tensors):

* (a) random normal values;
* (b) a real pseudo-gradient: the default run of 2 peers on the round engine (lab/engine_sim.py),
  the group's mean Δ of its 4th round (φ after round 3 minus φ after round 4; files made before
  the engine ran it hold peer 0's own Δ of that round). Saved with
  safetensors to ``bench/data/default_delta.safetensors`` (ignored by git) and reused;
  regenerated when missing or with ``--regenerate`` (about a minute on one core).

Per codec: bytes vs fp32 (compression ratio), relative error ‖x − x̂‖/‖x‖ over all tensors,
and encode / decode / encode+decode throughput in MB/s of fp32 input (10^6 bytes, best of
``--repeats``, after one warm-up pass). 'fp3' (E2M0) is the 3-bit float that only adaptive plans
use. 'adaptive' is the per-tensor plan (peer/sync/adaptive.py) for a group of 4 at a budget
of 1/8 of the fp32 butterfly bytes; its ratio counts its own encodings only, like the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ is repo tooling, not installed
from lab.sim_results import butterfly_bytes
from peer.sync.adaptive import plan
from protocol.codecs import Codec, decode, make_codec
from protocol.manifest import CODECS as RUN_CODECS, CompressionSpec
from protocol.presets import default_run

DATA = Path(__file__).resolve().parent / "data"
DELTA_FILE = DATA / "default_delta.safetensors"
CODECS = ("none", "fp16", "bf16", "int8", "int4", "fp4", "fp3", "topk", "lowrank", "adaptive")
GROUP = 4


def real_delta(regenerate: bool) -> dict[str, torch.Tensor]:
    """The group's mean pseudo-gradient of round 4 of the default run with 2 peers, from the file or
    freshly trained on the round engine (lab/engine_sim.py): φ after round 3 minus φ after round 4,
    which with the default's outer step (lr 1.0, momentum 0: φ ← φ − mean Δ) is that mean."""
    from safetensors.torch import load_file, save_file

    if DELTA_FILE.exists() and not regenerate:
        return load_file(DELTA_FILE)
    from lab.engine_sim import run_engine_simulation
    from peer.train.data import load_corpus
    from peer.train.model import build_model

    manifest = default_run()
    outer = manifest.outer_optimizer
    if (outer.lr, outer.momentum) != (1.0, 0.0) or manifest.sync.algorithm != "diloco":
        raise SystemExit(f"default_run's outer step is no longer φ ← φ − mean Δ ({outer}): φ_3 − φ_4 is not Δ")
    print(f"training the default run for 3 and 4 rounds to produce {DELTA_FILE} ...", file=sys.stderr)
    corpus = load_corpus(manifest.data)
    phi = [
        run_engine_simulation(manifest, corpus, peers=2, rounds=r, eval_every_rounds=r, pinned=True).final_phis[0]
        for r in (3, 4)
    ]
    names = [name for name, _ in build_model(manifest.model, corpus.tokenizer).named_parameters()]
    tensors = {name: (a - b).contiguous() for name, a, b in zip(names, *phi, strict=True)}
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / ".gitignore").write_text("*\n")  # generated data stays out of git
    save_file(tensors, DELTA_FILE, metadata={"what": "default_run, 2 peers, the group's mean Δ of round 4 (φ_3 − φ_4)"})
    return tensors


def normal_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(t.shape, generator=g) for name, t in tensors.items()}


def codecs_for(name: str, tensors: list[torch.Tensor]) -> list[Codec]:
    if name not in RUN_CODECS:  # fp3: no manifest names it; adaptive plans may choose it
        return [Codec(name) for _ in tensors]
    spec = CompressionSpec(codec=name)
    if name != "adaptive":
        return [make_codec(spec, t.shape) for t in tensors]
    fp32 = butterfly_bytes(sum(t.numel() for t in tensors), GROUP)
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=fp32 / 8 / 1e6)
    return list(plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=GROUP))


def measure(name: str, tensors: list[torch.Tensor], repeats: int) -> dict:
    codecs = codecs_for(name, tensors)
    shapes = [tuple(t.shape) for t in tensors]
    encode_s = decode_s = float("inf")
    for _ in range(repeats + 1):  # the first pass warms caches and allocators
        start = time.perf_counter()
        encoded = [c.encode(t, seed=i) for i, (c, t) in enumerate(zip(codecs, tensors))]
        middle = time.perf_counter()
        decoded = [decode(e, s, seed=i) for i, (e, s) in enumerate(zip(encoded, shapes))]
        end = time.perf_counter()
        encode_s, decode_s = min(encode_s, middle - start), min(decode_s, end - middle)
    fp32_bytes = 4 * sum(t.numel() for t in tensors)
    err = sum(float((t - d).pow(2).sum()) for t, d in zip(tensors, decoded)) ** 0.5
    norm = sum(float(t.pow(2).sum()) for t in tensors) ** 0.5
    mb = fp32_bytes / 1e6
    return {
        "codec": name,
        "bytes": sum(map(len, encoded)),
        "ratio": fp32_bytes / sum(map(len, encoded)),
        "rel_error": err / norm,
        "encode_mb_s": mb / encode_s,
        "decode_mb_s": mb / decode_s,
        "roundtrip_mb_s": mb / (encode_s + decode_s),
        "formats": sorted({c.resolve(s) for c, s in zip(codecs, shapes)}),
    }


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n")
    print("| codec | bytes | vs fp32 | rel. error ‖x−x̂‖/‖x‖ | encode MB/s | decode MB/s | enc+dec MB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['codec']} | {r['bytes']:,} | {r['ratio']:.1f}x | {r['rel_error']:.2e} | "
            f"{r['encode_mb_s']:,.0f} | {r['decode_mb_s']:,.0f} | {r['roundtrip_mb_s']:,.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats; the best is reported")
    parser.add_argument("--regenerate", action="store_true", help="retrain the real pseudo-gradient")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "codecs.json",
        help="where the numbers go (with the device and torch version)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(args.threads)
    real = real_delta(args.regenerate)
    inputs = {
        "(a) random normal, default-run shapes": normal_like(real),
        "(b) real pseudo-gradient of the default run (round 4)": real,
    }
    results = {
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} torch thread(s))",
        "torch": torch.__version__,
        "inputs": {},
    }
    for title, tensors in inputs.items():
        values = list(tensors.values())
        rows = [measure(name, values, args.repeats) for name in CODECS]
        results["inputs"][title] = rows
        print_table(
            f"{title}: {len(values)} tensors, {sum(t.numel() for t in values):,} values, {args.threads} thread(s)", rows
        )
        if "adaptive" in CODECS:
            chosen = codecs_for("adaptive", values)
            counts: dict[str, int] = {}
            for c in chosen:
                counts[repr(c)] = counts.get(repr(c), 0) + 1
            print(
                "\nadaptive plan at 1/8 of the fp32 bytes, group of 4: "
                + ", ".join(f"{k} × {v}" for k, v in sorted(counts.items()))
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
