"""docs/results.md's first table, "The answers now" (issue #66 item 4): one line per question a user
asks (quality against data-parallel, overlap, codecs, robustness, throughput, catch-up, memory,
data), its current answer computed from bench/results/*.json, its goal and the file it comes from.

Each question is a function of ``data`` (a result file's name without ``.json`` → its parsed JSON,
files not there absent) returning an :class:`Answer`. It picks the rows the question is about and
formats their figures (3 to 4 significant figures); nothing here is a measured number. Where a file,
or the rows the question needs, is missing, the answer is :data:`NOT_MEASURED`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.residual_precision import GOAL_PCT as RESIDUAL_GOAL_PCT  # noqa: E402
from protocol.specs import SyncSpec  # noqa: E402

__all__ = ["NOT_MEASURED", "QUESTIONS", "Answer", "answers", "load", "section"]

NOT_MEASURED = "not measured yet"
Data = Mapping[str, Any]
"""A result file's name without ``.json`` → its parsed JSON."""


class NotMeasured(Exception):
    """The file, or the rows a question needs, is not there."""


@dataclass(frozen=True)
class Answer:
    question: str
    answer: str
    goal: str
    source: str


# --- formatting ---------------------------------------------------------------------------------


def num(x: float, sig: int = 3) -> str:
    """``x`` to ``sig`` significant figures, thousands separated, no exponent."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    digits = sig - 1 - math.floor(math.log10(abs(x)))
    if digits <= 0:
        return f"{round(x, digits):,.0f}"
    return f"{x:,.{digits}f}"


def pct(x: float, sig: int = 3) -> str:
    """A change in percent with its sign: ``+3.62 %``, ``−1.68 %``."""
    return ("+" if x > 0 else "−" if x < 0 else "") + num(abs(x), sig) + " %"


def share(x: float) -> str:
    """A fraction as a percentage without a sign: ``51.6 %``."""
    return num(100 * x) + " %"


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def short_commit(commit: Any) -> str:
    if not isinstance(commit, str) or not commit:
        return ""
    head, _, rest = commit.partition("-")
    return head[:7] + (f"-{rest}" if rest else "")


def source(data: Data, *names: str) -> str:
    """The files an answer reads, each with its commit where it names one; a missing file is said so
    (not named as a path: docs name only files that exist)."""
    cells = []
    for name in names:
        d = data.get(name)
        if d is None:
            cells.append(f"no `{name}.json` yet")
            continue
        commit = short_commit(d.get("commit")) if isinstance(d, dict) else ""
        cells.append(f"`bench/results/{name}.json`" + (f" at {commit}" if commit else ""))
    return ", ".join(cells)


def need(data: Data, name: str) -> dict:
    d = data.get(name)
    if not isinstance(d, dict):
        raise NotMeasured(name)
    return d


def rows_of(d: dict, key: str) -> list[dict]:
    rows = d.get(key)
    if not isinstance(rows, list):
        raise NotMeasured(key)
    return [r for r in rows if isinstance(r, dict)]


def one(rows: Sequence[dict], **match: Any) -> dict:
    """The row whose keys equal ``match``; NotMeasured when none does."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise NotMeasured(str(match))


def has(rows: Sequence[dict], method: str, peers: int) -> bool:
    return any(r.get("method") == method and r.get("peers") == peers for r in rows)


# --- the questions ------------------------------------------------------------------------------

COMPARE_FILES = ("compare-cpu-32k", "compare-cpu-32k-engine")


def quality(data: Data) -> Answer:
    """DiLoCo and NoLoCo against data-parallel at equal tokens (cpu-32k): % above it, and the share of
    the floor (independent) to ceiling (data-parallel) gap recovered."""
    name = next((n for n in COMPARE_FILES if n in data), COMPARE_FILES[0])
    question, goal = "quality: loss above data-parallel (cpu-32k, equal tokens)", "data-parallel's loss at equal tokens"

    def text() -> str:
        rows = rows_of(need(data, name), "results")
        peers = sorted({r["peers"] for r in rows if r.get("method") == "data-parallel"})
        parts, recovered_by = [], []
        for method, label in (("diloco", "DiLoCo"), ("noloco", "NoLoCo")):
            above, recovered = [], []
            for n in peers:
                dp = one(rows, method="data-parallel", peers=n)["final_bpb"]
                m = one(rows, method=method, peers=n)["final_bpb"] if has(rows, method, n) else None
                floor = one(rows, method="independent", peers=n)["final_bpb"] if has(rows, "independent", n) else None
                above.append("–" if m is None else pct(100 * (m / dp - 1)))
                if m is not None and floor is not None and floor > dp:
                    recovered.append(share((floor - m) / (floor - dp)))
            if any(x != "–" for x in above):
                parts.append(f"{label} {' / '.join(above)}")
            if len(recovered) == len(peers):
                recovered_by.append(f"{label} {' / '.join(recovered)}")
        if not parts:
            raise NotMeasured(name)
        n = " / ".join(map(str, peers))
        gap = f"; share of the gap from independent peers recovered: {', '.join(recovered_by)}" if recovered_by else ""
        return f"N = {n}: {', '.join(parts)}{gap}"

    return answered(question, goal, text, source(data, name))


