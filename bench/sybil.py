"""Free identities against real peers (issue #51, item 5): a flood of progress records, each validly
signed by a fresh identity, on real DHT nodes on 127.0.0.1.

Per algorithm (DiLoCo, NoLoCo): a bootstrap node (``bootstrap run``) and ``--peers`` honest ``peer
join`` processes of the tiny preset train; once every peer finished ``--warmup`` rounds (its ledger
holds its groupmates), a stock hivemind node joined to the bootstrap stores ``--records`` records
under the run's progress key on the nodes nearest to it (as hivemind's ``store`` does, without a lookup
per request), each signed by an identity of its own (cheap keys from a pool of primes,
tests/security/dht_attacker.py) and claiming the peers' current round or one of the next; the peers train ``--rounds``
more. Measured per peer, then averaged over the peers:

* ``grouped_rounds_frac``: of the rounds a peer finished after the flood was stored, the share whose
  sync averaged with at least one other peer (``round`` event: ``group_size`` > 1);
* ``rss_growth_mib``: the resident memory of the peer's whole process tree (main process, DHT
  process, averager, p2pd), from just before the flood to its peak after, MiB; the largest over the
  peers.

The row with ``records`` = 0 is the same peers' rounds before the flood, and their memory growth over
the warm-up's second half. Writes bench/results/sybil.json: ``{"command", "rows": [{"records",
"algorithm", "grouped_rounds_frac", "rss_growth_mib"}], "setup": {...}}``.

    nice .venv/bin/python bench/sybil.py --records 20000 --peers 4 --warmup 3 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.launch import Child, bootstrap_argv, peer_argv, stop_all  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.manifest import dump_toml  # noqa: E402
from protocol.presets import tiny_run  # noqa: E402
from protocol.records import ProgressRecord  # noqa: E402
from protocol.signing import OwnerKey, save_owner_key  # noqa: E402


def group_rss_detail(pgid: int) -> dict[str, float]:
    """Resident memory, MiB, by ``"name pid"``, of each process in process group ``pgid`` and of
    their descendants in other groups (p2pd runs in a session of its own) (Linux /proc)."""
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20  # rss, pages
            procs[int(entry)] = (int(fields[1]), int(fields[2]), name, rss)  # ppid, pgrp
        except (OSError, ValueError, IndexError):
            continue
    members = {pid for pid, (_, pgrp, _, _) in procs.items() if pgrp == pgid}
    grown = True
    while grown:
        more = {pid for pid, (ppid, _, _, _) in procs.items() if ppid in members and pid not in members}
        members |= more
        grown = bool(more)
    return {f"{procs[pid][2]} {pid}": procs[pid][3] for pid in members}


def group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in process group ``pgid``, MiB (Linux /proc)."""
    return sum(group_rss_detail(pgid).values())


def _show_rss(label: str, children) -> None:
    for c in children:
        if c.popen.poll() is None:
            detail = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(group_rss_detail(c.popen.pid).items()))
            print(f"  {label} {c.name} RSS MiB: {detail}", file=sys.stderr, flush=True)


