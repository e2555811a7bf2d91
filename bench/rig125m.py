"""Benchmark: a GPU host's swarm on this machine, with a compute stand-in for the card (issue #54).

    sudo nice -n 5 .venv/bin/python bench/rig125m.py [--preset llama-125m|chaos] [--peers 4 8]
        [--rates 100 1000] [--modes nosync none delayed eager streaming] [--codecs fp32 int8]
        [--rounds 3] [--warmup 1] [--inner-steps 700] [--step-s S | --tokens-per-s R]
        [--catch-up-rates 1000 100] [--donors 3] [--out bench/results/rig125m.json]

Every peer is a real ``peer join`` process in its own network namespace behind a tbf uplink of the
given rate (lab/chaos.py), started as ``python lab/standin.py join``: the product's peer with its
inner step replaced by lab/standin.py's stand-in, which holds the preset's real φ, θ and Δ and waits
for the step time without using the CPU, as a GPU host's training thread waits on its card. The step
time is the preset's batch tokens ÷ the card's tokens/s (bench/results/gpu.json: llama-125m on an
H200, 383,782 tokens/s, so 65,536 tokens take 0.171 s) unless ``--step-s`` or ``--tokens-per-s``
says otherwise. Everything else (outer step, codec, error feedback, all-reduce, checkpoints,
records) is the product's.

Per (peers, uplink, codec, mode), ``results`` rows (means over peers, over the rounds after
``--warmup``; a peer's first measured round starts at the event ending the round before it):

* ``utilization``: the swarm's tokens/s in rounds that averaged with at least one other peer (group
  size ≥ 2; a round whose sync failed trained alone and counts nothing) ÷ the same peers' tokens/s
  with the sync replaced by nothing; ``averaged_share`` (those rounds' share of the measured rounds)
  and ``mean_group_size`` stand beside it.
  That reference is the ``nosync`` mode's run of the same peers in this invocation (one round of
  ``rounds × H`` steps, whose only sync comes after the steps; its tokens ÷ its steps' seconds) when
  ``nosync`` is among ``--modes``; else the stand-in's exact figure, peers × batch tokens ÷ step time
  (ideal round time ÷ actual round time). ``reference`` (detail) says which. A step slowed by the
  sync lowers the swarm's tokens/s and so the utilization: it cannot raise it.
* ``sync_s``: the round events' sync seconds; ``floor_s`` (P1): the bytes a peer sent in a round
  (``bytes_sent``, mean) ÷ its uplink, the least time the link allows for them.
* ``bytes_per_token``: bytes all peers sent ÷ tokens they trained, over the measured rounds.
* ``rss_mib``: peak proportional set size (PSS: shared pages split between their processes) of all
  processes in a peer's namespace (the peer, its averager, p2pd), sampled every 5 s; mean over
  peers, MiB. The detail file also has ``rss_by_kind_mib``: each kind of process's own peak (the
  peer's process; the helpers it forked, its averager and DHT node; the libp2p daemons). θ sits in
  host memory here (on a GPU host it is on the card); the stand-in holds no gradients, activations
  or AdamW moments and evaluates φ without a forward pass (lab/standin.py).

``--layers N`` cuts the preset to N decoder blocks (rows named ``<preset>-L<N>``) for a host whose
memory does not hold the full model's peers; give ``--step-s`` scaled to the cut model (e.g. the
full model's step × its parameter share) so that bytes per second of compute stay the full model's.

``catch_up`` rows (``--catch-up-rates``; ``preset`` as the results'): ``--donors`` peers train; once all ended round 1 a joiner
starts ``peer join``; ``seconds`` from its start to its first inner step (its stand-in's
``standin_first_step`` event), ``state_bytes`` the state it downloaded (its ``adopted_state``
event), ``floor_s`` = state bytes ÷ the donors' summed uplinks (the joiner's downlink is not
shaped, so nothing caps it). Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.overlap_rig import averaged_figures, peer_figures  # noqa: E402
from bench.provenance import git_commit  # noqa: E402
from lab.chaos import CHAOS_MODEL, ChaosSwarm, prepare_rig_bench  # noqa: E402
from lab.standin import StandInConfig  # noqa: E402
from protocol.manifest import RunManifest, dump_toml  # noqa: E402
from protocol.presets import PRESETS, tiny_run  # noqa: E402
from protocol.specs import OVERLAP_MODES  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "rig125m.json"
GPU = ROOT / "bench" / "results" / "gpu.json"
CODECS = {"fp32": "none", "int8": "int8", "fp16": "fp16", "bf16": "bf16", "int4": "int4", "fp4": "fp4"}
"""The rows' codec names → the manifest's ``compression.codec``."""
NOSYNC = "nosync"


def base_manifest(preset: str, layers: int | None = None) -> RunManifest:
    """``chaos``: lab/chaos.py's 0.49 M-parameter model on the tiny run (byte-level, 256-token
    batches); any other name: protocol/presets.py's preset. ``layers``: the preset cut to that many
    decoder blocks (width, vocabulary, batch and step time unchanged), for a host whose memory
    does not hold the full model's peers.

    Raises:
        ValueError: an unknown preset (named, with the known ones), or ``layers`` < 1.
    """
    if preset == "chaos":
        base = tiny_run().replace(name="rig-chaos", model=CHAOS_MODEL)
    elif preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: choose chaos or one of {', '.join(PRESETS)}")
    else:
        base = PRESETS[preset]()
    if layers is None:
        return base
    if layers < 1:
        raise ValueError(f"layers = {layers}: give at least 1 decoder block")
    return base.replace(model={"num_layers": layers})


def preset_label(preset: str, layers: int | None) -> str:
    """The rows' ``preset``: the preset's name, with ``-L<layers>`` when cut to fewer blocks."""
    return preset if layers is None else f"{preset}-L{layers}"


def rig_manifest(
    preset: str, mode: str, codec: str, inner_steps: int, rounds: int, layers: int | None = None
) -> RunManifest:
    """The preset's run with ``sync.overlap = mode``, H = ``inner_steps`` and ``codec`` (streaming:
    the preset's fragments, at most one per block); mode ``nosync``: blocking, with one round of
    ``rounds × inner_steps`` steps (its only sync after them)."""
    overlap = "none" if mode == NOSYNC else mode
    h = inner_steps * rounds if mode == NOSYNC else inner_steps
    base = base_manifest(preset, layers)
    sync: dict = {"inner_steps": h, "overlap": overlap}
    if overlap == "streaming":  # at most one fragment per block (the chaos model has 2)
        sync["fragments"] = min(base.sync.fragments, base.model.num_layers)
    return base.replace(name=f"rig-{preset}-{mode}-{codec}", sync=sync, compression={"codec": CODECS[codec]})


def batch_tokens(manifest: RunManifest) -> int:
    """Tokens of one inner step: the batch's sequences × their length."""
    return manifest.batch_sequences * manifest.data.seq_len_tokens