OVERLAP_FILE = "overlap_cpu32k"
SYNC_DEFAULTS = {f.name: f.default for f in fields(SyncSpec)}


def overlap(data: Data) -> Answer:
    """Delayed and streaming DiLoCo against blocking at equal tokens, N = 4 (cpu-32k): streaming's
    rows at the default α and merge rule that overlap at least one step (τ ≥ 1)."""
    d = data.get(OVERLAP_FILE)
    goal = d.get("goal") if isinstance(d, dict) and isinstance(d.get("goal"), str) else "—"
    question = "overlap: loss against blocking (cpu-32k, equal tokens)"

    def text() -> str:
        rows = rows_of(need(data, OVERLAP_FILE), "quality")
        peers = 4 if any(r.get("peers") == 4 for r in rows) else min(r["peers"] for r in rows)
        rows = [r for r in rows if r.get("peers") == peers and r.get("method", "diloco") == "diloco"]
        parts = [f"delayed {pct(r['vs_none'])}" for r in rows if r.get("overlap") == "delayed"]
        streaming = []
        for r in rows:
            s = r.get("streaming") or {}
            if (
                r.get("overlap") == "streaming"
                and s.get("fragment_delay_steps", SYNC_DEFAULTS["fragment_delay_steps"]) >= 1
                and s.get("fragment_alpha", SYNC_DEFAULTS["fragment_alpha"]) == SYNC_DEFAULTS["fragment_alpha"]
                and s.get("fragment_merge", SYNC_DEFAULTS["fragment_merge"]) == SYNC_DEFAULTS["fragment_merge"]
            ):
                streaming.append((r["vs_none"], s.get("fragment_delay_steps", SYNC_DEFAULTS["fragment_delay_steps"])))
        if streaming:
            (lo, lo_tau), (hi, hi_tau) = min(streaming), max(streaming)
            parts.append(
                f"streaming {pct(lo)} (τ = {lo_tau})" + ("" if len(streaming) == 1 else f" to {pct(hi)} (τ = {hi_tau})")
            )
        if not parts:
            raise NotMeasured(OVERLAP_FILE)
        return f"DiLoCo, N = {peers}: " + ", ".join(parts) + " above blocking"

    return answered(question, goal, text, source(data, OVERLAP_FILE))


CODECS = ("int8", "int4", "fp4")


def codecs(data: Data) -> Answer:
    """The lossy codecs on a real pseudo-gradient (input (b)): bytes against fp32 and relative error."""
    question, goal = "codecs: size and error on a real pseudo-gradient", "—"

    def text() -> str:
        inputs = need(data, "codecs").get("inputs")
        if not isinstance(inputs, dict):
            raise NotMeasured("inputs")
        real = next((rows for k, rows in inputs.items() if k.startswith("(b)")), None)
        if not isinstance(real, list):
            raise NotMeasured("(b)")
        parts = []
        for codec in CODECS:
            r = next((r for r in real if r.get("codec") == codec), None)
            if r is not None:
                parts.append(f"{codec} {num(r['ratio'])}× smaller, {share(r['rel_error'])} error")
        if not parts:
            raise NotMeasured("codecs")
        return "against fp32: " + "; ".join(parts)

    return answered(question, goal, text, source(data, "codecs"))


RESIDUAL_FILE = "residual-precision"


