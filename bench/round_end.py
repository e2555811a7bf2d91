"""Benchmark: the tensor work on the training thread at an overlapped round's end (issue #18).

    python bench/round_end.py [--hidden-size 256] [--repeats 60] [--threads 1]
    LOCOSWARM_HOST_ALLOCATOR=system python bench/round_end.py   # glibc's own thresholds

With ``sync.overlap`` the inner loop stops at a round's end only for what peer/round/'s
``_overlap_step`` does itself: this round's Δ (``round_progress``), its NaN/inf check, the next
start point (``next_start``: delayed φ − Δ, or eager's preview) and θ ← the start point; and, with
a checkpoint every round (peer join's default), the checkpoint's copies of θ and AdamW's two
moments (``encode_checkpoint`` without ``live``; φ and the outer state come from the snapshot,
uncopied). The round loop no longer makes those copies: it writes θ and the moments first from the
tensors as held and holds the next update until they are written (bench/checkpoint_memory.py times
that); the part is kept to compare with the results recorded before. This
times each part on the model of bench/overlap_rig.py (``rig_model``) with the project's own
functions, and the finiteness check both ways: ``check_finite`` as shipped (the tensor's sum
first) and the element-wise test alone (what it was before). Median of ``--repeats``, in ms.

With ``sync.overlap = "streaming"`` (P = 2 fragments, the rig's 2 blocks) the training thread's
parts are a fragment's Δ and check, its landing (the outer step applied there, or since
2026-11-29 the copy of the step the sync's thread prepared) and merge, and the round's snapshot:
made afresh (``make_snapshot``: copy, check, hash of φ and the outer state), or from the sealed
tensors of the landed fragments (``make_snapshot_from``, what the round loop does since then).

The process's allocator is set as ``peer join`` sets it (peer/train/host_memory.py); with
``LOCOSWARM_HOST_ALLOCATOR=system`` it keeps glibc's thresholds, and every part that allocates
faults its pages in afresh each time. Writes ``bench/results/round_end.json``: ``{"runs":
[{"host_allocator", "device", "params", "hidden_size", "threads", "repeats", "parts": [{"part":
str, "median_ms": float}], "totals": {"delayed_ms", "eager_ms", "delayed_elementwise_ms",
"eager_elementwise_ms", "checkpoint_ms", "streaming_ms", "streaming_unprepared_ms"}, "command"}]}``, one run per allocator setting, model
width and thread count (a rerun replaces its own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overlap_rig import CHAOS_HIDDEN, rig_manifest
from peer.state.checkpoint import PeerState, encode_checkpoint
from peer.state.snapshot import make_snapshot, make_snapshot_from, seal_tensor
from peer.train import (
    outer as outer_module,
    overlap as overlap_module,
)
from peer.train.host_memory import ENV, tune_host_allocator
from peer.train.model import build_model
from peer.train.outer import DiLoCo, check_finite, pseudo_gradient, step_on_copies
from peer.train.overlap import next_start, round_progress
from peer.train.streaming import fragment_outers, merge, partition
from protocol.errors import BadPayload

OUT = Path(__file__).resolve().parent / "results" / "round_end.json"


def elementwise_check(tensors, what: str) -> None:
    """The check as it was before the sum came first: a boolean copy of every tensor."""
    for index, tensor in enumerate(tensors):
        if not torch.isfinite(tensor).all():
            raise BadPayload(f"{what}: tensor {index} holds NaN or inf")


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(hidden_size: int, repeats: int) -> tuple[int, dict[str, float]]:
    """Median milliseconds of each part of the round's end, on a fresh model and a small Δ."""
    manifest = rig_manifest("delayed", 30, hidden_size=hidden_size)
    model = build_model(manifest.model)
    params = list(model.parameters())
    phi = [p.detach().float().add(1e-3) for p in params]
    outer = DiLoCo([p.shape for p in phi], manifest.outer_optimizer)
    theta = [p.detach() for p in params]
    delta = round_progress(phi, theta)
    payload = outer.payload(phi, delta)
    names = [f"p{i}" for i in range(len(phi))]
    moments = [torch.rand_like(p) for p in phi]
    share = 1.0 / 8
    parts = {
        "Δ = ψ − θ": median_ms(lambda: round_progress(phi, theta), repeats),
        "check of Δ": median_ms(lambda: check_finite(delta, "Δ"), repeats),
        "next start, delayed": median_ms(
            lambda: next_start("delayed", outer, phi, delta, payload, share=share), repeats
        ),
        "next start, eager": median_ms(lambda: next_start("eager", outer, phi, delta, payload, share=share), repeats),
        "θ ← start": median_ms(lambda: [p.data.copy_(f) for p, f in zip(params, phi)], repeats),
        "checkpoint's copies (θ, AdamW moments)": median_ms(
            lambda: encode_checkpoint(
                PeerState(
                    run_id="bench",
                    round=1,
                    inner_step=30,
                    round_step=0,
                    round_tokens=0,
                    names=names,
                    phi=phi,
                    momentum=phi,
                    theta=theta,
                    adam_exp_avg=moments,
                    adam_exp_avg_sq=moments,
                ),
                private=("phi", "momentum"),
            ),
            repeats,
        ),
    }
    parts.update(streaming_parts(model, manifest, repeats))
    with (
        mock.patch.object(outer_module, "check_finite", elementwise_check),
        mock.patch.object(overlap_module, "check_finite", elementwise_check),
    ):
        parts["check of Δ, element-wise"] = median_ms(lambda: elementwise_check(delta, "Δ"), repeats)
        parts["next start, delayed, element-wise"] = median_ms(
            lambda: next_start("delayed", outer, phi, delta, payload, share=share), repeats
        )
        parts["next start, eager, element-wise"] = median_ms(
            lambda: next_start("eager", outer, phi, delta, payload, share=share), repeats
        )
    return sum(p.numel() for p in params), parts