def gpu_tokens_per_s(preset: str) -> float:
    """The preset's measured tokens/s on the card of bench/results/gpu.json.

    Raises:
        ValueError: no row for the preset there (give --step-s or --tokens-per-s).
    """
    for r in json.loads(GPU.read_text())["results"]:
        if r["preset"] == preset:
            return float(r["tokens_per_s"])
    raise ValueError(f"{GPU} has no row for preset {preset!r}: give --step-s or --tokens-per-s")


class PssSampler:
    """Peak PSS per named host (all processes of its namespace), and per kind of process there
    (:func:`namespace_pss`), sampled every ``every_s`` s by a thread at nice 19. The kinds' peaks
    are each their own maximum, so they need not add up to the host's."""

    def __init__(self, swarm: ChaosSwarm, every_s: float = 5.0):
        self.swarm, self.every_s = swarm, every_s
        self.peak: dict[str, int] = {}
        self.peak_by_kind: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pss")

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        # reading smaps_rollup walks a process's page tables: this thread yields to the peers'
        # (niceness is per thread on Linux), whose CPU time is what the rig measures
        if hasattr(os, "nice"):
            os.nice(19)
        while not self._stop.wait(self.every_s):
            for name in list(self.swarm.members):
                host = self.swarm.hosts.get(name)
                if host is None:
                    continue
                kinds = namespace_pss(host.netns)
                self.peak[name] = max(self.peak.get(name, 0), sum(kinds.values()))
                peaks = self.peak_by_kind.setdefault(name, {})
                for kind, size in kinds.items():
                    peaks[kind] = max(peaks.get(kind, 0), size)