def residual_precision(data: Data) -> Answer:
    """Error-feedback residuals kept in bf16 against fp32: the loss change (DiLoCo, cpu-32k)."""
    d = data.get(RESIDUAL_FILE)
    goal_pct = d.get("goal_pct", RESIDUAL_GOAL_PCT) if isinstance(d, dict) else RESIDUAL_GOAL_PCT
    question, goal = "error-feedback residuals in bf16: loss cost", f"≤ +{goal_pct:g} %"

    def text() -> str:
        r = need(data, RESIDUAL_FILE)
        change = r["bf16_vs_fp32_pct"]
        met = r.get("met", change <= goal_pct)
        setting = ["DiLoCo"]
        if r.get("codec"):
            setting.append(str(r["codec"]))
        if "peers" in r:
            setting.append(f"N = {r['peers']}")
        setting_text = ", ".join(setting)
        return f"{pct(change)} against fp32 residuals ({setting_text}): {verdict(bool(met))}"

    return answered(question, goal, text, source(data, RESIDUAL_FILE))


NOT_ATTACKS = {"clean", "independent"}
ATTACK_GOALS = {1: (0.015, 1 / 3), 2: (0.03, 1 / 2)}
"""Issue #65 item 4 per malicious count (bench/byzantine.py's ``GOALS`` too): the most a row's loss change
may be, and the largest share of never averaging's cost; more malicious peers are held to 2's."""
"""The security issue's goal: an attack costs less than this share of never averaging's cost."""


ROBUSTNESS_FILES = (
    "byzantine-h10",
    "byzantine-noloco-h20",
    "byzantine-diloco-h20",
    "byzantine-delayed-h20",
    "byzantine-delayed-h20-gated",
    "byzantine",
)
"""The Byzantine results, each at its own horizon and schedule; where two measure the same setting
(algorithm, schedule, N, attack, malicious peers, horizon), the later one's row counts."""
MIN_FLOOR = 0.03
"""A row is judged only where never averaging costs at least this (issue #65: a horizon where averaging
is worth ≥ 3 %); elsewhere no defence can be told from none."""


def robustness(data: Data) -> Answer:
    """Malicious peers: per algorithm, the attack row furthest from its goal (:data:`ATTACK_GOALS`: its
    share of never averaging's cost, the ``independent`` row of the same algorithm, schedule and N, and
    of the same file, over its goal's share), over every file of :data:`ROBUSTNESS_FILES` and every
    schedule where never averaging costs at least :data:`MIN_FLOOR`."""
    question = "robustness: malicious peers' loss cost"
    goal = "1 of 8 < ⅓ of never averaging's cost and ≤ +1.5 %, 2 of 8 < ½ and ≤ +3 %"

    def text() -> str:
        need(data, "byzantine")
        judged: dict[tuple, tuple[float, dict, float, dict]] = {}  # a row's setting -> (ratio, row, floor, file)
        for name in ROBUSTNESS_FILES:  # a later file's row replaces an earlier one's of the same setting
            d = data.get(name)
            if not isinstance(d, dict):
                continue
            rows = rows_of(d, "results")
            horizon = d.get("horizon") if isinstance(d.get("horizon"), dict) else {}
            floors = {
                (r.get("algorithm"), r.get("schedule"), r.get("peers")): r["loss_change"]
                for r in rows
                if r.get("attack") == "independent" and isinstance(r.get("loss_change"), float)
            }
            for r in rows:
                ind = floors.get((r.get("algorithm"), r.get("schedule"), r.get("peers")))
                if r.get("attack") in NOT_ATTACKS or ind is None or ind < MIN_FLOOR or r.get("loss_change") is None:
                    continue
                setting = (
                    *(r.get(k) for k in ("algorithm", "schedule", "peers", "attack", "malicious")),
                    *(horizon.get(k) for k in ("rounds", "inner_steps", "overlap_from_round")),
                )
                judged[setting] = (r["loss_change"] / ind, r, ind, d)

        def goal_of(r: dict) -> tuple[float, float]:
            return ATTACK_GOALS.get(r.get("malicious"), ATTACK_GOALS[2])

        worst: dict[str, tuple[float, dict, float, dict]] = {}  # algorithm -> the row furthest from its goal
        for ratio, r, ind, d in judged.values():
            if (
                r["algorithm"] not in worst
                or ratio / goal_of(r)[1] > worst[r["algorithm"]][0] / goal_of(worst[r["algorithm"]][1])[1]
            ):
                worst[r["algorithm"]] = (ratio, r, ind, d)
        parts = []
        for algorithm, (ratio, r, ind, d) in worst.items():
            bound, most = goal_of(r)
            label = {"diloco": "DiLoCo", "noloco": "NoLoCo"}.get(algorithm, algorithm)
            horizon = d.get("horizon") or {}
            at = f" at {horizon['rounds']} rounds" if isinstance(horizon, dict) and "rounds" in horizon else ""
            if r.get("schedule", "none") != "none":
                start = horizon.get("overlap_from_round") if isinstance(horizon, dict) else None
                at += f", {r['schedule']}" + (f" from round {start}" if start else "")
            seeds = r.get("seeds")
            if isinstance(seeds, int) and seeds < 3:
                at += f", {seeds} seed{'s' if seeds > 1 else ''}"
            parts.append(
                f"{label}{at} {r['attack']} {r['malicious']} of {r['peers']} {pct(100 * r['loss_change'])} against "
                f"{pct(100 * ind)} ({share(ratio)}: {verdict(ratio < most and r['loss_change'] <= bound)})"
            )
        if not parts:
            raise NotMeasured("byzantine")
        return "worst row against never averaging: " + "; ".join(parts)

    return answered(question, goal, text, source(data, *(n for n in ROBUSTNESS_FILES if n in data)))


