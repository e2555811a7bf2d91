"""`peer status`: what a swarm looks like from its progress records, without training.

Starts a client-mode DHT node (it accepts no connections and stores nothing for others), reads
the announced runs, each run's manifest and progress records (validated by
``ProgressRecord.from_wire``), prints them and leaves. A peer is shown live while its latest
record is younger than protocol/liveness.py's bound (about one round's deadline), not until the
record expires; the swarm totals count live peers only.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from peer.net import dht as swarm_dht, dht_node
from peer.net.devices import DeviceRecord, read_devices
from peer.net.traffic import describe_caps
from peer.progress import Waiting
from peer.reporting import format_bytes
from protocol import liveness
from protocol.errors import LocoError, ManifestNotFound

if TYPE_CHECKING:
    from rich.console import JustifyMethod

logger = logging.getLogger(__name__)


def _manifest_or_none(dht, run_id: str):
    try:
        return swarm_dht.fetch_manifest(dht, run_id)
    except LocoError as exc:  # not announced any more, or a manifest we do not accept
        logger.debug("no manifest for run %s: %s", run_id, exc)
        return None


def _devices_or_empty(dht, run_id: str, peers=()) -> dict:
    try:
        return read_devices(dht, run_id, prefer={p.peer_id for p in peers})  # peers with records first
    except LocoError as exc:  # the DHT did not answer in time: the table shows no devices
        logger.debug("no device records for run %s: %s", run_id, exc)
        return {}


def collect_status(dht, run_id: str | None = None, *, wait_s: float = 5.0) -> dict[str, Any]:
    """The swarm's runs and their peers' latest records, as JSON-able data.

    Args:
        run_id: only this run; None: every run the swarm announces.
        wait_s: a node that just joined may not find the records at once; retry this long
            while nothing is found.

    Returns:
        ``{"time": s, "runs": [{"run_id", "name", "live_peers", "tokens_per_s" (live peers' sum),
        "peers": [{"peer_id", "live", "age_s", "stale_after_s", "round", "inner_step",
        "train_loss", "eval_loss", "eval_round", "tokens_per_s", "group_size", "bytes_sent",
        "bytes_received", "expires_in_s", "device", "caps"}]}]}`` (``eval_round``: the round whose φ
        ``eval_loss`` was measured at, or null without one; ``caps``: a peer's use against its own caps,
        protocol/records.py, or null), peers sorted by round (highest first). ``age_s`` is how long ago
        the record was published and ``stale_after_s`` the bound it is held against
        (protocol/liveness.py); both are null when the run's manifest cannot be read, and then
        every peer with an unexpired record counts as live.

    Raises:
        ManifestNotFound: ``run_id`` was given and the swarm has no record of it.
    """
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + wait_s
    while True:
        runs = swarm_dht.list_runs(dht)
        if run_id is not None:
            runs = {run_id: runs.get(run_id, "?")}
        found = {rid: swarm_dht.read_progress(dht, rid) for rid in runs}
        if any(found.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if run_id is not None and not found.get(run_id) and runs.get(run_id) == "?":
        raise ManifestNotFound(
            f"the swarm has no run {run_id} (no announcement, no progress records); "
            "run `peer status` without --run-id to list the runs"
        )
    out = []
    for rid, name in sorted(runs.items()):
        manifest = _manifest_or_none(dht, rid) if found.get(rid) else None
        devices = _devices_or_empty(dht, rid, found[rid]) if found.get(rid) else {}
        now = get_dht_time()
        peers = []
        for item in found.get(rid, []):
            r = item.record
            verdict = None if manifest is None else liveness.judge(r, item.expiration, now, manifest)
            peers.append(
                {
                    "peer_id": item.peer_id,
                    "live": verdict is None or verdict.live,
                    "age_s": None if verdict is None else verdict.age_s,
                    "stale_after_s": None if verdict is None else verdict.stale_after_s,
                    "round": r.round,
                    "inner_step": r.inner_step,
                    "train_loss": r.train_loss,
                    "eval_loss": r.eval_loss,
                    # a record carries the validation loss of φ at its own round only (peer/round/publishing.py)
                    "eval_round": None if r.eval_loss is None else r.round,
                    "tokens_per_s": r.tokens_per_s,
                    "group_size": r.group_size,
                    "bytes_sent": r.bytes_sent,
                    "bytes_received": r.bytes_received,
                    "expires_in_s": max(0.0, item.expiration - now),
                    "device": None if item.peer_id not in devices else devices[item.peer_id].to_wire(),
                    "caps": r.caps,
                }
            )
        peers.sort(key=lambda p: (-p["round"], -p["inner_step"], p["peer_id"]))
        live = [p for p in peers if p["live"]]
        out.append(
            {
                "run_id": rid,
                "name": name,
                "live_peers": len(live),
                "tokens_per_s": sum(p["tokens_per_s"] for p in live),
                "peers": peers,
            }
        )
    return {"time": time.time(), "runs": out}


def status_console(stream: TextIO | None = None):
    """The rich Console ``peer status`` prints its tables on: a terminal's width on a terminal; piped
    or redirected (a file, ``less``, ``grep``), wide enough that no column is squeezed or cut (rich
    would otherwise fit the table to 80 columns)."""
    from rich.console import Console

    console = Console(file=stream, soft_wrap=True)
    if not console.is_terminal:
        console = Console(file=stream, soft_wrap=True, width=PIPED_WIDTH)
    return console


PIPED_WIDTH = 1000
"""Columns ``peer status`` may use when its output is not a terminal: more than any table needs
(a table takes its natural width, not this one)."""


def loss_at(loss: float | None, round_: int | None, digits: int = 4) -> str:
    """A loss with the round it was measured at, ``2.4113 @ r12``; ``-`` without one."""
    if loss is None:
        return "-"
    return f"{loss:.{digits}f}" + ("" if round_ is None else f" @ r{round_}")


def median_round(peers: Sequence[dict[str, Any]]) -> int | None:
    """The swarm's round: the median of the live peers' rounds (the lower middle one of an even
    count, so it is a round some peer is at), None without a live peer. Not the maximum: one peer
    alone ahead (a capped or partitioned one) does not move it."""
    rounds = [p["round"] for p in peers if p["live"]]
    return statistics.median_low(rounds) if rounds else None


def print_status(status: dict[str, Any], console) -> None:
    """One rich table per run: peers (live or gone), device, rounds, losses, throughput, group, bytes.

    Every string from the network (run ids and names, peer ids, device names) reaches rich as a
    :class:`rich.text.Text`, never as markup: a run named ``[/]`` or ``[link=…]`` is printed as it
    is, not parsed (a ``MarkupError``, an injected hyperlink).
    """
    from rich.table import Table
    from rich.text import Text

    if not status["runs"]:
        console.print("the swarm announces no run and no peer published progress yet")
        return
    for run in status["runs"]:
        peers = run["peers"]
        gone = len(peers) - run["live_peers"]
        title = f"run {run['run_id']} ({run['name']}): {run['live_peers']} live peer(s)"
        table = Table(title=Text(title + (f", {gone} gone" if gone else "")))
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("peer id", "left"),
            ("status", "left"),
            ("device", "left"),
            ("round", "right"),
            ("inner step", "right"),
            ("train loss", "right"),
            ("val loss @ round", "right"),
            ("tok/s", "right"),
            ("group", "right"),
            ("sent", "right"),
            ("received", "right"),
            ("record age", "right"),
        )
        capped = any(p.get("caps") for p in peers)  # the caps column only where a peer has caps
        if capped:
            columns += (("caps (use/cap)", "left"),)
        for column, justify in columns:
            table.add_column(column, justify=justify)
        for p in peers:
            caps_cell = (Text(describe_caps(p.get("caps")) or "-"),) if capped else ()
            table.add_row(
                Text(p["peer_id"]),
                "live" if p["live"] else "gone",
                Text(device_text(p["device"])),
                str(p["round"]),
                str(p["inner_step"]),
                f"{p['train_loss']:.3f}",
                loss_at(p["eval_loss"], p.get("eval_round", p["round"])),
                f"{p['tokens_per_s']:,.0f}",
                str(p["group_size"]),
                format_bytes(p["bytes_sent"]),
                format_bytes(p["bytes_received"]),
                "-" if p["age_s"] is None else f"{p['age_s']:.0f} s",
                *caps_cell,
            )
        console.print(table)
        live = [p for p in peers if p["live"]]
        if live:
            low, high = min(p["round"] for p in live), max(p["round"] for p in live)
            spread = f" (rounds {low} to {high})" if low != high else ""
            console.print(
                f"swarm: median round {median_round(peers)}{spread} | {run['tokens_per_s']:,.0f} tok/s "
                f"from {len(live)} live peer(s)",
                markup=False,
                highlight=False,
            )


def device_text(device: dict | None) -> str:
    """A status row's device cell: :meth:`DeviceRecord.describe` of a ``collect_status`` peer's
    ``device`` map, ``-`` when the peer published none."""
    return "-" if device is None else DeviceRecord(**device).describe()


def status(
    initial_peers: Sequence[str], run_id: str | None, *, wait_s: float = 5.0, stream: TextIO | None = None
) -> dict[str, Any]:
    """Join the DHT as a client, collect the status, leave. With ``stream``, says each step on it as
    it starts, and while one lasts, that it still runs (peer/progress.py ``Waiting``).

    Raises:
        BadPeerAddress, BootstrapUnreachable, NetworkError: the swarm cannot be reached.
        ManifestNotFound: ``run_id`` is unknown to the swarm.
    """
    from contextlib import nullcontext

    def step(what: str):
        if stream is None:
            return nullcontext()
        print(f"peer status: {what}", file=stream, flush=True)
        return Waiting(what, stream=stream, every_s=STILL_EVERY_S)

    with step(f"starting a client DHT node, connecting to {len(initial_peers)} initial peer(s)"):
        dht = dht_node.start_dht(initial_peers=initial_peers, client_mode=True)
    try:
        with step("reading the runs and the peers' progress records"):
            return collect_status(dht, run_id, wait_s=wait_s)
    finally:
        dht.shutdown()


STILL_EVERY_S = 4.0
"""Longest silence of ``peer status`` while a step lasts, s."""
