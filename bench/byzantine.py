"""Benchmark: 8 peers of which 1 (then 2) are malicious, loss at equal tokens against the clean run
and the floor (the same peers never syncing), on the round engine (issues #17, #51 item 7, #65).

    nice -n 5 python bench/byzantine.py [--rounds 10] [--seeds 0 1 2] [--algorithms diloco noloco]
        [--schedules none delayed] [--attacks ...] [--malicious 1 2] [--plain] [--jobs 2] [--resume]
        [--no-loss-gate --out bench/results/byzantine-nogate.json]
        [--schedules delayed --overlap-from-round 10 --rounds 20 --out bench/results/byzantine-delayed.json]
        [--device cuda --jobs 8]   # on a card (bench/device_session.sh --byzantine)
        [--merge A.detail.json B.detail.json --out bench/results/byzantine.json]   # one commit's invocations

Every run is lab/engine_sim.py: 8 real round loops (peer/round/ ``Trainer``) in threads over the
in-process hub, which deals each group's pieces to owners and screens and checks them as the
network's all-reduce does (lab/inprocess_means.py); lab/adversary.py's hooks forge what the
malicious peers contribute, the means they send as owners (per receiver), the records they publish
and the states they serve. The manifest is bench/compare.py's (its inner lr, fixed global batch,
cosine schedule ending with the run; default horizon 10 rounds × its H = 25), so every run trains on
the same tokens; ``--schedules`` sets ``sync.overlap`` per row (``delayed``: with the landings
pinned where the lockstep defines them, lab/engine_sim.py ``run_engine_simulation(pinned=True)``),
``--overlap-from-round K`` the overlapped rows' ``sync.overlap_from_round`` (rounds before K sync
blocking: on bench/compare.toml delayed averaging from round 0 is worth less than none, at 10, 20
and 40 rounds, so a delayed row there cannot tell a defence from none). ``--device cuda`` trains
every peer's θ on the card (eager, the card's autocast).

Per algorithm, schedule and seed it runs ``clean`` (8 honest peers, the hub screening as the
network does) and, per schedule and seed, ``independent``: the same 8 peers under
``sync.algorithm = "independent"`` (peer/train/outer.py ``Independent``: a group of one, φ ← θ every
round; no change to lab/ was needed), which never syncs and so serves DiLoCo and NoLoCo alike.
``independent_change`` is (independent − clean) / clean, the cost of not averaging: a horizon where
it is small cannot tell a defence from none. Each attack row compares the honest peers' final
validation loss (the mean of each honest peer's own loss, bits per byte) with the clean run of the
same seed, algorithm and schedule: ``loss_change`` is (attacked − clean) / clean, a fraction,
averaged over seeds, ``loss_change_spread`` its (min, max) over seeds. ``takeovers`` counts, summed
over seeds, the honest peers' adoptions of a state the attacker forged plus the honest peers whose
final φ is not finite or whose loss exceeds :data:`TAKEOVER_LOSS_FACTOR` × the clean run's;
``non_finite_rounds`` the rounds at whose end an honest φ was not finite; ``honest_exits`` the honest
round loops that raised or stopped early. The detail file's ``goal_met`` judges each row against
issue #65 item 4 (:data:`GOALS`). ``clean_overhead`` is (clean, screened − clean, plain mean) /
clean plain mean, averaged over the pairs run (``--plain``). The honest NoLoCo peers judge each
group's step by its loss on their next batches (peer/round/loss_gate.py); the malicious ones always
do, keeping their own models clean, the stronger attacker. ``--no-loss-gate`` turns the honest
peers' gate off (its config says ``loss_gate = false``): what the gate is worth, written to a file
of its own. ``sybil`` holds the rows of
bench/results/sybil.json (bench/sybil.py: the record floods on real DHT nodes, a run of its own),
copied with the issue's keys. ``lying-receipts`` is not an engine row: the in-process hub has no
receipts on the wire, and a receipt whose digest differs from the receiver's without the owner's
seal changes nothing (peer/sync/receipts.py ``verdict``), so its rows (:func:`lying_receipts_rows`) are
the real-peer measurement of bench/lying_receipts.py (bench/results/lying-receipts.json). ``--attacks
bogus-announcement`` also runs bench/byzantine_announce.py (real DHT nodes on 127.0.0.1); a joiner's
run choice has no loss, so those results go to the detail file only.

Writes ``bench/results/byzantine.json`` with the issue's keys (``source``, ``commit``, ``device``,
``command``, ``horizon``, ``clean_loss``, ``independent_change``, ``results``, ``sybil``,
``clean_overhead``), and ``bench/results/byzantine.detail.json`` with every run, the per-seed
figures, the definitions and the config. ``--resume`` keeps the detail file's runs of the same
commit (``git rev-parse HEAD``, ``-dirty`` when the tree has changes) and config only, and names the
invocations it kept runs of in ``command``. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/ and bench/ are repo tooling
from bench.compare import apply_overrides, corpus_or_exit, load_config, manifest_for
from bench.provenance import git_commit
from bench.results_questions import ATTACK_GOALS
from lab.adversary import ATTACKS, Adversary
from lab.engine_sim import EngineResult, run_engine_simulation
from peer.train.data import load_corpus
from peer.train.device import place
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import RunManifest

RESULTS = Path(__file__).with_name("results") / "byzantine.json"
PEERS = 8
ALGORITHMS = ("diloco", "noloco")
TAKEOVER_LOSS_FACTOR = 1.5
FRESH_IDENTITIES = 8
"""Identities the fake-progress attacker adds to its malicious peers: more than the honest peers'
own class (7 or 6), so that counting records alone would follow it."""
TAKEOVER = (
    "per honest peer and seed: each adoption of a state the attacker forged (fake-progress, tie-break), "
    f"plus 1 if its final φ is not finite or its validation loss exceeds {TAKEOVER_LOSS_FACTOR}x the clean "
    "run's (same seed and algorithm)"
)
BOGUS = "bogus-announcement"
INDEPENDENT = "independent"
"""The floor's rows: the same 8 peers never syncing (``sync.algorithm = "independent"``)."""
SCHEDULES = ("none", "delayed")
"""``sync.overlap`` values a row can run under (blocking, and DiLoCo/NoLoCo's delayed landing)."""
SPREAD = "(min, max) over seeds of the per-seed (attacked - clean) / clean"


