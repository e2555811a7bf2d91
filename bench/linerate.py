"""Sync at line rate: time one group all-reduce of N peers, each in its own network namespace
behind a tbf-shaped link, for each payload size and codec.

    sudo .venv/bin/python bench/linerate.py --peers 4,8 --sizes 20,80 --rate 100

Efficiency = floor / measured, where floor = the bytes each peer must send (the most any peer
wrote to its all-reduce streams, frames included) ÷ link rate, and measured = the longest
all-reduce of the group (from each peer's start of the exchange, after matchmaking, to its last
mean). For fp32 the bytes each peer must send are the butterfly floor 2·(N−1)/N × payload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.netlab import NetLab, available  # noqa: E402

CODECS = "none,fp16,bf16,int8,int4,fp4,topk,lowrank"


def run_config(
    n: int, size_mb: float, codecs: str, rate: float, trials: int, timeout: float, piece_elements: int = 0
) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="linerate-") as tmp, NetLab(prefix="lrate", rate_mbit=rate or None) as lab:
        workdir = Path(tmp)
        procs = []
        for i in range(n):
            host = lab.add_host(f"p{i}")
            log = (workdir / f"worker-{i}.log").open("w")
            procs.append(
                host.run(
                    [
                        sys.executable,
                        str(ROOT / "bench" / "linerate_worker.py"),
                        "--index",
                        str(i),
                        "--n",
                        str(n),
                        "--address",
                        host.address,
                        "--size-mb",
                        str(size_mb),
                        "--codecs",
                        codecs,
                        "--trials",
                        str(trials),
                        "--dir",
                        str(workdir),
                        "--piece-elements",
                        str(piece_elements),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(ROOT),
                )
            )
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"  worker timed out after {timeout:.0f} s", file=sys.stderr)
                break
        rows = []
        for i in range(n):
            path = workdir / f"result-{i}.jsonl"
            if path.exists():
                rows += [json.loads(line) for line in path.read_text().splitlines()]
            for r in rows:
                if r["index"] == i and (not r.get("ok") or r.get("group_size") != n):
                    print(
                        f"  peer {i} {r['codec']} trial {r['trial']}: {r.get('error') or 'group of ' + str(r.get('group_size'))}",
                        file=sys.stderr,
                    )
            if not path.exists():
                print((workdir / f"worker-{i}.log").read_text()[-3000:], file=sys.stderr)
        return rows


def summarize(n: int, size_mb: float, rate: float, rows: list[dict]) -> list[dict]:
    out = []
    for codec in dict.fromkeys(r["codec"] for r in rows):
        times, sent, skews = [], [], []
        failed = 0
        for trial in sorted({r["trial"] for r in rows if r["codec"] == codec}):
            group = [r for r in rows if r["codec"] == codec and r["trial"] == trial]
            if len(group) < n or not all(r["ok"] and r["group_size"] == n for r in group):
                failed += 1
                continue
            # the group's all-reduce: from the first peer's start to the last peer's end
            times.append(max(r["started_at"] + r["allreduce_s"] for r in group) - min(r["started_at"] for r in group))
            sent.append(max(r["bytes_sent"] for r in group))
            skews.append(max(r["started_at"] for r in group) - min(r["started_at"] for r in group))
        if not times:
            out.append({"peers": n, "size_mb": size_mb, "codec": codec, "failed": failed})
            continue
        t, b = statistics.median(times), statistics.median(sent)
        floor = b * 8 / (rate * 1e6) if rate else 0.0
        out.append(
            {
                "peers": n,
                "size_mb": size_mb,
                "codec": codec,
                "bytes_sent": int(b),
                "floor_s": floor,
                "seconds": t,
                "efficiency": floor / t,
                "skew_s": statistics.median(skews),
                "trials": len(times),
                "failed": failed,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="4,8")
    ap.add_argument("--sizes", default="20,80", help="payload per peer in MB (10^6 bytes of fp32)")
    ap.add_argument("--codecs", default=CODECS)
    ap.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s (0: unshaped, to see CPU cost)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per (peers, size) configuration")
    ap.add_argument("--json", type=Path, help="also write the table here")
    ap.add_argument("--piece-elements", type=int, default=0, help="all-reduce piece size (0: the default)")
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"line-rate benchmark cannot run here: {why}")
    table = []
    for n in map(int, args.peers.split(",")):
        for size in map(float, args.sizes.split(",")):
            print(f"# {n} peers, {size:g} MB, {args.rate:g} Mbit/s ...", flush=True)
            rows = run_config(n, size, args.codecs, args.rate, args.trials, args.timeout, args.piece_elements)
            for line in summarize(n, size, args.rate, rows):
                table.append(line)
                if "seconds" in line:
                    print(
                        f"  {line['codec']:8s} sent {line['bytes_sent'] / 1e6:7.2f} MB  floor {line['floor_s']:6.2f} s"
                        f"  measured {line['seconds']:6.2f} s  efficiency {100 * line['efficiency']:5.1f} %"
                        f"  start skew {line['skew_s']:.2f} s"
                        + (f"  ({line['failed']} failed trial(s))" if line["failed"] else ""),
                        flush=True,
                    )
                else:
                    print(f"  {line['codec']:8s} all {line['failed']} trial(s) failed", flush=True)
    print("\n| peers | payload | codec | sent per peer | floor | measured | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for line in table:
        if "seconds" in line:
            print(
                f"| {line['peers']} | {line['size_mb']:g} MB | {line['codec']} | {line['bytes_sent'] / 1e6:.2f} MB | "
                f"{line['floor_s']:.2f} s | {line['seconds']:.2f} s | {100 * line['efficiency']:.0f} % |"
            )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