def streaming_parts(model: torch.nn.Module, manifest, repeats: int) -> dict[str, float]:
    """Streaming's parts on the training thread, fragment 0 of P = 2 (half the model)."""
    names, params = zip(*model.named_parameters())
    phi = [p.detach().float().add(1e-3) for p in params]
    outer = DiLoCo([p.shape for p in phi], manifest.outer_optimizer)
    state, n = [*phi, *outer.state_tensors()], len(phi)
    shapes = [t.shape for t in state]
    index = partition(list(names), 2)[0]
    part = fragment_outers(outer, manifest, partition(list(names), 2), [p.shape for p in phi])[0]
    phi_p, theta_p = [phi[k] for k in index], [params[k] for k in index]
    mean = [d.mul(1e-3) for d in pseudo_gradient(phi_p, [t.detach() for t in theta_p])]
    meta = {"run_id": "bench", "round": 1, "inner_step": 30}
    last = make_snapshot(meta, state)
    new_phi, new_state = step_on_copies(part, phi_p, part.state_tensors(), mean)
    sealed = [
        seal_tensor(t, index=i, shapes=shapes, owned=True)
        for i, t in zip([*index, *(n + k for k in index)], [*new_phi, *new_state])
    ]
    return {
        "streaming: fragment's Δ and check": median_ms(
            lambda: check_finite(pseudo_gradient(phi_p, [t.detach() for t in theta_p]), "Δ_p"), repeats
        ),
        "streaming: landing, outer step applied": median_ms(lambda: part.apply(phi_p, mean), repeats),
        "streaming: landing, prepared step copied in": median_ms(
            lambda: [state[s.index].copy_(s.tensor) for s in sealed], repeats
        ),
        "streaming: merge (α = 0.5)": median_ms(lambda: merge(theta_p, phi_p, 0.5), repeats),
        "streaming: round's snapshot, afresh": median_ms(lambda: make_snapshot(meta, state), repeats),
        "streaming: round's snapshot, from sealed": median_ms(lambda: make_snapshot_from(last, meta, sealed), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=2 * CHAOS_HIDDEN,
        help="the rig's model width (256: the 7.35 MB payload of the 100 Mbit/s rows)",
    )
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a peer's --threads)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error(f"--repeats {args.repeats} and --threads {args.threads}: both must be >= 1")
    torch.set_num_threads(args.threads)
    allocator = tune_host_allocator()
    n_params, parts = measure(args.hidden_size, args.repeats)
    base = parts["Δ = ψ − θ"] + parts["check of Δ"] + parts["θ ← start"]
    base_old = parts["Δ = ψ − θ"] + parts["check of Δ, element-wise"] + parts["θ ← start"]
    totals = {
        "delayed_ms": base + parts["next start, delayed"],
        "eager_ms": base + parts["next start, eager"],
        "delayed_elementwise_ms": base_old + parts["next start, delayed, element-wise"],
        "eager_elementwise_ms": base_old + parts["next start, eager, element-wise"],
        "checkpoint_ms": parts["checkpoint's copies (θ, AdamW moments)"],
        # one fragment's landing of each of P = 2 plus the round's snapshot, per round
        "streaming_ms": 2
        * (
            parts["streaming: fragment's Δ and check"]
            + parts["streaming: landing, prepared step copied in"]
            + parts["streaming: merge (α = 0.5)"]
        )
        + parts["streaming: round's snapshot, from sealed"],
        "streaming_unprepared_ms": 2
        * (
            parts["streaming: fragment's Δ and check"]
            + parts["streaming: landing, outer step applied"]
            + parts["streaming: merge (α = 0.5)"]
        )
        + parts["streaming: round's snapshot, afresh"],
    }
    device = f"CPU ({platform.machine()}), torch {torch.__version__}, {args.threads} thread(s)"
    print(
        f"{n_params:,} parameters (hidden size {args.hidden_size}); {device}; median of {args.repeats}; "
        f"host allocator: {allocator}\n"
    )
    print("| part | ms |\n|---|---|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.2f} |")
    print(
        f"| **round's end, delayed** (element-wise check) | **{totals['delayed_ms']:.2f}** "
        f"({totals['delayed_elementwise_ms']:.2f}) |"
    )
    print(
        f"| **round's end, eager** (element-wise check) | **{totals['eager_ms']:.2f}** "
        f"({totals['eager_elementwise_ms']:.2f}) |"
    )
    print(
        f"| **a streaming round, P = 2** (steps applied, snapshot afresh) | **{totals['streaming_ms']:.2f}** "
        f"({totals['streaming_unprepared_ms']:.2f}) |"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = {
        "host_allocator": allocator,
        "device": device,
        "params": n_params,
        "hidden_size": args.hidden_size,
        "threads": args.threads,
        "repeats": args.repeats,
        "parts": [{"part": k, "median_ms": v} for k, v in parts.items()],
        "totals": totals,
        "command": " ".join([*([f"{ENV}={os.environ[ENV]}"] if ENV in os.environ else []), "python", *sys.argv]),
    }
    same = ("host_allocator", "hidden_size", "threads")
    runs = json.loads(args.out.read_text()).get("runs", []) if args.out.exists() else []
    runs = [r for r in runs if any(r.get(k) != run[k] for k in same)] + [run]
    args.out.write_text(json.dumps({"runs": runs}, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