def _train(
    base: RunManifest,
    bench: dict,
    *,
    rounds: int,
    seed: int,
    algorithm: str,
    attack: str | None,
    malicious: int,
    screening: bool,
    threads: int,
    matchmaking_s: float,
    schedule: str = "none",
    loss_gate: bool = True,
    device: str = "cpu",
    overlap_from_round: int = 0,
) -> dict:
    """One engine run; the malicious peers are the last ``malicious`` of :data:`PEERS` (who owns which
    piece is drawn per group, as matchmaking orders a group). ``attack`` :data:`INDEPENDENT`: the same
    peers under ``sync.algorithm = "independent"`` (peer/train/outer.py ``Independent``: group size 1,
    φ ← θ every round), the floor; ``algorithm`` then only labels the row it is the floor of."""
    torch.set_num_threads(threads)
    logging.getLogger("peer").setLevel(logging.ERROR)
    method = "independent" if attack == INDEPENDENT else algorithm
    m = manifest_for(base, method, PEERS, seed, bench["global_batch_tokens"], rounds)
    m = m.replace(sync={"overlap": schedule, "overlap_from_round": overlap_from_round if schedule != "none" else 0})
    adversary = None
    if attack not in (None, INDEPENDENT):
        adversary = Adversary(
            attack=attack,
            peers=tuple(range(PEERS - malicious, PEERS)),
            fresh_identities=FRESH_IDENTITIES if attack == "fake-progress" else 0,
        )
    r = _engine(m, base, rounds, seed, screening, adversary, matchmaking_s, loss_gate, device)
    h = r.history[-1]
    return {
        "attack": attack or "none",
        "algorithm": algorithm,
        "schedule": schedule,
        "malicious": malicious,
        "seed": seed,
        "screening": screening,
        "final_bpb": h.loss_bpb,
        "per_peer_bpb": h.per_peer_bpb,
        "tokens": h.tokens,
        "adopted_forged": r.takeovers,
        "non_finite_rounds": r.non_finite_rounds,
        "honest_exits": r.honest_exits,
        "counts": r.screening,
        "train_s": r.train_s,
        "wall_s": r.wall_s,
    }


