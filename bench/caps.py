"""A volunteer's own caps on the network-namespace rig (issue #53 item 10): what a peer with
``--max-upload-mbit`` or ``--max-gb-per-day`` sends against its cap, how many rounds it sits out,
and what that costs the swarm's loss at equal tokens.

Each case is a swarm of a bootstrap node and ``--peers`` peers (lab/chaos.py, each its own host on
an unshaped link) training the chaos-scale run (0.49 M parameters, fp32 pseudo-gradients: ~2 MB a
payload) for ``--rounds`` rounds; one peer, ``capped``, has the case's cap:

* ``none``: no caps (the reference; run twice, the second row shows run-to-run noise);
* ``upload N Mbit/s``: ``sent_mib`` is what its link sent during its syncs (lab/linkmeter.py: busy
  stretches of at least 1.5 MiB), ``limit_mib`` the cap × their length;
* ``G GB/day``: ``sent_mib`` is what its traffic ledger counted (sent + received,
  ``DATA_DIR/traffic.json``), ``limit_mib`` the budget's pro-rata share for the run (an hour's:
  peer/net/traffic.py ``MIN_SHARE_S``); ``rounds_sat_out`` its rounds with a sync sat out;
  ``ledger_mib`` against ``wire_mib``: what its ledger counted from its first write to its last
  against the IP bytes its link carried both ways meanwhile (lab/linkmeter.py ``LedgerWatch``),
  ``ledger_vs_wire`` their relative difference; ``max_rounds_ahead``: the most rounds its round
  was ahead of the furthest other peer's when it finished one (0: it kept to the swarm's round).

Every host sends one TCP segment a frame, as on a real line (lab/linkmeter.py
``one_segment_a_frame``), so its link's bytes are what a metered line counts.

``loss_change``: the peers' mean final validation loss (each evaluates φ on the run's validation
windows at its last round: equal tokens, every peer trains every round) minus the reference's; the
repeated reference shows what run-to-run noise alone moves it. Also kept: each peer's final loss,
the capped peer's gap to the others', and (upload case) its peak send rate over any 4 s.

Usage (root)::

    python bench/caps.py --rounds 12 --out bench/results/caps.json
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import git_commit
from lab.chaos import CHAOS_MODEL, ChaosSwarm
from lab.linkmeter import LedgerWatch, LinkMeter, busy_stretches, one_segment_a_frame
from lab.netlab import available
from peer.net.traffic import LEDGER_FILE, allowance_bytes
from protocol.manifest import dump_toml
from protocol.presets import tiny_run

SYNC_BYTES = int(1.5 * 2**20)
MIB = 2**20


def manifest():
    return tiny_run().replace(
        model=CHAOS_MODEL,
        compression={"codec": "none"},
        sync={"inner_steps": 10, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 60.0, "next_chunk_timeout_s": 15.0},
    )


def peak_rate(samples: list[tuple[float, int]], window_s: float) -> float:
    """The most bytes/s sent over any ``window_s`` of the samples."""
    best, j = 0.0, 0
    for i in range(len(samples)):
        while j < len(samples) and samples[j][0] - samples[i][0] < window_s:
            j += 1
        if j == len(samples):
            break
        best = max(best, (samples[j][1] - samples[i][1]) / (samples[j][0] - samples[i][0]))
    return best


def run_case(workdir: Path, *, peers: int, rounds: int, extra: list[str], subnet: str) -> dict:
    """One swarm; returns the capped peer's link samples, events and the peers' final losses."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    run.write_text(dump_toml(manifest()))
    common = ["--max-rounds", str(rounds), "--eval-every", "0", "--wait-for-peers", str(peers)]
    with ChaosSwarm(workdir, run, rate_mbit=None, prefix="lscb", subnet=subnet, peer_args=common) as swarm:
        swarm.start_bootstrap()
        one_segment_a_frame(swarm.hosts["bootstrap"])
        names = [f"p{i}" for i in range(peers - 1)] + ["capped"]
        for name in names[:-1]:
            swarm.add_peer(name)
        capped = swarm.add_peer("capped", extra=extra)
        for name in names:  # before they connect: they are still starting
            one_segment_a_frame(swarm.hosts[name])
        meter = LinkMeter(swarm.hosts["capped"].veth_root)
        meter.start()
        watch = LedgerWatch(workdir / "capped" / LEDGER_FILE, swarm.hosts["capped"].veth_root)
        watch.start()
        start = time.monotonic()
        try:
            finals = {}
            for name in names:
                member = swarm.members[name]
                final = member.wait_event(lambda e: e.kind == "eval" and e.get("when") == "final", 120 + 30 * rounds)
                finals[name] = final["loss"]
        finally:
            meter.stop()
            watch.stop()
        seconds = time.monotonic() - start
        rounds_sat_out = sum(1 for e in capped.of("round") if "sat out this sync" in (e.get("note") or ""))
        ahead = 0
        for e in capped.of("round"):  # e.round: the round it goes on to; the others' likewise
            theirs = [
                o.round or 0 for n in names[:-1] for o in swarm.members[n].of("round") if (o.time or 0) <= (e.time or 0)
            ]
            ahead = max(ahead, (e.round or 0) - max(theirs, default=0))
    ledger_path = workdir / "capped" / LEDGER_FILE
    ledger = json.loads(ledger_path.read_text()) if ledger_path.exists() else {"bins": []}
    return {
        "samples": meter.samples,
        "seconds": seconds,
        "finals": finals,
        "rounds_sat_out": rounds_sat_out,
        "ledger_bytes": sum(s + r for _, s, r in ledger["bins"]),
        "ledger_span": watch.span(),
        "max_rounds_ahead": ahead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--cap-mbit", type=float, default=5.0)
    parser.add_argument(
        "--gb-per-day",
        type=float,
        default=0.8,
        help="The budget of the day case: ~half the traffic the capped peer would use in the run, as "
        "an hour's share (0.8 GB/day: 33 MB an hour; 12 rounds of 3 peers: ~66 MB).",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/caps.json"))
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        parser.error(f"the network-namespace rig is not available here: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="caps-"))
    cases = [
        ("none", []),
        ("none (repeat)", []),
        (f"upload {args.cap_mbit:g} Mbit/s", ["--max-upload-mbit", str(args.cap_mbit)]),
        (f"{args.gb_per_day:g} GB/day", ["--max-gb-per-day", str(args.gb_per_day)]),
    ]
    results, rows = {}, []
    for i, (label, extra) in enumerate(cases):
        print(f"case {label}: {args.peers} peers, {args.rounds} rounds", flush=True)
        results[label] = r = run_case(
            workdir / f"case{i}", peers=args.peers, rounds=args.rounds, extra=extra, subnet="10.213.88"
        )
        reference = results["none"]["finals"]
        loss = sum(r["finals"].values()) / len(r["finals"])
        row = {
            "cap": label,
            "peers": args.peers,
            "sent_mib": None,
            "limit_mib": None,
            "within_cap": None,
            "rounds_sat_out": r["rounds_sat_out"],
            "loss_change": loss - sum(reference.values()) / len(reference),
            "final_losses": r["finals"],
            "capped_vs_others": r["finals"]["capped"]
            - sum(v for k, v in r["finals"].items() if k != "capped") / (len(r["finals"]) - 1),
        }
        if extra and extra[0] == "--max-upload-mbit":
            cap = args.cap_mbit * 1e6 / 8
            syncs = [(s, b) for s, b in busy_stretches(r["samples"], cap) if b >= SYNC_BYTES]
            sent, span = sum(b for _, b in syncs), sum(s for s, _ in syncs)
            row.update(sent_mib=sent / MIB, limit_mib=cap * span / MIB, within_cap=sent <= 1.05 * cap * span)
            row["syncs"] = len(syncs)
            row["peak_4s_mbit"] = peak_rate(r["samples"], 4.0) * 8 / 1e6
        elif extra:
            limit = allowance_bytes(args.gb_per_day * 1e9, r["seconds"])
            row.update(
                sent_mib=r["ledger_bytes"] / MIB, limit_mib=limit / MIB, within_cap=r["ledger_bytes"] <= 1.05 * limit
            )
            counted, wire = r["ledger_span"]
            row.update(
                ledger_mib=counted / MIB,
                wire_mib=wire / MIB,
                ledger_vs_wire=counted / wire - 1 if wire else None,
                max_rounds_ahead=r["max_rounds_ahead"],
            )
        else:
            row["sent_mib"] = (r["samples"][-1][1] - r["samples"][0][1]) / MIB  # its link, the whole run
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| cap | peers | sent MiB | limit MiB | within cap | rounds sat out | loss change |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [
            row["cap"],
            row["peers"],
            "–" if row["sent_mib"] is None else f"{row['sent_mib']:.1f}",
            "–" if row["limit_mib"] is None else f"{row['limit_mib']:.1f}",
            "–" if row["within_cap"] is None else ("yes" if row["within_cap"] else "no"),
            row["rounds_sat_out"],
            f"{row['loss_change']:+.4f}",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    for row in rows:
        if row.get("ledger_mib") is not None:
            vs = "–" if row["ledger_vs_wire"] is None else f"{row['ledger_vs_wire']:+.2%}"
            print(
                f"\n{row['cap']}: ledger {row['ledger_mib']:.2f} MiB, link {row['wire_mib']:.2f} MiB ({vs}); "
                f"at most {row['max_rounds_ahead']} round(s) ahead of the other peers"
            )
    out = {
        "device": "2-core CPU, no GPU; network namespaces on one machine, unshaped links",
        "commit": git_commit(Path(__file__).resolve().parent.parent),
        "command": f"python bench/caps.py --peers {args.peers} --rounds {args.rounds} --cap-mbit {args.cap_mbit:g} "
        f"--gb-per-day {args.gb_per_day:g}",
        "setup": {"model": "chaos (0.49 M parameters)", "codec": "none (fp32)", "inner_steps": 10},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
