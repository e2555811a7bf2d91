"""Benchmark: the inner loop on this machine's device, per preset: tokens/s, MFU, peak memory, and
the project's loop against a bare PyTorch loop (issue 14 item 10).

    python bench/gpu.py [--device auto] [--presets tiny,default,llama-125m] [--steps 5] [--repeats 3]
                        [--batch-sequences N] [--out bench/results/gpu.json]

For each preset (default: every preset on CUDA, skipping those that do not fit; tiny, default and
llama-125m on the CPU): the run's model (a fresh init, random tokens of its vocabulary), placed as
``peer join`` would place it (peer/train/device.py: precision per card, torch.compile on CUDA, the
micro-batch probed to fit the card), then two loops on the same model init, batches, micro-batch,
precision, compilation and AdamW settings:

* project: :class:`peer.train.inner.InnerLoop` ``.step`` as the round loop calls it (the model and
  its loss compiled as one graph, the lr schedule, grad clipping, the loss and gradient checked for
  finiteness, on the device with fused AdamW, and the loss read to the host at the step's end);
* bare: a plain loop (zero_grad, autocast forward of the compiled model, cross-entropy, backward per
  micro-batch, clip, AdamW step), no host sync inside a step, no finiteness check.

Each loop runs one untimed warm-up step (compilation), then ``--repeats`` × ``--steps`` timed steps;
tokens/s is the best repeat's. The loops run one after the other, each alone on the device (the
micro-batch is probed for one model's weights and AdamW state). A preset that fails prints its
traceback and the run goes on to the next. ``inner_vs_bare`` = project tokens/s ÷ bare tokens/s. MFU = tokens/s ×
(6·N + 12·layers·hidden·seq) ÷ the card's dense bf16/fp16 peak (peer/train/device.py's table, or
``--peak-tflops``); null where the peak is unknown (CPUs).
``peak_memory_gib`` is ``torch.cuda.max_memory_allocated`` over the project loop's steps on CUDA,
null elsewhere (a process RSS would count both loops' models and the allocator's cache).

On the CPU the batch is cut to ``--batch-sequences`` (default: at most 1,024 tokens a step) so the
run ends in minutes; the table says which batch was used. Writes ``--out`` (the keys of issue 14:
device, torch, results[preset, params, precision, micro_batch, tokens_per_s, mfu, peak_memory_gib,
inner_vs_bare]) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer.doctor import vocab_tokenizer
from peer.train.device import flops_per_token, mfu, place
from peer.train.inner import InnerLoop
from peer.train.model import build_model, embedding_parameter_count, parameter_count
from peer.train.precision import autocast
from protocol.errors import ConfigError
from protocol.presets import PRESETS

GIB = 1024**3
CPU_PRESETS = ("tiny", "default", "llama-125m")
CPU_TOKENS_PER_STEP = 1024


class Cycle:
    """A sampler over a fixed list of host batches (drawing costs nothing, for either loop)."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches, self.batches_drawn = batches, 0
        self.batch_sequences, self.seq_len = batches[0].shape[0], batches[0].shape[1] - 1

    def next_batch(self) -> torch.Tensor:
        self.batches_drawn += 1
        return self.batches[(self.batches_drawn - 1) % len(self.batches)]


class BareLoop:
    """The baseline: what a person writes without the project (same model, batch, optimizer)."""

    def __init__(self, model, spec, sampler: Cycle, *, device, precision, micro: int, compile: bool):
        self.model, self.spec, self.sampler, self.device, self.precision, self.micro = (
            model,
            spec,
            sampler,
            device,
            precision,
            micro,
        )
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=spec.lr,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            fused=True if device.type == "cuda" else None,
        )
        self.scaler = torch.amp.GradScaler(device.type) if precision.grad_scaler else None
        self.forward = torch.compile(model) if compile else model

    def step(self, inner_step: int) -> None:
        batch = self.sampler.next_batch()
        rows = batch.shape[0]
        self.optimizer.zero_grad(set_to_none=True)
        for chunk in batch.split(self.micro):
            chunk = chunk.to(self.device, non_blocking=True)
            with autocast(self.device.type, self.precision):
                logits = self.forward(input_ids=chunk[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1))
            loss = loss * (chunk.shape[0] / rows)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, self.spec.grad_clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.spec.lr
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(loop, device: torch.device, first_step: int, steps: int) -> float:
    """Seconds for ``steps`` steps of ``loop`` (device work included)."""
    _sync(device)
    start = time.perf_counter()
    for k in range(steps):
        loop.step(first_step + k)
    _sync(device)
    return time.perf_counter() - start