THROUGHPUT_PRESET = "llama-125m-L2"
THROUGHPUT_GOAL = 0.99
THROUGHPUT_UPLINK = 100.0
SCHEDULES = {"none": "blocking"}


def throughput(data: Data) -> Answer:
    """Utilization (swarm tokens/s in rounds that averaged with ≥ 1 other peer over no-sync tokens/s, the
    mean group size beside it) of llama-125m cut to 2 blocks on the rig, at
    the goal's uplink (else the slowest recorded), the fewest peers recorded there."""
    question, goal = (
        "throughput: utilization on the rig",
        f"≥ {100 * THROUGHPUT_GOAL:g} % with overlap at {THROUGHPUT_UPLINK:g} Mbit/s",
    )

    def text() -> str:
        rows = [r for r in rows_of(need(data, "rig125m"), "results") if r.get("preset") == THROUGHPUT_PRESET]
        rows = [r for r in rows if isinstance(r.get("utilization"), int | float)]
        if not rows:
            raise NotMeasured(THROUGHPUT_PRESET)
        uplinks = {r["uplink_mbit"] for r in rows}
        uplink = THROUGHPUT_UPLINK if THROUGHPUT_UPLINK in uplinks else min(uplinks)
        peers = min(r["peers"] for r in rows if r["uplink_mbit"] == uplink)
        rows = [r for r in rows if r["uplink_mbit"] == uplink and r["peers"] == peers]
        cells = [
            f"{SCHEDULES.get(r['overlap'], r['overlap'])} {share(r['utilization'])}"
            + (f" (mean group {r['mean_group_size']:.2f})" if isinstance(r.get("mean_group_size"), int | float) else "")
            for r in rows
        ]
        overlapped = [r["utilization"] for r in rows if r["overlap"] != "none"]
        met = f": {verdict(max(overlapped) >= THROUGHPUT_GOAL)}" if overlapped and uplink == THROUGHPUT_UPLINK else ""
        codec = rows[0].get("codec", "")
        return f"llama-125m cut to 2 blocks, {peers} peers, {num(uplink)} Mbit/s, {codec}: " + ", ".join(cells) + met

    return answered(question, goal, text, source(data, "rig125m"))


RESTART_GOAL_S = 15.0
SILENCE_GOAL_S = 5.0
JOIN_GOAL_S = 60.0
JOIN_UPLINK = 1000.0


def catch_up(data: Data) -> Answer:
    """A restart's first round, the longest silence of any command (bench/waits.py), and a joiner's
    first step at 1 Gbit/s (bench/rig125m.py ``catch_up``) where recorded."""
    question, goal = (
        "catch-up: restart, silence, joiner",
        f"restart ≤ {RESTART_GOAL_S:g} s; silence ≤ {SILENCE_GOAL_S:g} s; joiner ≤ {JOIN_GOAL_S:g} s at 1 Gbit/s",
    )

    def text() -> str:
        w = need(data, "waits")
        restart = w["restart_first_round_s"]
        commands = w["commands"]
        name, silence = max(((k, c["longest_silence_s"]) for k, c in commands.items()), key=lambda kv: kv[1])
        parts = [
            f"restart's first round {num(restart)} s ({verdict(restart <= RESTART_GOAL_S)})",
            f"longest silence {num(silence)} s, `{name}` ({verdict(silence <= SILENCE_GOAL_S)})",
        ]
        rig = data.get("rig125m")
        joins = [
            c
            for c in ((rig.get("catch_up") or []) if isinstance(rig, dict) else [])
            if isinstance(c, dict) and c.get("uplink_mbit") == JOIN_UPLINK and c.get("preset") == THROUGHPUT_PRESET
        ]
        if joins:
            s = joins[-1]["seconds"]
            parts.append(f"joiner's first step {num(s)} s ({verdict(s <= JOIN_GOAL_S)})")
        return "; ".join(parts)

    names = ("waits", "rig125m") if isinstance(data.get("rig125m"), dict) and "waits" in data else ("waits",)
    return answered(question, goal, text, source(data, *names))


