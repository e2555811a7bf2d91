"""Benchmark: a model that does not fit one peer's memory trains across pipeline stages (issue #19, item 6).

    sudo nice -n 5 .venv/bin/python bench/pipeline_memory.py [--hidden 768] [--layers 8] [--rounds 2]
        [--inner-steps 3] [--cap-gib auto]

On this CPU machine the cap is a Linux memory cgroup (v1 ``memory.limit_in_bytes``) around each
peer's whole process tree (the peer, its DHT and averager processes, its p2pd): the CPU analogue
of ``peer join --max-memory`` (a CUDA cap). Three phases, each a bootstrap node and real
``peer join`` processes on loopback:

1. **measure**: the run unpipelined (one peer, the whole model) and in 2 stages (one peer per
   stage), every peer in its own uncapped cgroup: its peak anonymous memory (``total_rss``) and
   ``memory.max_usage_in_bytes`` (page cache included);
2. **whole model under the cap**: the unpipelined peer again with its cgroup capped at
   ``--cap-gib`` (auto: halfway between the larger stage peer's peak anonymous memory, sampled
   every 0.2 s as the cgroup's ``total_rss``, and the whole peer's): it must fail (the kernel
   kills it for memory; page cache is reclaimed first, so the cap is set on what cannot be);
3. **stages under the same cap**: both stage peers, each capped alike, train ``--rounds`` rounds.

The model: Llama-style, ``--hidden``/``--layers`` (heads of 64), byte tokenizer, 64-token
sequences, 4 sequences per step, DiLoCo with the shipped outer step. Writes
bench/results/pipeline_memory.json and prints a markdown table (docs/results.md: bench/results_doc.py). Needs root
(cgroups).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import subprocess  # noqa: E402

from peer.launch import Child, bootstrap_argv, peer_argv, stop_all  # noqa: E402
from peer.train.model import spec_parameter_count  # noqa: E402
from protocol.manifest import RunManifest, dump_toml  # noqa: E402
from protocol.presets import tiny_run  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "pipeline_memory.json"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB = 1024**3


def run_manifest(*, stages: int, hidden: int, layers: int, inner_steps: int) -> RunManifest:
    heads = max(1, hidden // 64)
    return tiny_run().replace(
        name=f"pipeline-memory-s{stages}",
        model={
            "hidden_size": hidden,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": heads,
            "intermediate_size": int(hidden * 8 / 3) // 64 * 64,
            "max_seq_len": 128,
        },
        data={"seq_len_tokens": 64, "validation_sequences": 8},
        inner_optimizer={"lr": 1e-3, "warmup_steps": 2, "decay_steps": 1000, "batch_size_tokens": 256},
        sync={
            "inner_steps": inner_steps,
            "matchmaking_time_s": 5.0,
            "allreduce_timeout_s": 120.0,
            "next_chunk_timeout_s": 30.0,
        },
        pipeline={"stages": stages, "call_timeout_s": 300.0},
    )


class Cgroup:
    """A memory cgroup (v1) for one peer's process tree; ``limit`` None: uncapped."""

    def __init__(self, name: str, limit: int | None):
        self.path = CGROUP_ROOT / name
        self.path.mkdir(exist_ok=True)
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def spawn(self, argv, **popen) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside this cgroup (a ``peer.launch.Child`` spawn)."""
        popen.setdefault("start_new_session", True)
        return subprocess.Popen(["sh", "-c", f'echo $$ > {self.path}/cgroup.procs; exec "$@"', "sh", *argv], **popen)

    def rss(self) -> int:
        """Anonymous memory of the cgroup's processes now (``total_rss``: what the kernel cannot
        reclaim by dropping page cache), bytes."""
        for line in (self.path / "memory.stat").read_text().splitlines():
            if line.startswith("total_rss "):
                return int(line.split()[1])
        return 0

    @property
    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    @property
    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_swarm(workdir: Path, manifest: RunManifest, *, cap: int | None, rounds: int, timeout_s: float) -> dict:
    """A bootstrap node and one peer per stage (each in its own cgroup) until the peers exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    run.write_text(dump_toml(manifest))
    S = manifest.pipeline.stages
    children, groups = [], []
    try:
        boot = Child(
            "bootstrap",
            bootstrap_argv(identity=workdir / "bootstrap.key", run=run),
            log_path=workdir / "bootstrap.log",
            cwd=workdir,
        ).start()
        children.append(boot)
        addr = boot.wait_event(lambda e: e.kind == "ready", 90).addresses_on("127.0.0.1")[0]
        peers = []
        for k in range(S):
            group = Cgroup(f"locoswarm-{workdir.name}-p{k}", cap)
            groups.append(group)
            extra = ["--threads", "1", "--max-rounds", str(rounds), "--eval-every", "0"]
            if S > 1:
                extra += ["--stage", str(k)]
            child = Child(
                f"p{k}",
                peer_argv(data_dir=workdir / f"p{k}", initial_peers=[addr], extra=extra),
                log_path=workdir / f"p{k}.log",
                cwd=workdir,
                spawn=group.spawn,
            ).start()
            children.append(child)
            peers.append(child)
        deadline = time.monotonic() + timeout_s
        rss = [0] * len(groups)
        while any(p.popen.poll() is None for p in peers) and time.monotonic() < deadline:
            rss = [max(r, g.rss()) for r, g in zip(rss, groups)]  # sampled every 0.2 s
            time.sleep(0.2)
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in peers]
        return {
            "stages": S,
            "cap_bytes": cap,
            "exit_codes": codes,
            "peak_rss_bytes": rss,
            "peak_bytes": [g.peak for g in groups],
            "oom_kills": [g.oom_kills for g in groups],
            "rounds": [[e["round"] for e in p.of("round")] for p in peers],
            "train_loss": [[e["train_loss"] for e in p.of("round")] for p in peers],
            "parameters": [(p.last("started") or {}).get("parameters") for p in peers],
        }
    finally:
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)
        for group in groups:
            group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=3, help="H")
    parser.add_argument("--cap-gib", default="auto", help="the memory cap of every peer, GiB (auto: see above)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists() or os.geteuid() != 0:
        parser.error(f"needs root and the cgroup v1 memory controller at {CGROUP_ROOT}")
    workdir = Path(tempfile.mkdtemp(prefix="locoswarm-pipeline-memory-"))
    start = time.perf_counter()
    make = {
        s: run_manifest(stages=s, hidden=args.hidden, layers=args.layers, inner_steps=args.inner_steps) for s in (1, 2)
    }
    params = spec_parameter_count(make[1].model, 259)
    print(f"model: {params / 1e6:.1f} M parameters ({args.hidden} wide, {args.layers} blocks)", flush=True)
    whole = run_swarm(workdir / "measure1", make[1], cap=None, rounds=args.rounds, timeout_s=args.timeout)
    staged = run_swarm(workdir / "measure2", make[2], cap=None, rounds=args.rounds, timeout_s=args.timeout)
    print(
        f"uncapped peak RSS (page cache included): whole model {whole['peak_rss_bytes'][0] / GIB:.2f} "
        f"({whole['peak_bytes'][0] / GIB:.2f}) GiB; stages "
        f"{', '.join(f'{r / GIB:.2f} ({b / GIB:.2f})' for r, b in zip(staged['peak_rss_bytes'], staged['peak_bytes']))}"
        f" GiB (exit codes {whole['exit_codes']}, {staged['exit_codes']})",
        flush=True,
    )
    if args.cap_gib == "auto":
        cap = (max(staged["peak_rss_bytes"]) + whole["peak_rss_bytes"][0]) // 2
    else:
        cap = int(float(args.cap_gib) * GIB)
    capped_whole = run_swarm(workdir / "cap1", make[1], cap=cap, rounds=args.rounds, timeout_s=args.timeout)
    capped_stages = run_swarm(workdir / "cap2", make[2], cap=cap, rounds=args.rounds, timeout_s=args.timeout)
    print(
        f"cap {cap / GIB:.2f} GiB: whole model exit {capped_whole['exit_codes']} (OOM kills "
        f"{capped_whole['oom_kills']}); stages exit {capped_stages['exit_codes']} (OOM kills "
        f"{capped_stages['oom_kills']}), rounds {capped_stages['rounds']}",
        flush=True,
    )
    record = {
        "command": " ".join(["python", *sys.argv]),
        "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores), memory cgroups (v1) as the cap",
        "parameters": params,
        "cap_bytes": cap,
        "measure": {"whole": whole, "stages": staged},
        "capped": {"whole": capped_whole, "stages": capped_stages},
        "whole_fits": capped_whole["exit_codes"] == [0],
        "stages_fit": all(c == 0 for c in capped_stages["exit_codes"]),
        "wall_s_total": time.perf_counter() - start,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print()
    print(
        "| peers | memory cap per peer | peak RSS per peer, uncapped (with page cache) | under the cap: exit | "
        "rounds trained | training loss, first → last round |"
    )
    print("|---|---|---|---|---|---|")
    for label, measured, capped in (
        ("1, whole model", whole, capped_whole),
        ("2, one stage each", staged, capped_stages),
    ):
        losses = "; ".join(f"{t[0]:.3f} → {t[-1]:.3f}" if t else "-" for t in capped["train_loss"])
        peaks = ", ".join(
            f"{r / GIB:.2f} ({b / GIB:.2f})" for r, b in zip(measured["peak_rss_bytes"], measured["peak_bytes"])
        )
        print(
            f"| {label} | {cap / GIB:.2f} GiB | {peaks} GiB | "
            f"{capped['exit_codes']} (OOM kills {capped['oom_kills']}) | "
            f"{[len(r) for r in capped['rounds']]} | {losses} |"
        )
    print(f"\nwrote {args.out}; total wall {time.perf_counter() - start:.0f} s")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