def bench_preset(name: str, args, placement) -> dict:
    manifest = PRESETS[name]()
    device = placement.device
    tokenizer = vocab_tokenizer(manifest)
    rows = args.batch_sequences or manifest.batch_sequences
    seq = manifest.data.seq_len_tokens
    if device.type != "cuda" and args.batch_sequences is None:
        rows = max(1, min(rows, CPU_TOKENS_PER_STEP // seq))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, tokenizer.vocab_size, (rows, seq + 1), generator=g) for _ in range(4)]
    model = build_model(manifest.model, tokenizer)
    bare_model = copy.deepcopy(model)  # the same init, kept on the host until the project loop is done
    model = model.to(device)
    project = InnerLoop(
        model,
        manifest.inner_optimizer,
        Cycle(batches),
        device=device,
        precision=placement.precision,
        micro_batch_sequences=args.micro_batch,
        compile=placement.compile,
    )
    if device.type == "cuda" and args.micro_batch is None:
        project.fit_micro_batch(budget_bytes=placement.memory_budget_gib * GIB)
    micro = project.micro_batch_sequences or rows
    project.step(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = min(timed(project, device, 1 + r * args.steps, args.steps) for r in range(args.repeats))
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    compiled = project.compiled
    del project, model  # one loop on the card at a time: the micro-batch was probed for one
    if device.type == "cuda":
        gc.collect()  # the model sits in reference cycles: free its CUDA tensors before the bare loop
        torch.cuda.empty_cache()
    # compiled only where the project's loop still is (it falls back to eager if compiling fails)
    bare = BareLoop(
        bare_model.to(device),
        manifest.inner_optimizer,
        Cycle(batches),
        device=device,
        precision=placement.precision,
        micro=micro,
        compile=compiled,
    )
    bare.step(0)
    bare_seconds = min(timed(bare, device, 1 + r * args.steps, args.steps) for r in range(args.repeats))
    model = bare.model
    tokens = args.steps * rows * seq
    rate, bare_rate = tokens / seconds, tokens / bare_seconds
    n = parameter_count(model)
    per_token = flops_per_token(
        params=n,
        embedding_params=embedding_parameter_count(model),
        layers=manifest.model.num_layers,
        hidden=manifest.model.hidden_size,
        seq_len=seq,
    )
    result = {
        "preset": name,
        "params": n,
        "precision": placement.precision.name,
        "micro_batch": micro,
        "tokens_per_s": round(rate, 1),
        "mfu": mfu(rate, per_token, placement.peak_tflops),
        "peak_memory_gib": None if peak is None else round(peak, 3),
        "inner_vs_bare": round(rate / bare_rate, 4),
    }
    print(
        f"  {name}: batch {rows} × {seq} tokens, compiled {compiled}, project {rate:,.0f} tok/s, "
        f"bare {bare_rate:,.0f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    del bare, model, bare_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--presets", default=None, help="comma-separated preset names")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default: 5 CUDA, 2 CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per loop (default: 3 CUDA, 2 CPU)")
    parser.add_argument("--batch-sequences", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu.json")
    args = parser.parse_args()
    placement, notes = place(args.device, compile=args.compile, peak_tflops=args.peak_tflops)
    cuda = placement.device.type == "cuda"
    args.steps = args.steps or (5 if cuda else 2)
    args.repeats = args.repeats or (3 if cuda else 2)
    names = args.presets.split(",") if args.presets else (list(PRESETS) if cuda else list(CPU_PRESETS))
    device_name = placement.info.name if cuda else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    print(
        f"device {placement.info.device}: {device_name}, {placement.precision.name}, "
        f"compile {placement.compile}; torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )
    results = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        # a fresh compile per preset: dynamo would otherwise compile the next preset's model for dynamic
        # shapes (its input shape changed on the same code), which is not what `peer join` runs
        torch._dynamo.reset()
        try:
            results.append(bench_preset(name, args, placement))
        except (ConfigError, torch.OutOfMemoryError) as exc:
            print(f"  {name}: skipped, does not fit ({str(exc).splitlines()[0]})", file=sys.stderr, flush=True)
        except Exception:  # one preset's failure must not lose the others' measurements
            print(f"  {name}: failed", file=sys.stderr, flush=True)
            traceback.print_exc()
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
        # written after every preset: a run cut short keeps what it measured
        out = {"device": device_name, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print("| preset | params | precision | micro-batch | tokens/s | MFU | peak memory (GiB) | inner / bare |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        mfu_text = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
        memory = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        print(
            f"| {r['preset']} | {r['params']:,} | {r['precision']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
            f"{mfu_text} | {memory} | {100 * r['inner_vs_bare']:.1f} % |"
        )


if __name__ == "__main__":
    main()