def _engine(
    m: RunManifest,
    base: RunManifest,
    rounds: int,
    seed: int,
    screening: bool,
    adversary: Adversary | None,
    matchmaking_s: float,
    loss_gate: bool = True,
    device: str = "cpu",
) -> EngineResult:
    # CPU: fp32 (no placement, as every recorded row ran); a card: every peer's θ on it at the card's
    # precision, eager (8 models compiling would take a short device budget's minutes)
    placement = None if device == "cpu" else place(device, compile=False)[0]
    return run_engine_simulation(
        m,
        load_corpus(base.data),
        peers=PEERS,
        rounds=rounds,
        seed=seed,
        eval_every_rounds=rounds,
        screening=screening,
        adversary=adversary,
        matchmaking_s=matchmaking_s,
        pinned=True,  # overlap's landings where the lockstep defines them (blocking: nothing to pin)
        loss_gate=loss_gate,
        placement=placement,
    )


def _takeovers(run: dict, clean_bpb: float) -> int:
    losses = run["per_peer_bpb"] or [run["final_bpb"]]
    broken = sum(1 for x in losses if not math.isfinite(x) or x > TAKEOVER_LOSS_FACTOR * clean_bpb)
    return run["adopted_forged"] + broken


def _key(run: dict) -> tuple:
    return (
        run["attack"] or "none",
        run["algorithm"],
        run.get("schedule", "none"),
        run["malicious"],
        run["seed"],
        run["screening"],
    )


SYBIL_KEYS = ("records", "algorithm", "grouped_rounds_frac", "rss_growth_mib")


def sybil_rows(path: Path) -> tuple[list[dict], dict]:
    """The record floods on real DHT nodes as bench/sybil.py measured them (its rows, with the
    issue's keys) and where they came from; no rows where it has not been run."""
    if not path.exists():
        return [], {"measured": f"not yet: {path.name} is written by bench/sybil.py"}
    data = json.loads(path.read_text())
    rows = [{k: row[k] for k in SYBIL_KEYS} for row in data["rows"]]
    return rows, {"from": path.name, "command": data.get("command"), "setup": data.get("setup")}


GOALS = ATTACK_GOALS
"""Issue #65 item 4, per malicious count: (the most loss_change may be, the largest fraction of the
independent row's cost it may be); bench/results_questions.py judges docs/results.md by the same."""


