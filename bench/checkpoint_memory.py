"""Benchmark: the memory a round's checkpoint adds to the peer's process while it is written (issue
#67, item 2), before and after the streaming writer.

    python bench/checkpoint_memory.py [--hidden-size 768] [--vocab 16000] [--layers 4] [--before 16c8630]

Each variant runs in a fresh process that builds a model-shaped state (φ, the outer state, θ,
AdamW's two moments and the error-feedback residuals as fetched from the averager: six fp32 tensors
per parameter, llama-shaped: embedding, output layer, blocks), touches it, resets the kernel's RSS
high-water mark (``/proc/self/clear_refs``) and writes the round's checkpoint the way the round
loop does (peer/round/checkpointing.py ``Checkpointing.save`` with ``background``): ``before`` with
peer/state/checkpoint.py as of ``--before`` (θ and the moments copied by ``copy_live``, the
residuals copied again by ``encode_checkpoint``, then safetensors' ``save_file``), ``after`` with
this tree's (nothing copied, the file streamed tensor by tensor, θ and the moments first). The
figure is VmHWM minus VmRSS before the write, MiB; the fetch of the residuals itself is in both
baselines. ``hold_s``: how long the next inner step's update would wait from the submission of the
write (until θ and the moments are copied, before; until they are in the file, after); ``write_s``:
the whole checkpoint, encoding and fsync included. Writes bench/results/checkpoint_memory.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402

MIB = 2**20
BEFORE = "16c8630"
"""The last commit whose checkpoint copied θ and the moments (issue #67 item 2 came after it)."""
LIVE = ("theta", "adam_exp_avg", "adam_exp_avg_sq")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def shapes(hidden: int, vocab: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    inter = int(hidden * 8 / 3) // 64 * 64
    out = [("embed", (vocab, hidden))]
    for i in range(layers):
        out += [(f"l{i}.{w}", (hidden, hidden)) for w in ("q", "k", "v", "o")]
        out += [(f"l{i}.{w}", (inter, hidden)) for w in ("gate", "up")] + [(f"l{i}.down", (hidden, inter))]
        out += [(f"l{i}.norm1", (hidden,)), (f"l{i}.norm2", (hidden,))]
    return out + [("norm", (hidden,)), ("lm_head", (vocab, hidden))]


def load_before(rev: str):
    """peer/state/checkpoint.py as of ``rev``, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:peer/state/checkpoint.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader("checkpoint_before", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    exec(compile(source, f"{rev}:peer/state/checkpoint.py", "exec"), module.__dict__)
    return module


def measure(variant: str, args: argparse.Namespace) -> dict:
    """In this (fresh) process: build the state, write one checkpoint as ``variant`` does."""
    import torch

    from peer.state import checkpoint as after
    from peer.state.checkpoint import PeerState

    torch.manual_seed(0)
    spec = shapes(args.hidden_size, args.vocab, args.layers)
    names = [n for n, _ in spec]

    def group() -> list[torch.Tensor]:
        return [torch.randn(s) for _, s in spec]

    state = PeerState(
        run_id="bench",
        round=1,
        inner_step=30,
        round_step=0,
        round_tokens=0,
        names=names,
        phi=group(),
        momentum=group(),
        theta=group(),
        adam_exp_avg=group(),
        adam_exp_avg_sq=group(),
        adam_step=30,
        residuals=group(),  # as fetched from the averager: the same in both variants
    )
    model_bytes = sum(t.numel() * 4 for t in state.phi)
    largest = max(t.numel() * 4 for t in state.phi)
    released, times = threading.Event(), {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "checkpoint.safetensors"
        old = load_before(args.before) if variant == "before" else None
        baseline = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
        start = time.perf_counter()
        if variant == "before":
            assert old is not None
            file = old.encode_checkpoint(state, private=("phi", "momentum"), live=LIVE)  # on the round loop
            held = time.perf_counter()
            done = old.copy_live(file)
            times["hold"] = time.perf_counter() - held
            old.write_checkpoint(path, done)
        else:
            file = after.encode_checkpoint(state, private=("phi", "momentum", "residual"), live=LIVE)
            held = time.perf_counter()
            watcher = threading.Thread(
                target=lambda: (released.wait(), times.__setitem__("hold", time.perf_counter() - held))
            )
            watcher.start()
            after.write_checkpoint(path, file, released=released)
            watcher.join()
        total = time.perf_counter() - start
        peak = status_kib("VmHWM")
        size = path.stat().st_size
    return {
        "variant": variant,
        "model_mib": model_bytes / MIB,
        "largest_tensor_mib": largest / MIB,
        "file_mib": size / MIB,
        "baseline_rss_mib": baseline / 1024,
        "peak_added_mib": (peak - baseline) / 1024,
        "hold_s": times["hold"],
        "write_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--before", default=BEFORE, help="the commit whose checkpoint.py is 'before'")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--variant", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_memory.json"))
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args)))
        return
    runs = {}
    for variant in ("before", "after"):
        command = [sys.executable, __file__, "--variant", variant, "--hidden-size", str(args.hidden_size)]
        command += ["--vocab", str(args.vocab), "--layers", str(args.layers), "--before", args.before]
        if args.dir:
            command += ["--dir", args.dir]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        runs[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = runs["before"], runs["after"]
    print(f"{'variant':8} {'model MiB':>10} {'file MiB':>9} {'peak added MiB':>15} {'hold s':>7} {'write s':>8}")
    for r in (before, after):
        print(
            f"{r['variant']:8} {r['model_mib']:10.1f} {r['file_mib']:9.1f} {r['peak_added_mib']:15.1f} "
            f"{r['hold_s']:7.3f} {r['write_s']:8.3f}"
        )
    result = {
        "model_mib": round(after["model_mib"], 1),
        "peak_added_mib_before": round(before["peak_added_mib"], 1),
        "peak_added_mib_after": round(after["peak_added_mib"], 1),
        "largest_tensor_mib": round(after["largest_tensor_mib"], 1),
        "file_mib": round(after["file_mib"], 1),
        "hold_s_before": round(before["hold_s"], 3),
        "hold_s_after": round(after["hold_s"], 3),
        "write_s_before": round(before["write_s"], 3),
        "write_s_after": round(after["write_s"], 3),
        "before_commit": args.before,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(ROOT),
        "device": f"CPU ({cpu_model()}, {os.cpu_count()} cores), local disk",
        "command": "python bench/checkpoint_memory.py"
        + "".join(
            f" --{k} {v}"
            for k, v in (("hidden-size", args.hidden_size), ("vocab", args.vocab), ("layers", args.layers))
            if v != parser.get_default(k.replace("-", "_"))
        ),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