MEMORY_PRESET = "llama-125m"
MEMORY_MODELS = 3.5
MEMORY_EXTRA_MIB = 1024.0


def memory(data: Data) -> Answer:
    """Peak PSS per peer (its processes together) of the full llama-125m, the newest row per schedule,
    against the goal of 3.5 fp32 models and 1 GiB."""
    question, goal = (
        "memory per peer (full llama-125m)",
        f"≤ {MEMORY_MODELS:g} × the fp32 model + {MEMORY_EXTRA_MIB / 1024:g} GiB",
    )

    def text() -> str:
        rows = [r for r in rows_of(need(data, "rig125m-memory"), "results") if r.get("preset") == MEMORY_PRESET]
        newest: dict[str, dict] = {}
        for r in rows:  # the file appends: the last row of a schedule is its newest
            if isinstance(r.get("rss_mib"), int | float) and isinstance(r.get("model_fp32_mib"), int | float):
                newest[r.get("overlap", "none")] = r
        if not newest:
            raise NotMeasured(MEMORY_PRESET)
        model = next(iter(newest.values()))["model_fp32_mib"]
        goal = MEMORY_MODELS * model + MEMORY_EXTRA_MIB
        cells = [
            f"{SCHEDULES.get(k, k)} {num(r['rss_mib'], 4)} MiB ({num(r['rss_mib'] / r['model_fp32_mib'])}×"
            + (f", {short_commit(r['commit'])})" if r.get("commit") else ")")
            for k, r in newest.items()
        ]
        worst = max(r["rss_mib"] for r in newest.values())
        peers = next(iter(newest.values()))["peers"]
        return f"{peers} peers, peak PSS: {', '.join(cells)} of a {num(model, 4)} MiB model; goal {num(goal, 4)} MiB: {verdict(worst <= goal)}"

    return answered(question, goal, text, source(data, "rig125m-memory"))


def data_stream(data: Data) -> Answer:
    """A real corpus over HTTP: the large corpus's first-step seconds and peak RSS against the small's."""
    question, goal = "data: a large corpus against a small one", "—"

    def text() -> str:
        corpora = {c.get("name"): c for c in rows_of(need(data, "data_stream"), "corpora")}
        large, small = corpora["large"], corpora["small"]
        t_l, t_s = large["time_to_first_step_s"], small["time_to_first_step_s"]
        m_l, m_s = large["peak_rss_mib"], small["peak_rss_mib"]
        text_ratio = large["text_bytes"] / small["text_bytes"]
        return (
            f"{num(text_ratio)}× the text: first step {num(t_l)} s against {num(t_s)} s ({num(t_l / t_s)}×), "
            f"peak RSS {num(m_l, 4)} against {num(m_s, 4)} MiB ({num(m_l / m_s)}×)"
        )

    return answered(question, goal, text, source(data, "data_stream"))


def answered(question: str, goal: str, text: Callable[[], str], src: str) -> Answer:
    """``question`` with the answer ``text`` computes, or :data:`NOT_MEASURED` where a file or its
    rows are missing."""
    try:
        answer = text()
    except (NotMeasured, KeyError, TypeError, ValueError, ZeroDivisionError):
        answer = NOT_MEASURED
    return Answer(question, answer, goal, src)


QUESTIONS: tuple[Callable[[Data], Answer], ...] = (
    quality,
    overlap,
    codecs,
    residual_precision,
    robustness,
    throughput,
    catch_up,
    memory,
    data_stream,
)


def load(results: Path) -> dict[str, Any]:
    """Every ``results/*.json``, parsed, by its name without ``.json``."""
    return {p.name.removesuffix(".json"): json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def answers(data: Data) -> list[Answer]:
    return [q(data) for q in QUESTIONS]


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(data: Data) -> list[str]:
    """docs/results.md's "The answers now": a heading, a sentence and one table row per question."""
    lines = [
        "## The answers now",
        "",
        "One line per question: the current answer, computed by bench/results_questions.py from the result",
        "file it names, and its goal; the sections below have the detail.",
        "",
        "| question | current answer | goal | source |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {cell(a.question)} | {cell(a.answer)} | {cell(a.goal)} | {a.source} |" for a in answers(data)]
    return [*lines, ""]
