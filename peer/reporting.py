"""What a peer prints: one progress line per round for people, or JSON lines for programs.

Events are plain dicts with an ``event`` key. In ``json`` mode each is one line on stdout (what
``peer swarm`` reads); in ``text`` mode they become the house progress line.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from peer.progress import Waiting


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def round_line(e: Mapping[str, Any]) -> str:
    """``round 12 | loss 2.913 | 1,830 tok/s | group 4 | sync 2.4 s | sent 5.1 MiB | recv 5.1 MiB | peers 7``"""
    line = (
        f"round {e['round']} | loss {e['train_loss']:.3f} | {e['tokens_per_s']:,.0f} tok/s | "
        f"group {e['group_size']} | sync {e['sync_s']:.1f} s | sent {format_bytes(e['bytes_sent'])} | "
        f"recv {format_bytes(e.get('bytes_received', 0))} | peers {e['peers']}"
    )
    if e.get("mfu") is not None:
        line += f" | MFU {100 * e['mfu']:.1f} %"
    if e.get("note"):
        line += f" | {e['note']}"
    return line


def device_text(e: dict[str, Any]) -> str:
    """``cuda:0 (NVIDIA GeForce RTX 3060, 12.0 GiB, sm 8.6, bf16, micro-batch 8 of 32, compiled)``, or
    ``cpu (x86_64, fp32)``: the device part of the ``started`` line."""
    parts = [e.get("device_name")]
    if e.get("device_memory_gib") is not None:
        parts.append(f"{e['device_memory_gib']:.1f} GiB")
    if e.get("compute_capability"):
        parts.append(f"sm {e['compute_capability']}")
    parts.append(e.get("precision"))
    micro, batch = e.get("micro_batch"), e.get("batch_sequences")
    if micro is not None and batch is not None and micro < batch:
        parts.append(f"micro-batch {micro} of {batch}")
    if e.get("compile"):
        parts.append("compiled")
    if e.get("activation_checkpointing"):
        parts.append("activations recomputed")
    detail = ", ".join(str(p) for p in parts if p)
    return f"{e['device']} ({detail})" if detail else str(e["device"])


class Reporter:
    """Emits events as JSON lines (``fmt='json'``) or human-readable lines (``fmt='text'``).

    With ``live_steps`` (``peer join``), text mode and a terminal on ``stream``, a round's inner steps
    also draw one transient line (:meth:`step`: step k/H, loss, tok/s) between the lines, cleared by
    :meth:`end_steps`; otherwise (a pipe, a log file, JSON) nothing more than one line per round,
    but in text mode, until the first round's line, one every 4 s (:meth:`tick_until_first_round`).
    """

    _steps: Any = None
    """The rich Progress drawing the inner steps while it is live (None: not drawn)."""
    _live_steps = False
    _ticker: Any = None
    """The ``Waiting`` saying that the first round still trains (:meth:`tick_until_first_round`)."""
    _step_text = ""
    """The inner step last reported (``inner step 7 of 20``), for the ticker's line."""

    def __init__(self, fmt: str = "text", stream: TextIO | None = None, *, live_steps: bool = False):
        self.fmt, self.stream = fmt, stream or sys.stdout
        self._lock = threading.Lock()  # the round loop and its sync thread both emit: whole lines
        self._live_steps = live_steps and fmt == "text" and _is_terminal(self.stream)

    def emit(self, event: str, **fields: Any) -> None:
        if event in ("round", "adopted_state", "stopped"):
            self.stop_ticking()
        record = {"event": event, "time": time.time(), **fields}
        if self.fmt == "json":
            text: str | None = json.dumps(record)
        else:
            text = self._text(record)
            if text is None:
                return
        with self._lock:
            if self._steps is not None:  # above the live line, which is drawn again below it
                self._steps.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
            else:
                print(text, file=self.stream, flush=True)

    def step(self, *, round_: int, step: int, steps: int, loss: float, tokens_per_s: float) -> None:
        """Draw the inner step just done (``step`` of ``steps`` in the round after ``round_``; its
        training loss in nats per token; the round's tokens per second so far) on the live line,
        started at the first one. Nothing unless live steps are on (see the class)."""
        self._step_text = f"inner step {step} of {steps}"
        if not self._live_steps:
            return
        with self._lock:
            if self._steps is None:
                self._steps = _start_steps(self.stream)
                if self._steps is None:  # another live display holds the terminal: not drawn
                    return
                self._steps.add_task("", total=steps, loss=loss, tps=tokens_per_s, round=round_ + 1)
            task = self._steps.task_ids[0]
            self._steps.update(
                task, completed=step, total=max(steps, step), loss=loss, tps=tokens_per_s, round=round_ + 1
            )

    def tick_until_first_round(self, what: str = "training the first round", *, every_s: float = 4.0) -> None:
        """In text mode off a terminal (a pipe, a log file), say every 4 s on stderr that ``what``
        still runs and at which inner step (``still training the first round: inner step 7 of 20
        (12 s)``), until the first ``round``, ``adopted_state`` or ``stopped`` event: a first round
        on a busy CPU takes minutes, with no line otherwise (issue #68). Nothing on a terminal (the
        live step line says it) nor in JSON (a launcher says it)."""
        if self.fmt != "text" or self._live_steps or self._ticker is not None:
            return
        self._ticker = Waiting(what, every_s=every_s, detail=lambda: self._step_text).__enter__()

    def stop_ticking(self) -> None:
        """End :meth:`tick_until_first_round`'s lines (the first round ended, or the peer stops); idempotent."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.close()  # outside the lock: its thread may be printing

    def end_steps(self) -> None:
        """Clear the live line of the inner steps (the round's inner phase ended); idempotent."""
        with self._lock:
            if self._steps is not None:
                self._steps.stop()
                self._steps = None

    @staticmethod
    def _text(e: dict[str, Any]) -> str | None:
        kind = e["event"]
        if kind == "round":
            return round_line(e)
        if kind == "started":
            lines = [
                (
                    f"locoswarm {e['version']} | peer {e['peer_id']} | device {device_text(e)} | run {e['run_id']} "
                    f"({e['run_name']}, {e['parameters']:,} parameters, H={e['inner_steps']})"
                )
            ]
            lines += [f"  others can join with: peer join --initial-peers {a}" for a in e["maddrs"]]
            if not e["maddrs"]:  # client mode, no relay slot yet: others come in through the initial peers
                lines.append("  others cannot dial this peer directly; they join through the swarm's bootstrap node")
                lines += [
                    f"  reachable through a relay once it grants a slot (about 3 minutes): {a}"
                    for a in e.get("relayed_at") or []
                ]
            return "\n".join(lines)
        if kind == "eval":
            bpb = e.get("bpb")
            return f"eval ({e['when']}) at round {e['round']}: validation loss {e['loss']:.4f} nats/token" + (
                f" ({bpb:.3f} bits/byte)" if bpb is not None else ""
            )
        if kind == "adopted_state":
            why = {
                "behind": "behind the swarm",
                "diverged": "held another state than most peers",
                "raced ahead": "ran ahead of most peers alone",
            }.get(e.get("reason", ""), "")
            donors = sum(1 for n in (e.get("donors") or {}).values() if n)
            return (
                f"re-synced at round {e['round']} (inner step {e['inner_step']}{'; ' + why if why else ''}): "
                f"downloaded φ and outer momentum from {donors} peer(s) in {e['seconds']:.1f} s"
            )
        if kind == "resumed":
            return f"resumed from checkpoint {e['path']} at round {e['round']}, step {e['round_step']} of the round"
        if kind == "stopped":
            return f"stopped after {e['rounds_completed']} round(s); checkpoint {e.get('checkpoint') or 'not written'}"
        if kind == "warning":
            return f"warning: {e['message']}"
        if kind == "status":  # what the peer is doing before its first round (no silent waits)
            return str(e["message"])
        return None


def _is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (as rich decides it: ``isatty``, ``TERM`` etc.)."""
    from rich.console import Console

    return Console(file=stream).is_terminal


def _start_steps(stream: TextIO) -> Any:
    """A started transient rich Progress on ``stream`` for the inner steps, None when another live
    display (a ``Waiting`` spinner) holds the terminal."""
    from rich.console import Console
    from rich.errors import LiveError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("round {task.fields[round]}: inner step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.3f} | {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    try:
        progress.start()
    except LiveError:
        return None
    return progress
