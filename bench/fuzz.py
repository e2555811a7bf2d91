"""Benchmark: random and mutated messages into every decoder and handler (issue #17 item 5).

    python bench/fuzz.py [--messages 100000] [--handler-messages N ...] [--only NAME]

Per target (lab/fuzz_targets.py): messages sent, crashes (an exception the target does not
document), hangs (a message handled in more than lab/fuzz.py ``HANG_S``), messages refused with a
documented exception, and the growth of this process's resident memory from the end of a warm-up
tenth of the messages to the end, MB. Decoders get ``--messages`` each; the in-process handlers,
whose every message runs an asyncio exchange, get the counts in ``HANDLER_MESSAGES`` (the
all-reduce handler runs a live session per message). Writes bench/results/fuzz.json:
``{"results": [{"target", "messages", "crashes", "hangs", "memory_growth_mb", "refused"}], ...}``.
Exits 1 when any target crashed or hung.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ is repo tooling, not installed
from lab import fuzz
from lab.fuzz_targets import close_loops, decoders, handlers

HANDLER_MESSAGES = {
    "state donor (serve_state)": 100_000,
    "hivemind rpc_join_group (BoundedP2P)": 100_000,
    "dial-back server (reachability._handle)": 100_000,
    "state downloader (download_state)": 20_000,
    "all-reduce stream (GroupAllreduce.serve)": 10_000,
}
"""Messages per handler: 1e5 where one message takes about a millisecond here, fewer for the
download (a verified multi-chunk answer) and the all-reduce (a live session per message)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per decoder")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every handler's count")
    parser.add_argument("--only", default=None, help="run only targets whose name contains this")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fuzz.json"))
    args = parser.parse_args()

    plan = [(t, args.messages) for t in decoders()] + [
        (t, max(1, int(HANDLER_MESSAGES.get(t.name, 10_000) * args.scale))) for t in handlers()
    ]
    if args.only:
        plan = [(t, n) for t, n in plan if args.only in t.name]
    rows = []
    print(f"{'target':<46} {'messages':>9} {'crashes':>7} {'hangs':>5} {'refused':>8} {'mem MB':>7} {'s':>6}")
    for target, count in plan:
        result, seconds = fuzz.timed(target, count)
        rows.append(
            {
                "target": result.target,
                "messages": result.messages,
                "crashes": result.crashes,
                "hangs": result.hangs,
                "memory_growth_mb": result.memory_growth_mb,
                "refused": result.refused,
                "seconds": round(seconds, 1),
            }
        )
        print(
            f"{result.target:<46} {result.messages:>9,} {result.crashes:>7} {result.hangs:>5} "
            f"{result.refused:>8,} {result.memory_growth_mb:>7.1f} {seconds:>6.0f}"
            + (f"  first crash: {result.first_crash}" if result.first_crash else ""),
            flush=True,
        )
    close_loops()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "results": rows,
                "hang_s": fuzz.HANG_S,
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 1 if any(r["crashes"] or r["hangs"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