def lying_receipts_rows(path: Path) -> list[dict]:
    """The lying-receipts rows from ``path`` (bench/lying_receipts.py: real peers, not the engine; see
    the module docstring), one per number of colluding liars, with the issue's keys; none where that
    file is not there. A file from before its ``rows`` holds the 1-liar row alone."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    rows = data.get("rows") or [
        {
            "liars": 1,
            "peers": 4,
            "loss_change": data["loss_change"],
            "independent_change": data.get("independent_change"),
            "loss_change_spread": data["loss_change_spread"],
            "runs": len(data["runs"]),
        }
    ]
    return [
        {
            "attack": "lying-receipts",
            "algorithm": "diloco",
            "schedule": "none",
            "peers": row["peers"],
            "malicious": row["liars"],
            "loss_change": row["loss_change"],
            "loss_change_spread": row["loss_change_spread"],
            "independent_change": row.get("independent_change"),
            "seeds": row["runs"],
            "takeovers": None,
            "non_finite_rounds": None,
            "honest_exits": 0,  # the test fails on any honest peer's exit status but 0
            "measured_on": f"real peers ({data['test']}, commit {data['commit']})",
            "note": f"tiny preset, 3 honest + {row['liars']} colluding liar(s) of {row['peers']}, 8 rounds, vs a "
            f"clean swarm of {row['peers']} whose honest peers have the same identities (data); a repeat is a run, "
            "not a seed; takeovers and non-finite rounds not counted there",
        }
        for row in rows
    ]


def _spread(xs: list[float]) -> list[float]:
    return [min(xs), max(xs)]


def goal_met(malicious: int, loss_change: float, independent_change: float | None, counts: dict) -> bool | None:
    """Whether a row meets issue #65 item 4's goal: ``loss_change`` at most :data:`GOALS`' bound and
    below that fraction of the independent row's cost, and no takeover, non-finite round or honest
    exit; None where there is no goal (more than 2 malicious) or no independent row to compare with."""
    if malicious not in GOALS or independent_change is None:
        return None
    bound, fraction = GOALS[malicious]
    clean_counts = not (counts["takeovers"] or counts["non_finite_rounds"] or counts["honest_exits"])
    return loss_change <= bound and loss_change < fraction * independent_change and clean_counts


def baselines(runs: list[dict]) -> tuple[dict, dict]:
    """(clean final loss per (algorithm, schedule, seed), independent per (schedule, seed)), bits per
    byte; the screening-on runs only. The independent run does not depend on the algorithm (it never
    syncs: peer/train/outer.py ``Independent``), so one per schedule and seed serves DiLoCo and NoLoCo."""
    clean = {
        (r["algorithm"], r.get("schedule", "none"), r["seed"]): r["final_bpb"]
        for r in runs
        if r["attack"] == "none" and r["screening"]
    }
    independent = {
        (r.get("schedule", "none"), r["seed"]): r["final_bpb"]
        for r in runs
        if r["attack"] == INDEPENDENT and r["screening"]
    }
    return clean, independent


def summarize(runs: list[dict]) -> dict:
    """The table of ``runs`` (engine runs as :func:`_train` returns them).

    Returns:
        dict with ``rows`` (the issue's keys: one ``clean`` and one ``independent`` row per algorithm
        and schedule, then the attacks; ``loss_change`` the mean over seeds of (run − clean) / clean
        of the same seed, ``loss_change_spread`` its (min, max) over seeds; the clean row's is the
        seeds' spread of clean itself, (clean_s − mean) / mean), ``detail`` (the same rows with the
        per-seed figures, the independent cost they are judged against and ``goal_met``),
        ``clean_loss`` and ``independent_change`` per (algorithm, schedule) and
        ``clean_overhead`` ((screened − plain) / plain over the clean runs that have a plain twin).
    """
    clean, independent = baselines(runs)
    plain = {
        (r["algorithm"], r.get("schedule", "none"), r["seed"]): r["final_bpb"]
        for r in runs
        if r["attack"] == "none" and not r["screening"]
    }
    paired = sorted(set(clean) & set(plain))
    overhead = statistics.fmean((clean[k] - plain[k]) / plain[k] for k in paired) if paired else None
    rows: list[dict] = []
    detail: list[dict] = []
    clean_loss: dict[str, float] = {}
    independent_change: dict[str, float] = {}
    settings = sorted(
        {(a, s) for a, s, _ in clean},
        key=lambda k: (ALGORITHMS.index(k[0]), SCHEDULES.index(k[1]) if k[1] in SCHEDULES else 99),
    )
    for algorithm, schedule in settings:
        seeds = sorted(seed for a, s, seed in clean if (a, s) == (algorithm, schedule))
        losses = [clean[(algorithm, schedule, seed)] for seed in seeds]
        mean = statistics.fmean(losses)
        name = f"{algorithm}/{schedule}"
        clean_loss[name] = mean
        base = {"algorithm": algorithm, "schedule": schedule, "peers": PEERS, "malicious": 0}
        zero = {"takeovers": 0, "non_finite_rounds": 0, "honest_exits": 0}
        own = [(x - mean) / mean for x in losses]
        rows.append(
            {
                "attack": "clean",
                **base,
                "loss_change": 0.0,
                "loss_change_spread": _spread(own),
                "seeds": len(seeds),
                **zero,
            }
        )
        detail.append({**rows[-1], "seeds_run": seeds, "final_bpb_per_seed": losses})
        both = [seed for seed in seeds if (schedule, seed) in independent]
        if both:
            changes = [
                (independent[(schedule, seed)] - clean[(algorithm, schedule, seed)])
                / clean[(algorithm, schedule, seed)]
                for seed in both
            ]
            independent_change[name] = statistics.fmean(changes)
            rows.append(
                {
                    "attack": INDEPENDENT,
                    **base,
                    "loss_change": independent_change[name],
                    "loss_change_spread": _spread(changes),
                    "seeds": len(both),
                    **zero,
                }
            )
            detail.append(
                {
                    **rows[-1],
                    "seeds_run": both,
                    "loss_change_per_seed": changes,
                    "final_bpb_per_seed": [independent[(schedule, seed)] for seed in both],
                    "clean_bpb_per_seed": [clean[(algorithm, schedule, seed)] for seed in both],
                }
            )
    keys = sorted(
        {
            (r["attack"], r["algorithm"], r.get("schedule", "none"), r["malicious"])
            for r in runs
            if r["attack"] not in ("none", INDEPENDENT) and r["screening"]
        },
        key=lambda k: (ATTACKS.index(k[0]), ALGORITHMS.index(k[1]), SCHEDULES.index(k[2]), k[3]),
    )
    for attack, algorithm, schedule, malicious in keys:
        mine = sorted(
            (
                r
                for r in runs
                if (r["attack"], r["algorithm"], r.get("schedule", "none"), r["malicious"])
                == (attack, algorithm, schedule, malicious)
                and r["screening"]
                and (algorithm, schedule, r["seed"]) in clean
            ),
            key=lambda r: r["seed"],
        )
        if not mine:  # its clean run is not done yet
            continue
        base_bpb = [clean[(algorithm, schedule, r["seed"])] for r in mine]
        changes = [(r["final_bpb"] - c) / c for r, c in zip(mine, base_bpb)]
        counts = {
            "takeovers": sum(_takeovers(r, c) for r, c in zip(mine, base_bpb)),
            "non_finite_rounds": sum(r["non_finite_rounds"] for r in mine),
            "honest_exits": sum(r["honest_exits"] for r in mine),
        }
        rows.append(
            {
                "attack": attack,
                "algorithm": algorithm,
                "schedule": schedule,
                "peers": PEERS,
                "malicious": malicious,
                "loss_change": statistics.fmean(changes),
                "loss_change_spread": _spread(changes),
                "seeds": len(mine),
                **counts,
            }
        )
        floor = independent_change.get(f"{algorithm}/{schedule}")
        detail.append(
            {
                **rows[-1],
                "seeds_run": [r["seed"] for r in mine],
                "loss_change_per_seed": changes,
                "final_bpb_per_seed": [r["final_bpb"] for r in mine],
                "clean_bpb_per_seed": base_bpb,
                "independent_change": floor,
                "goal_met": goal_met(malicious, rows[-1]["loss_change"], floor, counts),
                "counts": [r["counts"] for r in mine],
            }
        )
    return {
        "rows": rows,
        "detail": detail,
        "clean_loss": clean_loss,
        "independent_change": independent_change,
        "clean_overhead": overhead,
    }


def headline(summary: dict) -> tuple[float | None, float | None]:
    """(clean_loss, independent_change) of blocking DiLoCo (the issue's top-level figures), or of the
    first setting measured; None where not measured."""
    if not summary["clean_loss"]:
        return None, None
    name = "diloco/none" if "diloco/none" in summary["clean_loss"] else next(iter(summary["clean_loss"]))
    return summary["clean_loss"][name], summary["independent_change"].get(name)


def markdown(summary: dict) -> str:
    """The table for docs/benchmarks.md: every row with its per-seed figures, spread and goal."""
    lines = [
        (
            "| attack | algorithm | schedule | malicious of N | loss change vs clean (mean) | per seed "
            "| spread (min, max) | takeovers | non-finite rounds | honest exits | goal met |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in summary["detail"]:
        per_seed = ", ".join(f"{100 * x:+.2f} %" for x in d.get("loss_change_per_seed", []))
        if d["attack"] == "clean":
            per_seed = ", ".join(f"{x:.4f}" for x in d["final_bpb_per_seed"]) + " bpb"
        lo, hi = d["loss_change_spread"]
        goal = d.get("goal_met")
        lines.append(
            f"| {d['attack']} | {d['algorithm']} | {d['schedule']} | {d['malicious']} of {d['peers']} | "
            f"{100 * d['loss_change']:+.2f} % | {per_seed} | {100 * lo:+.2f} %, {100 * hi:+.2f} % | {d['takeovers']} "
            f"| {d['non_finite_rounds']} | {d['honest_exits']} | {'—' if goal is None else ('yes' if goal else 'no')} |"
        )
    if summary["clean_overhead"] is not None:
        lines.append(
            "\nclean_overhead (hub screening as the network vs plain mean, no attacker): "
            f"{100 * summary['clean_overhead']:+.3f} %"
        )
    return "\n".join(lines)


def device_name(jobs: int, threads: int, device: str = "cpu") -> str:
    """The CPU (model from /proc/cpuinfo, cores), the card the peers train on (``device`` not cpu) or
    no GPU, torch, and how the runs shared it."""
    if device != "cpu":
        placement, _ = place(device, compile=False)
        if placement.device.type != "cpu":
            return (
                f"{placement.info.name} ({placement.precision.name} autocast), torch {torch.__version__}, "
                f"{jobs} run(s) at once sharing the card, 8 peers each"
            )
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{model}, {multiprocessing.cpu_count()} cores (shared), no GPU, torch {torch.__version__}, "
        f"{jobs} run(s) at once, {threads} thread(s) each"
    )


def resumable(earlier: dict, *, commit: str, config: dict) -> tuple[list[dict], int]:
    """The runs of an earlier detail file that ``--resume`` may keep: those of ``commit`` (a run of
    another commit, or of none, is never mixed in), and the number left out.

    Raises:
        ValueError: the earlier file holds runs of another manifest or round count.
    """
    if earlier.get("config") != config:
        raise ValueError("it holds runs of another manifest or round count")
    runs = earlier.get("runs", [])
    kept = [r for r in runs if r.get("commit") == commit]
    return kept, len(runs) - len(kept)


def merged(details: list[dict]) -> dict:
    """One detail file's fields from the detail files of separate invocations at one commit (e.g. the
    blocking rows, then the delayed rows with ``--overlap-from-round K``): their runs together, their
    devices and commands joined. A blocking run does not depend on K, so the files' configs may differ
    in it alone, and at most one K other than 0 is among them.

    Raises:
        ValueError: no file; files of different commits or round counts, or manifests that differ
            beyond K; two different K; one run (same row, seed and screening) in two files.
    """
    if not details:
        raise ValueError("no detail file to merge")
    commits = {d["commit"] for d in details}
    if len(commits) != 1:
        raise ValueError(f"runs of commits {sorted(commits)}: merge the files of one commit only")
    if len({d["rounds"] for d in details}) != 1:
        raise ValueError(f"round counts {sorted({d['rounds'] for d in details})}: merge one horizon only")
    bare = [{k: v for k, v in d["config"].items() if k != "overlap_from_round"} for d in details]
    if any(b != bare[0] for b in bare):
        raise ValueError("the files hold runs of different manifests (beyond the overlapped rows' first round)")
    ks = {d["horizon"].get("overlap_from_round", 0) for d in details} - {0}
    if len(ks) > 1:
        raise ValueError(f"overlap_from_round {sorted(ks)}: the overlapped rows of one file hold one K")
    runs = [r for d in details for r in d["runs"]]
    keys = [_key(r) for r in runs]
    if len(set(keys)) != len(keys):
        raise ValueError("a run is in two files: merge the files of separate invocations")
    config = next((d["config"] for d in details if d["horizon"].get("overlap_from_round")), details[0]["config"])
    return {
        "runs": runs,
        "commit": details[0]["commit"],
        "device": " / ".join(dict.fromkeys(d["device"] for d in details)),
        "command": " && ".join(dict.fromkeys(d["command"] for d in details)),
        "rounds": details[0]["rounds"],
        "inner_steps": details[0]["horizon"]["inner_steps"],
        "overlap_from_round": next(iter(ks), 0),
        "config": config,
        "complete": all(d["complete"] for d in details),
        "announcements": [a for d in details for a in d.get("announcements", [])],
        "wall_s": sum(d.get("wall_s_total", 0.0) for d in details),
    }


def _train_task(task: tuple[RunManifest, dict, dict]) -> dict:
    base, bench, kwargs = task
    return _train(base, bench, **kwargs)


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_results(
    out: Path,
    runs: list[dict],
    *,
    commit: str,
    device: str,
    command: str,
    rounds: int,
    inner_steps: int,
    config: dict,
    complete: bool,
    announcements: list[dict],
    wall_s: float,
    overlap_from_round: int = 0,
) -> dict:
    """Write ``out`` (the issue's keys) and the detail file next to it from ``runs`` (every run of one
    commit), and return :func:`summarize`'s summary of them."""
    detail_path = out.with_name(out.stem + ".detail.json")
    summary = summarize(runs)
    clean_loss, independent_change = headline(summary)
    sybil, sybil_source = sybil_rows(out.parent / "sybil.json")
    lying = lying_receipts_rows(out.parent / "lying-receipts.json")
    horizon = {"rounds": rounds, "inner_steps": inner_steps}
    if overlap_from_round:  # the overlapped rows' first overlapped round (rounds before it sync blocking)
        horizon["overlap_from_round"] = overlap_from_round
    out.write_text(
        json.dumps(
            {
                "source": "engine",
                "commit": commit,
                "device": device,
                "command": command,
                "horizon": horizon,
                "clean_loss": clean_loss,
                "independent_change": independent_change,
                "results": [*summary["rows"], *lying],
                "sybil": sybil,
                "clean_overhead": summary["clean_overhead"],
            },
            indent=1,
        )
        + "\n"
    )
    detail_path.write_text(
        json.dumps(
            {
                "source": "engine",
                "commit": commit,
                "device": device,
                "command": command,
                "horizon": horizon,
                "results": [*summary["detail"], *lying],
                "clean_loss": summary["clean_loss"],
                "independent_change": summary["independent_change"],
                "clean_overhead": summary["clean_overhead"],
                "sybil": sybil_source,
                "announcements": announcements,
                "units": {
                    "loss_change": "fraction: (attacked - clean) / clean, final val bits per byte, mean over "
                    "the honest peers' own losses, mean over seeds",
                    "loss_change_spread": SPREAD,
                    "independent_change": "fraction: (independent - clean) / clean, mean over seeds, per "
                    "algorithm/schedule (the independent run of a schedule and seed serves both algorithms)",
                    "clean_loss": "final val bits per byte of the clean run, mean over seeds",
                    "clean_overhead": "fraction: (hub screening - plain mean) / plain mean, no attacker",
                },
                "goals": {
                    f"{k} malicious": f"loss_change <= {b} and < {f:.3f} x independent_change, 0 takeovers, "
                    "0 non-finite rounds, 0 honest exits"
                    for k, (b, f) in GOALS.items()
                },
                "takeover_definition": TAKEOVER,
                "complete": complete,
                "rounds": rounds,
                "config": config,
                "runs": runs,
                "wall_s_total": wall_s,
            },
            indent=1,
        )
        + "\n"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("compare.toml"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=["none"], help="sync.overlap of the runs (rows per value)"
    )
    parser.add_argument(
        "--attacks",
        nargs="*",
        choices=[*ATTACKS, BOGUS],
        default=list(ATTACKS),
        help="none given: the clean and independent runs only",
    )
    parser.add_argument("--malicious", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--plain", action="store_true", help="also the clean runs with the plain mean (clean_overhead)")
    parser.add_argument("--jobs", type=int, default=2, help="engine runs at once (separate processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument(
        "--device", default="cpu", help="where every peer's θ trains: cpu, cuda, cuda:N (all runs share the card)"
    )
    parser.add_argument(
        "--matchmaking-s", type=float, default=60.0, help="how long a group waits for the members it expects, s"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a manifest field (TOML value)",
    )
    parser.add_argument(
        "--no-loss-gate",
        action="store_true",
        help="the honest peers' NoLoCo loss gate off (peer/round/loss_gate.py; the malicious peers keep "
        "theirs): what the gate is worth, into an --out of its own",
    )
    parser.add_argument(
        "--overlap-from-round",
        type=int,
        default=0,
        metavar="K",
        help="the overlapped rows' sync.overlap_from_round: rounds 0 to K - 1 sync blocking (where delayed "
        "averaging is worth less than none, a horizon at which it is worth something)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--rewrite",
        action="store_true",
        help="run nothing: write --out and its detail file again from the detail file's runs, with their "
        "commit, device and command (after bench/lying_receipts.py or bench/sybil.py wrote the rows it copies)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DETAIL",
        help="run nothing: write --out and its detail file from these detail files of one commit (separate "
        "invocations: blocking rows, then delayed ones with --overlap-from-round), their runs together",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of earlier invocations at this commit with the same manifest and rounds (read "
        "from the detail file next to --out; runs of another commit are dropped) and run only the others",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    if any(not 1 <= k < PEERS for k in args.malicious):
        parser.error(f"--malicious {args.malicious}: expected counts from 1 to {PEERS - 1}")
    base, bench = load_config(args.config)
    try:
        base = apply_overrides(base, args.set)
    except (ValueError, ManifestError) as exc:
        parser.error(str(exc))
    corpus_or_exit(parser, base.data, args.config)
    start = time.perf_counter()
    commit = git_commit(Path(__file__).resolve().parents[1])
    try:  # what every worker would refuse, refused here with the value named
        if args.overlap_from_round:
            base.replace(sync={"overlap": "delayed", "overlap_from_round": args.overlap_from_round})
        device = device_name(args.jobs, args.threads, args.device)
    except (ManifestError, ConfigError) as exc:
        parser.error(f"--overlap-from-round {args.overlap_from_round} --device {args.device}: {exc}")
    command = " ".join(["python", *sys.argv])
    attacks = [a for a in args.attacks if a != BOGUS]
    # seed-major: an interrupted invocation has every row at the first seed
    work = []
    for s in args.seeds:
        for schedule in args.schedules:
            work.append(
                dict(
                    attack=INDEPENDENT, algorithm="independent", schedule=schedule, malicious=0, seed=s, screening=True
                )
            )
            for algorithm in args.algorithms:
                clean_modes = (True, False) if args.plain else (True,)
                work += [
                    dict(attack=None, algorithm=algorithm, schedule=schedule, malicious=0, seed=s, screening=sc)
                    for sc in clean_modes
                ]
                work += [
                    dict(attack=a, algorithm=algorithm, schedule=schedule, malicious=k, seed=s, screening=True)
                    for a in attacks
                    for k in args.malicious
                ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    detail_path = args.out.with_name(args.out.stem + ".detail.json")
    if args.merge:
        try:
            got = merged([json.loads(p.read_text()) for p in args.merge])
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--merge {' '.join(map(str, args.merge))}: {exc}")
        print(markdown(write_results(args.out, got.pop("runs"), **got)))
        return
    if args.rewrite:
        if not detail_path.exists():
            parser.error(f"--rewrite: {detail_path} does not exist: run the benchmark first")
        earlier = json.loads(detail_path.read_text())
        summary = write_results(
            args.out,
            earlier["runs"],
            commit=earlier["commit"],
            device=earlier["device"],
            command=earlier["command"],
            rounds=earlier["rounds"],
            inner_steps=earlier["horizon"]["inner_steps"],
            overlap_from_round=earlier["horizon"].get("overlap_from_round", 0),
            config=earlier["config"],
            complete=earlier["complete"],
            announcements=earlier.get("announcements", []),
            wall_s=earlier.get("wall_s_total", 0.0),
        )
        print(markdown(summary))
        return
    config = json.loads(
        json.dumps(
            {
                **manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds).to_dict(),
                "bench": bench,
                **({"loss_gate": False} if args.no_loss_gate else {}),
                **({"overlap_from_round": args.overlap_from_round} if args.overlap_from_round else {}),
            }
        )
    )
    runs: list[dict] = []
    if args.resume and detail_path.exists():
        try:
            runs, dropped = resumable(json.loads(detail_path.read_text()), commit=commit, config=config)
        except ValueError as exc:
            parser.error(f"--resume: {detail_path}: {exc}")
        print(
            f"kept {len(runs)} run(s) of {commit} from {detail_path}, left out {dropped} of other commits", flush=True
        )
        if runs:  # the invocations whose runs this one keeps come first in its command
            earlier_command = json.loads(detail_path.read_text()).get("command")
            if earlier_command and command not in earlier_command.split(" && "):
                command = f"{earlier_command} && {command}"
    announcements: list[dict] = []
    if BOGUS in args.attacks:
        from bench.byzantine_announce import announcement_attack

        for malicious in args.malicious:
            announcements += announcement_attack(
                manifest_for(base, "diloco", PEERS, 0, bench["global_batch_tokens"], args.rounds), malicious=malicious
            )
    done = {_key(r) for r in runs}
    todo = [w for w in work if _key(w) not in done]

    def write() -> dict:
        return write_results(
            args.out,
            runs,
            commit=commit,
            device=device,
            command=command,
            rounds=args.rounds,
            inner_steps=base.sync.inner_steps,
            overlap_from_round=args.overlap_from_round,
            config=config,
            complete={_key(w) for w in work} <= {_key(r) for r in runs},
            announcements=announcements,
            wall_s=time.perf_counter() - start,
        )

    # a pool whose workers end with this process: SIGTERM (`timeout`, kill) raises here and the
    # finally terminates them (a ProcessPoolExecutor's spawned workers outlived a killed parent)
    signal.signal(signal.SIGTERM, _stop)
    pool = multiprocessing.get_context("spawn").Pool(max(1, args.jobs))
    try:
        tasks = [
            (
                base,
                bench,
                dict(
                    rounds=args.rounds,
                    threads=args.threads,
                    matchmaking_s=args.matchmaking_s,
                    loss_gate=not args.no_loss_gate,
                    device=args.device,
                    overlap_from_round=args.overlap_from_round,
                    **w,
                ),
            )
            for w in todo
        ]
        for r in pool.imap_unordered(_train_task, tasks):
            r["commit"] = commit
            runs.append(r)
            print(
                f"{r['attack']} {r['algorithm']} {r['schedule']} ({r['malicious']} malicious, screening "
                f"{'on' if r['screening'] else 'off'}) seed {r['seed']}: {r['final_bpb']:.4f} bpb, "
                f"adopted forged {r['adopted_forged']}, non-finite rounds {r['non_finite_rounds']}, "
                f"exits {r['honest_exits']}, {r['counts']} ({r['wall_s']:.0f} s)",
                flush=True,
            )
            write()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
    summary = write()
    print()
    print(markdown(summary))
    print(f"\nwrote {args.out} and {detail_path}; total wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
