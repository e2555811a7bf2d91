"""Benchmark: the README's main job (`peer swarm`) on this machine; prints a table.

    python bench/default_swarm.py [--peers 3] [--rounds 10] [--preset default]

Runs a real local swarm (bootstrap + N peer processes on 127.0.0.1) and reports wall time,
per-peer throughput, validation loss before/after, and bytes sent per peer and round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--preset", default="default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "summary.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "peer",
                "swarm",
                "--peers",
                str(args.peers),
                "--rounds",
                str(args.rounds),
                "--preset",
                args.preset,
                "--summary",
                str(summary_path),
                "--workdir",
                str(Path(tmp) / "swarm"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        s = json.loads(summary_path.read_text())
    rows = [("peer", "rounds", "groups", "tok/s", "MiB sent/round", "final eval loss")]
    for p in s["peers"]:
        rows.append(
            (
                p["name"],
                str(p["rounds_completed"]),
                ",".join(map(str, p["group_sizes"])),
                f"{p['tokens_per_s']:,.0f}",
                f"{p['bytes_sent'] / max(1, p['rounds_completed']) / 2**20:.2f}",
                f"{p['final_eval_loss']:.4f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(
        f"\npreset {args.preset}, {args.peers} peers, {args.rounds} rounds: validation loss "
        f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f} nats/token, wall {s['wall_seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