def run_one(algorithm: str, *, records: int, peers: int, warmup: int, rounds: int, workdir: Path) -> list[dict]:
    """The two rows of ``algorithm`` (module docstring)."""
    from tests.security.dht_attacker import flood_records, sybil_signers

    owner = OwnerKey.generate()
    owner_path = save_owner_key(owner, workdir / "owner.key").path
    manifest = tiny_run().replace(sync={"algorithm": algorithm}).with_owner(owner.public_hex)
    if algorithm == "noloco":
        manifest = manifest.replace(noloco={"group_size": 2})
    run_file = workdir / "run.toml"
    run_file.write_text(dump_toml(manifest))
    children: list[Child] = []

    def spawn(name: str, argv: list[str]) -> Child:
        child = Child(
            name,
            argv,
            log_path=workdir / f"{name}.log",
            cwd=workdir,
            stack_signal=signal.SIGUSR1,
            events_copy=workdir / f"{name}.jsonl",
        )
        children.append(child)
        return child.start()

    attacker = None
    try:
        boot = spawn(
            "bootstrap",
            bootstrap_argv(identity=workdir / "boot.key", run=run_file, extra=["--owner-key", str(owner_path)]),
        )
        addr = boot.wait_event(lambda e: e.kind == "ready", 120).addresses_on("127.0.0.1")[0]
        honest = [
            spawn(
                f"peer{i}",
                peer_argv(
                    data_dir=workdir / f"peer{i}",
                    initial_peers=[addr],
                    extra=[
                        *("--threads", "1", "--max-rounds", str(warmup + rounds + 100)),
                        *("--run-id", manifest.run_id, "--wait-for-peers", str(peers)),
                    ],
                ),
            )
            for i in range(peers)
        ]
        half = max(1, warmup // 2)
        for child in honest:
            child.wait_event(lambda e: e.kind == "round" and e["round"] >= half, 600)
        rss_half = [group_rss_mib(c.popen.pid) for c in honest]
        for child in honest:
            child.wait_event(lambda e: e.kind == "round" and e["round"] >= warmup, 600)
        rss_before = [group_rss_mib(c.popen.pid) for c in honest]
        _show_rss("before the flood", [*honest, boot])
        start_round = max(e["round"] for c in honest for e in c.of("round"))
        import hivemind

        print(f"{algorithm}: warm-up done at round {start_round}; flooding", file=sys.stderr, flush=True)
        attacker = hivemind.DHT(initial_peers=[addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        started = time.monotonic()
        signers = sybil_signers(records)
        spread = rounds + 4  # records claim the rounds ahead, so that some always track the peers' round
        for offset in range(spread):
            part = signers[offset::spread]
            claim = start_round + 1 + offset
            record = ProgressRecord(
                round=claim,
                inner_step=claim * manifest.sync.inner_steps,
                train_loss=3.0,
                tokens_per_s=1e4,
                group_size=2,
                bytes_sent=0,
                state_digest="0" * 32,
            )
            flood_records(attacker, keys.progress_key(manifest.run_id), part, record.to_wire())
            print(f"  {len(part)} records claiming round {claim} stored", file=sys.stderr, flush=True)
        flood_s = time.monotonic() - started
        print(f"{algorithm}: {records} records stored in {flood_s:.0f} s", file=sys.stderr, flush=True)
        _show_rss("flood stored", [*honest, boot])
        flood_round = max(e["round"] for c in honest for e in c.of("round"))  # rounds after it: under the flood
        peak = list(rss_before)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            for i, c in enumerate(honest):
                if c.popen.poll() is None:
                    peak[i] = max(peak[i], group_rss_mib(c.popen.pid))
            if all(max((e["round"] for e in c.of("round")), default=0) >= flood_round + rounds for c in honest):
                break
            if any(c.popen.poll() is not None for c in honest):
                raise RuntimeError("an honest peer exited: " + ", ".join(c.tail(5) for c in honest))
            time.sleep(1.0)
        _show_rss("after the flood", [*honest, boot])

        def frac(lo: int, hi: int) -> float:
            per_peer = []
            for c in honest:
                evs = [e for e in c.of("round") if lo < e["round"] <= hi]
                if not evs:
                    raise RuntimeError(f"{c.name} finished no round in ({lo}, {hi}]")
                per_peer.append(sum(1 for e in evs if e["group_size"] > 1) / len(evs))
            return round(sum(per_peer) / len(per_peer), 3)

        return [
            {
                "records": 0,
                "algorithm": algorithm,
                "grouped_rounds_frac": frac(half, start_round),
                "rss_growth_mib": round(max(b - h for b, h in zip(rss_before, rss_half)), 1),
            },
            {
                "records": records,
                "algorithm": algorithm,
                "grouped_rounds_frac": frac(flood_round, flood_round + rounds),
                "rss_growth_mib": round(max(p - b for p, b in zip(peak, rss_before)), 1),
                "flood_store_s": round(flood_s, 1),
            },
        ]
    finally:
        if attacker is not None:
            attacker.shutdown()
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--algorithms", nargs="+", default=["diloco", "noloco"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sybil.json")
    args = parser.parse_args()
    rows = []
    for algorithm in args.algorithms:
        with tempfile.TemporaryDirectory(prefix=f"sybil-{algorithm}-") as tmp:
            got = run_one(
                algorithm,
                records=args.records,
                peers=args.peers,
                warmup=args.warmup,
                rounds=args.rounds,
                workdir=Path(tmp),
            )
            rows += got
            print(json.dumps(got), flush=True)
    print(f"{'records':>8} {'algorithm':>9} {'grouped_rounds_frac':>20} {'rss_growth_mib':>15}")
    for r in rows:
        print(f"{r['records']:>8} {r['algorithm']:>9} {r['grouped_rounds_frac']:>20} {str(r['rss_growth_mib']):>15}")
    setup = {
        "peers": args.peers,
        "warmup_rounds": args.warmup,
        "rounds_after_flood": args.rounds,
        "preset": "tiny",
        "device": "2-core CPU, no GPU",
        "nodes": "real DHT nodes on 127.0.0.1",
    }
    command = (
        f"python bench/sybil.py --records {args.records} --peers {args.peers} --warmup {args.warmup} "
        f"--rounds {args.rounds}"
    )
    if args.algorithms != ["diloco", "noloco"]:
        command += " --algorithms " + " ".join(args.algorithms)
    args.out.write_text(json.dumps({"command": command, "rows": rows, "setup": setup}, indent=2) + "\n")


if __name__ == "__main__":
    main()
