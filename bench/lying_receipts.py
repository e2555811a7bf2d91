"""The Byzantine table's ``lying-receipts`` row on real peers (issue #65): a group member that sends
false RECEIPTs, repeated.

Runs tests/security/test_lying_receipts_swarm.py ``--runs`` times per ``--liars`` count L (each: a
bootstrap node and 3 + L real ``peer join`` processes of the tiny preset on 127.0.0.1 for 8 rounds,
once all honest and once with the last L colluding liars (the same false digests), the 3 honest
peers keeping their identities, so their data, across both swarms) and records each run's honest
losses; then the floor, the same 3 honest identities under ``sync.algorithm = "independent"``
(never averaging). The in-process hub has no receipts on the wire, so this row cannot
come from the engine (bench/byzantine.py reads it from here).

Usage:
    python bench/lying_receipts.py [--runs 3] [--liars 1 2]

Writes ``bench/results/lying-receipts.json``: ``commit``, ``device``, ``command``, ``runs`` (per run:
``liars``, ``clean``, ``attacked`` and ``independent`` final validation losses of the honest peers,
nats/token, ``change`` = mean(attacked) / mean(clean) − 1 and ``independent_change`` the floor's),
and ``rows``, one per liars count: ``liars``, ``peers``, ``loss_change`` and ``independent_change``
(means over its runs), ``loss_change_spread`` ((min, max)) and ``runs`` (how many).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402
from tests.security.test_lying_receipts_swarm import HONEST, LIARS_ENV, RECORD_ENV  # noqa: E402

TEST = "tests/security/test_lying_receipts_swarm.py"
RESULTS = ROOT / "bench" / "results" / "lying-receipts.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--liars", type=int, nargs="+", default=[1, 2], help="colluding liars per swarm (1 or 2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: expected at least 1")
    if bad := [k for k in args.liars if k not in (1, 2)]:
        parser.error(f"--liars {bad[0]}: expected 1 or 2 (of 3 honest peers: 1 of 4 and 2 of 5)")
    commit = git_commit(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "runs.jsonl"
        for liars in args.liars:
            for i in range(args.runs):
                env = {**os.environ, RECORD_ENV: str(record), LIARS_ENV: str(liars)}
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-s", TEST], cwd=ROOT, env=env, check=False
                )
                print(f"{liars} liar(s), run {i + 1} of {args.runs}: pytest exit {done.returncode}", flush=True)
        runs = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    if not runs:
        sys.exit("no run recorded its losses: see pytest's output above")
    rows = []
    for liars in sorted({r.get("liars", 1) for r in runs}):
        mine = [r for r in runs if r.get("liars", 1) == liars]
        changes = [r["change"] for r in mine]
        rows.append(
            {
                "liars": liars,
                "peers": HONEST + liars,
                "loss_change": statistics.fmean(changes),
                "independent_change": statistics.fmean(r["independent_change"] for r in mine),
                "loss_change_spread": [min(changes), max(changes)],
                "runs": len(mine),
            }
        )
    out = {
        "source": "real peers",
        "commit": commit,
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
        "command": " ".join(["python", *sys.argv]),
        "test": TEST,
        "runs": runs,
        "rows": rows,
        "units": {"clean": "nats/token", "attacked": "nats/token", "independent": "nats/token", "change": "fraction"},
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        print(
            f"lying-receipts, {row['liars']} of {row['peers']}: {row['runs']} runs, change "
            f"{100 * row['loss_change']:+.2f} % ({100 * row['loss_change_spread'][0]:+.2f} to "
            f"{100 * row['loss_change_spread'][1]:+.2f}), never averaging {100 * row['independent_change']:+.2f} %"
        )


if __name__ == "__main__":
    main()