def namespace_pss(netns: str) -> dict[str, int]:
    """PSS of the processes in ``netns`` by kind, bytes (processes gone meanwhile left out):
    ``peer`` (the peer's own process, where training and the outer step run), ``helpers`` (the
    processes it forked: its averager and its DHT node), ``p2pd`` (the libp2p daemons), ``other``."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    kinds: dict[str, int] = {}
    for pid in pids:
        try:
            pss = 0
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                    break
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_cmdline = Path(f"/proc/{parent}/cmdline").read_bytes() if parent in pids else b""
        except (OSError, ValueError, IndexError):
            continue
        kind = process_kind(cmdline, parent_cmdline)
        kinds[kind] = kinds.get(kind, 0) + pss
    return kinds


def process_kind(cmdline: bytes, parent_cmdline: bytes) -> str:
    """The kind of a process (:func:`namespace_pss`) from its ``/proc/<pid>/cmdline`` and its
    parent's (empty when the parent is outside the namespace): a Python process forked from one with
    the same command line is a helper (hivemind forks, it does not exec)."""
    program = cmdline.split(b"\0", 1)[0]
    if b"p2pd" in program:
        return "p2pd"
    if b"python" not in program:
        return "other"
    return "helpers" if parent_cmdline == cmdline else "peer"


def run_swarm(
    workdir: Path,
    manifest: RunManifest,
    config: StandInConfig | None,
    *,
    peers: int,
    rate: float,
    rounds: int,
    timeout_s: float,
    joiner_after_round: int | None = None,
    peer_extra: tuple[str, ...] = (),
) -> dict:
    """One swarm of stand-in peers on the rig until each stopped at ``rounds`` (``max_rounds`` of
    ``manifest``'s rounds); with ``joiner_after_round``, a joiner started once every peer ended that
    round, and every process stopped once the joiner took its first step. ``config`` None: the
    product's own inner step (``peer_extra`` then says where, e.g. ``--device cuda``). Returns every member's
    events of interest, its peak PSS and the joiner's start time.

    Raises:
        RuntimeError: a peer exited non-zero (its log named).
    """
    if config is not None:
        os.environ.update(config.to_env())  # the peers' processes inherit it (lab/standin.py reads it)
    workdir.mkdir(parents=True, exist_ok=True)
    run = workdir / "run.toml"
    run.write_text(dump_toml(manifest))
    started = time.time()
    joined_at = None
    with ChaosSwarm(
        workdir,
        run,
        rate_mbit=rate,
        prefix="lsr",
        subnet="10.213.85",
        peer_args=["--max-rounds", str(rounds), "--eval-every", "0", "--uplink-mbps", f"{rate:g}", *peer_extra],
        peer_entry=[sys.executable, str(ROOT / "lab" / "standin.py")] if config is not None else None,
    ) as swarm:
        swarm.start_bootstrap()
        names = [f"p{i}" for i in range(peers)]
        with PssSampler(swarm) as pss:
            for name in names:
                swarm.add_peer(name, extra=["--wait-for-peers", str(peers)])
            deadline = time.monotonic() + timeout_s
            if joiner_after_round is None:
                codes = {n: c.wait(max(1.0, deadline - time.monotonic())) for n, c in swarm.members.items()}
            else:  # the donors train on (``rounds`` is past the joiner's start) until the joiner stepped
                swarm.wait_rounds(names, joiner_after_round, timeout_s)
                joined_at = time.time()
                swarm.add_peer("joiner").wait_event(
                    lambda e: e.kind == "standin_first_step", max(1.0, deadline - time.monotonic())
                )
                codes = {n: c.returncode or 0 for n, c in swarm.members.items()}  # still running: stopped on close
        kinds = ("round", "adopted_state", "standin_first_step")
        events = {n: {k: [dict(e.fields) for e in c.of(k)] for k in kinds} for n, c in swarm.members.items()}
    failed = {n: c for n, c in codes.items() if c != 0}
    if failed:
        raise RuntimeError(f"peers exited with {failed}: see {workdir}/<peer>.log")
    return {
        "events": events,
        "pss_bytes": pss.peak,
        "pss_by_kind_bytes": pss.peak_by_kind,
        "joined_at": joined_at,
        "wall_s_total": time.time() - started,
    }


def swarm_figures(run: dict, warmup: int, rate: float) -> dict:
    """The ``results`` figures of one run but its utilization: swarm tokens/s (``averaged_tokens_per_s``
    only in rounds that averaged with ≥ 1 other peer, with their ``averaged_share`` and the
    ``mean_group_size``), sync and floor seconds, bytes per token, PSS (see the module's docstring). A peer with fewer than ``warmup`` + 2
    round events (one that fell out of its group and downloaded the swarm's state, so its rounds
    restarted) is listed in ``unmeasured`` and adds no tokens: the swarm's tokens/s, and so the
    utilization, count only what the measured peers trained.

    Raises:
        ValueError: no peer has enough round events.
    """
    per, sent, tokens, floor, unmeasured = [], 0, 0, [], []
    for name, ev in run["events"].items():
        rounds = ev["round"]
        if len(rounds) < warmup + 2:
            unmeasured.append(name)
            continue
        per.append(peer_figures(rounds, warmup))
        measured = rounds[max(warmup, 1) :]
        sent += sum(e["bytes_sent"] for e in measured)
        tokens += sum(e["tokens"] for e in measured)
        floor.append(statistics.fmean(e["bytes_sent"] for e in measured) * 8 / (rate * 1e6))
    if not per:
        raise ValueError(f"no peer has {warmup + 2} round events or more: nothing to measure")
    return {
        "unmeasured": unmeasured,
        "tokens_per_s": sum(p["tokens_per_s"] for p in per),
        **averaged_figures(per),
        "sync_s": statistics.fmean(p["sync_s"] for p in per),
        "allreduce_s": statistics.fmean(p["allreduce_s"] for p in per),
        "send_s": statistics.fmean(p["send_s"] for p in per),
        "floor_s": statistics.fmean(floor),
        "bytes_per_token": sent / tokens,
        "rss_mib": statistics.fmean(run["pss_bytes"].get(n, 0) for n in run["events"]) / 2**20,
        "rss_by_kind_mib": {  # mean over the peers of each kind's own peak
            kind: statistics.fmean(run.get("pss_by_kind_bytes", {}).get(n, {}).get(kind, 0) for n in run["events"])
            / 2**20
            for kind in ("peer", "helpers", "p2pd")
        },
        "round_s": statistics.fmean(p["round_s"] for p in per),
        "compute_s_per_round": statistics.fmean(p["compute_s_per_round"] for p in per),
        "per_peer": per,
    }


def result_row(run: dict) -> dict:
    """A ``results`` row from one detail run (its figures and the no-sync reference it names)."""
    return {
        "preset": run["preset"],
        "peers": run["peers"],
        "uplink_mbit": run["uplink_mbit"],
        "overlap": run["overlap"],
        "codec": run["codec"],
        "utilization": run["averaged_tokens_per_s"] / run["reference_tokens_per_s"],
        "averaged_share": run["averaged_share"],
        "mean_group_size": run["mean_group_size"],
        "sync_s": run["sync_s"],
        "floor_s": run["floor_s"],
        "bytes_per_token": run["bytes_per_token"],
        "rss_mib": run["rss_mib"],
    }


def rewrite(out: Path) -> None:
    """Refigure ``out``'s ``results`` rows from its detail file's runs (their per-peer figures): the
    utilization over rounds that averaged, ``averaged_share`` and ``mean_group_size``. The catch-up
    rows and the detail's measurements are kept as they are.

    Raises:
        ValueError: a results row without exactly one detail run, or a run whose figures cannot give
            its averaged tokens (``averaged_tokens_per_s``).
    """
    record = json.loads(out.read_text())
    detail_path = out.with_name(out.stem + ".detail.json")
    detail = json.loads(detail_path.read_text())
    runs = [r for inv in detail["invocations"] for r in inv["runs"] if r.get("overlap") != NOSYNC]
    ident = ("preset", "peers", "uplink_mbit", "overlap", "codec")
    rows = []
    for old in record["results"]:
        found = [r for r in runs if all(r.get(k) == old[k] for k in ident)]
        if len(found) != 1:
            raise ValueError(f"{[old[k] for k in ident]}: {len(found)} detail run(s) in {detail_path}, need 1")
        run = found[0]
        run.update(averaged_figures(run["per_peer"]))
        rows.append(result_row(run))
    record["results"] = rows
    out.write_text(json.dumps(record, indent=2) + "\n")
    detail_path.write_text(json.dumps(detail, indent=1) + "\n")


def nosync_tokens_per_s(run: dict) -> float:
    """The swarm's tokens/s of a ``nosync`` run: per peer, its one round's tokens ÷ its steps' seconds."""
    return sum(ev["round"][0]["tokens"] / ev["round"][0]["compute_s"] for ev in run["events"].values())


def catch_up_row(run: dict, *, rate: float) -> dict:
    """The joiner's ``catch_up`` row of a run (see the module's docstring).

    Raises:
        RuntimeError: the joiner never adopted the swarm's state or never stepped.
    """
    ev = run["events"]["joiner"]
    if not ev["adopted_state"] or not ev["standin_first_step"]:
        raise RuntimeError("the joiner never adopted the swarm's state before its first step: see joiner.log")
    adopted = ev["adopted_state"][0]
    donors = len(adopted.get("donors") or {}) or 1
    state_bytes = int(adopted["bytes"])
    return {
        "uplink_mbit": rate,
        "donors": donors,
        "state_bytes": state_bytes,
        "seconds": ev["standin_first_step"][0]["time"] - run["joined_at"],
        "floor_s": state_bytes * 8 / (donors * rate * 1e6),
        "download_s": adopted["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-125m", help="a protocol/presets.py preset, or chaos")
    parser.add_argument(
        "--layers", type=int, default=None, help="cut the preset to this many decoder blocks (rows: <preset>-L<n>)"
    )
    parser.add_argument("--peers", type=int, nargs="*", default=[4, 8], help="none: only the catch-up rows")
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 1000.0], help="uplinks, Mbit/s")
    parser.add_argument("--modes", nargs="+", default=[NOSYNC, *OVERLAP_MODES], choices=[NOSYNC, *OVERLAP_MODES])
    parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"], choices=list(CODECS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="rounds left out at the start")
    parser.add_argument("--inner-steps", type=int, default=700, help="H (700 × 0.171 s: 2 minutes a round)")
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--step-s", type=float, default=None, help="the stand-in's seconds per inner step")
    step.add_argument("--tokens-per-s", type=float, default=None, help="the card's tokens/s [gpu.json's]")
    parser.add_argument(
        "--device",
        default=None,
        help="train on this device with the product's real inner step, no stand-in (issue #54 item 6; "
        "needs nosync in --modes: there is no ideal to compare with)",
    )
    parser.add_argument("--max-memory", type=float, default=None, help="with --device: each peer's --max-memory, GiB")
    parser.add_argument("--catch-up-rates", type=float, nargs="*", default=[1000.0, 100.0])
    parser.add_argument("--donors", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one swarm may take")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--rewrite",
        action="store_true",
        help="refigure --out's results rows from its detail file (utilization over rounds that averaged) and stop",
    )
    args = parser.parse_args()
    if args.rewrite:
        try:
            rewrite(args.out)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--rewrite {args.out}: {exc}")
        print(markdown(json.loads(args.out.read_text())))
        return
    workdir = prepare_rig_bench(parser, args, "locoswarm-rig125m-")
    standin: StandInConfig | None = None
    try:
        base = base_manifest(args.preset, args.layers)
        if args.device is None:
            standin = (
                StandInConfig(step_s=args.step_s)
                if args.step_s is not None
                else StandInConfig(tokens_per_s=args.tokens_per_s or gpu_tokens_per_s(args.preset))
            )
    except ValueError as exc:
        parser.error(str(exc))
    step_s = standin.step_seconds(batch_tokens(base)) if standin is not None else None
    ideal_per_peer = batch_tokens(base) / step_s if step_s else None
    """The stand-in's exact tokens/s per peer: batch tokens ÷ step time (None: the real step)."""
    peer_extra: tuple[str, ...] = ()
    if args.device is not None:
        if NOSYNC not in args.modes:
            parser.error(
                f"--device {args.device}: add {NOSYNC} to --modes (the real step has no ideal to compare with)"
            )
        peer_extra = ("--device", args.device)
        if args.max_memory:
            peer_extra += ("--max-memory", f"{args.max_memory:g}")
    command = " ".join(["python", *sys.argv])
    record: dict = {"commit": git_commit(ROOT), "results": [], "catch_up": []}
    detail: dict = {
        "commit": record["commit"],
        "command": command,
        "step_s": step_s,
        "batch_tokens": batch_tokens(base),
        "runs": [],
    }
    inner = (
        f"the real inner step on {args.device}"
        if args.device is not None
        else f"a compute stand-in of {step_s or 0:.4f} s per step"
    )
    record["device"] = detail["device"] = (
        f"CPU ({platform.machine()}, {multiprocessing.cpu_count()} cores shared by every peer), {inner}, "
        f"network namespaces with tbf uplinks"
    )
    out_detail = args.out.with_name(args.out.stem + ".detail.json")

    def save() -> None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        out_detail.write_text(json.dumps(detail, indent=1) + "\n")

    modes = [m for m in args.modes if m != NOSYNC]
    for peers in args.peers:
        reference, how = (peers * ideal_per_peer if ideal_per_peer else 0.0), "ideal"
        if NOSYNC in args.modes:  # the same peers with the sync replaced by nothing: no link, no codec in it
            m = rig_manifest(args.preset, NOSYNC, args.codecs[0], args.inner_steps, args.rounds, args.layers)
            run = run_swarm(
                workdir / f"n{peers}-{NOSYNC}",
                m,
                standin,
                peer_extra=peer_extra,
                peers=peers,
                rate=args.rates[0],
                rounds=1,
                timeout_s=args.timeout,
            )
            reference, how = nosync_tokens_per_s(run), "measured"
            detail["runs"].append(
                {
                    "overlap": NOSYNC,
                    "peers": peers,
                    "tokens_per_s": reference,
                    "ideal_tokens_per_s": peers * ideal_per_peer if ideal_per_peer else None,
                }
            )
            of_ideal = (
                f" ({100 * reference / (peers * ideal_per_peer):.1f} % of the stand-in's ideal)"
                if ideal_per_peer
                else ""
            )
            print(f"N={peers} {NOSYNC}: {reference:.0f} tokens/s{of_ideal}", flush=True)
        for rate in args.rates:
            for codec in args.codecs:
                for mode in modes:
                    m = rig_manifest(args.preset, mode, codec, args.inner_steps, args.rounds, args.layers)
                    run = run_swarm(
                        workdir / f"n{peers}-r{rate:g}-{codec}-{mode}",
                        m,
                        standin,
                        peer_extra=peer_extra,
                        peers=peers,
                        rate=rate,
                        rounds=args.rounds,
                        timeout_s=args.timeout,
                    )
                    f = swarm_figures(run, args.warmup, rate)
                    figures = {
                        "preset": preset_label(args.preset, args.layers),
                        "peers": peers,
                        "uplink_mbit": rate,
                        "overlap": mode,
                        "codec": codec,
                        **f,
                        "reference": how,
                        "reference_tokens_per_s": reference,
                        "inner_steps": args.inner_steps,
                        "wall_s_total": run["wall_s_total"],
                    }
                    row = result_row(figures)
                    record["results"].append(row)
                    detail["runs"].append({**row, **figures})
                    save()
                    if f["unmeasured"]:
                        print(f"  not measured (too few rounds; they add no tokens): {', '.join(f['unmeasured'])}")
                    print(
                        f"N={peers} {rate:g} Mbit/s {codec} {mode}: utilization {100 * row['utilization']:.1f} % "
                        f"({how} reference; {100 * row['averaged_share']:.0f} % of rounds averaged, mean group "
                        f"{row['mean_group_size']:.2f}), sync {row['sync_s']:.2f} s vs floor {row['floor_s']:.2f} s, "
                        f"{row['bytes_per_token']:.1f} B/token, {row['rss_mib']:.0f} MiB (of which at their own peaks: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in f["rss_by_kind_mib"].items())
                        + f") ({run['wall_s_total']:.0f} s)",
                        flush=True,
                    )
    for rate in args.catch_up_rates:
        m = rig_manifest(
            args.preset, "delayed" if "delayed" in modes else "none", args.codecs[-1], args.inner_steps, 1, args.layers
        )
        run = run_swarm(
            workdir / f"catch-up-r{rate:g}",
            m,
            standin,
            peer_extra=peer_extra,
            peers=args.donors,
            rate=rate,
            rounds=1000,
            timeout_s=args.timeout,
            joiner_after_round=1,
        )
        c = catch_up_row(run, rate=rate)
        record["catch_up"].append(
            {
                "preset": preset_label(args.preset, args.layers),
                **{k: c[k] for k in ("uplink_mbit", "donors", "state_bytes", "seconds", "floor_s")},
            }
        )
        detail["runs"].append({"catch_up": c, "wall_s_total": run["wall_s_total"]})
        save()
        print(
            f"catch-up at {rate:g} Mbit/s: {c['seconds']:.1f} s vs floor {c['floor_s']:.1f} s from {c['donors']} donors"
        )
    save()
    print()
    print(markdown(record))
    print(f"\nwrote {args.out} and {out_detail}")


def markdown(record: dict) -> str:
    """The tables for docs/results.md and docs/notes/benchmarks-log.md."""
    lines = [
        (
            "| preset | peers | uplink Mbit/s | overlap | codec | utilization | rounds averaged | mean group | sync s "
            "| link floor s | bytes/token | RSS MiB |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        lines.append(
            f"| {r['preset']} | {r['peers']} | {r['uplink_mbit']:g} | {r['overlap']} | {r['codec']} | "
            f"{100 * r['utilization']:.1f} % | {100 * r['averaged_share']:.0f} % | {r['mean_group_size']:.2f} | "
            f"{r['sync_s']:.2f} | {r['floor_s']:.2f} | {r['bytes_per_token']:.2f} | "
            f"{r['rss_mib']:.0f} |"
        )
    if record["catch_up"]:
        lines += [
            "",
            "| preset | uplink Mbit/s | donors | state MB | seconds to first step | floor s |",
            "|---|---|---|---|---|---|",
        ]
        for c in record["catch_up"]:
            lines.append(
                f"| {c.get('preset', '')} | {c['uplink_mbit']:g} | {c['donors']} | {c['state_bytes'] / 1e6:.1f} | {c['seconds']:.1f} | "
                f"{c['floor_s']:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
