"""A volunteer's daily traffic budget (``peer join --max-gb-per-day``): a ledger of the bytes this
peer sent and received over the last 24 h, kept in its data directory, and the policy that keeps it
within the budget by sitting out syncs.

Counted: what the peer's processes send and receive on the network, sent and received together,
since metered plans count both: the IP bytes of every TCP connection of the peer's process tree, as
the kernel counts them (peer/net/wiremeter.py): the all-reduce, state served and downloaded, NoLoCo's
exchange, matchmaking, the DHT's RPCs, shards served and downloaded (from peers or over HTTP). Not
counted: traffic before the peer joined the swarm (its first DHT contacts), connections between
loopback addresses (no line carries them) and the last second of a connection's bytes before it
closes. On the network-namespace rig the ledger is within 5 % of what the peer's link carried
(tests/chaos/test_day_cap.py). Where the kernel's socket counters cannot be read (not Linux), the
ledger counts the paced streams' bytes instead (peer/net/pacing.py: not the DHT's RPCs, not HTTP
shard downloads, no headers), with a warning at start.

The policy (:func:`decide`), at each sync, from the bytes of the last 24 h (``used``), what the
costliest sync so far took (``cost``: ``used + cost`` is the use as it would stand after this
sync) and the day's pro-rata share (``allowance``: the budget × the part of the day the ledger
covers, at least an hour's):

* ``used + cost ≥ budget``: sit out (the hard cap: no sync takes the day over the budget);
* ``used + cost ≥ allowance``: sit out, except every :data:`MAX_ROUNDS_SAT_OUT` + 1-th round, which
  syncs (with the stronger codec) so that φ does not drift from the swarm for longer, while ``used``
  (before that sync) is under :data:`STALE_SYNC_MARGIN` × allowance (so that those syncs do not
  spend the rest of the day's budget in its first hours): a peer within 5 % of its share syncs at
  least every fifth round, whatever one sync costs;
* else sync; from :data:`STRONGER_AT` × the allowance on, with a stronger codec: this peer's
  contributions and the means it owns go out with peer/sync/pieces.py ``stronger_compression``
  (fp32 and 16-bit runs send int8, int8 runs int4; the wire takes it, encodings being
  self-describing and an owner bounding only their size; other codecs have no stronger one and
  the peer goes on to sit out). In an ``adaptive`` run the upload cap moves the codec already: its
  byte budget is the uplink measured at the last sync, which the pacer bounds.

A sync sat out raises :class:`SatOut` (a :class:`~protocol.errors.GroupNotFound`) from
:meth:`BudgetedTransport.average`: the round engine treats it as a round with no group, but first waits
as the sync would have, until the swarm's round (the median round of the other live peers' records) is
past this one (peer/round/syncing.py ``GroupSync.keep_to_swarm``); then it applies this peer's own Δ
and goes on to the next round, in step with the swarm rather than ahead of it (whose rounds would be
shorter by the matchmaking and all-reduce it skips). The catch-up may then adopt the swarm's state (a
download, counted; refused, like the syncs kept for staleness, past :data:`STALE_SYNC_MARGIN` × the
allowance). In DiLoCo a round sat out leaves this peer's φ apart from the swarm's until such a
download or its next sync; in NoLoCo, whose replicas differ anyway, the next partner exchange pulls it back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from peer.net import pacing, wiremeter
from protocol.errors import GroupNotFound, StateDownloadFailed

logger = logging.getLogger(__name__)

DAY_S = 86400.0
BIN_S = 60.0
"""The ledger's resolution: bytes are kept per minute."""
MIN_SHARE_S = 3600.0
"""The pro-rata allowance never covers less than this part of the day (s): a peer that just started
may spend an hour's share at once."""
STRONGER_AT = 0.5
"""Share of the allowance past which a stronger codec is due (where the run allows one)."""
MAX_ROUNDS_SAT_OUT = 4
"""Rounds in a row a peer over its allowance sits out before it syncs once (while under the budget).
The catch-up (peer/round/catchup.py) adopts the swarm's state as soon as a bigger class holds another
φ, so in DiLoCo every round sat out is a round of this peer's own Δ that the next adoption discards;
NoLoCo keeps it (its partners average φ). Four rounds bound how far φ drifts for either, and a sync
every fifth round still saves 80 % of the sync traffic."""
STALE_SYNC_MARGIN = 1.05
"""How far past the allowance the syncs that keep φ fresh (every ``MAX_ROUNDS_SAT_OUT + 1``-th round)
may take the day's use: 5 % over the pro-rata line, never over the budget."""
LEDGER_FILE = "traffic.json"


class TrafficLedger:
    """Bytes sent and received per minute over the last 24 h, persisted as JSON (``path``).

    Args:
        path: the ledger file; read if present (a file that cannot be read starts an empty ledger,
            with a warning), rewritten atomically at each :meth:`record`.
        clock: wall-clock seconds (``time.time``): the ledger outlives the process.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time):
        self.path, self.clock = Path(path), clock
        self.bins: dict[int, list[int]] = {}
        """Minute (``int(t // BIN_S)``) → [bytes sent, bytes received]."""
        self.first_s = clock()
        """When the ledger began (s since the epoch): the part of the day it covers starts here."""
        self._lock = threading.Lock()
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.first_s = float(data["first_s"])
                self.bins = {int(m): [int(s), int(r)] for m, s, r in data["bins"]}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("traffic ledger %s unreadable (%s): starting an empty one", self.path, exc)
        self._trim()

    def _trim(self) -> None:
        oldest = int((self.clock() - DAY_S) // BIN_S)
        for m in [m for m in self.bins if m <= oldest]:
            del self.bins[m]

    def record(self, sent: int, received: int) -> None:
        """Add bytes sent and received now, and save the ledger."""
        if sent < 0 or received < 0:
            raise ValueError(f"sent = {sent}, received = {received}: byte counts must be >= 0")
        with self._lock:
            m = int(self.clock() // BIN_S)
            row = self.bins.setdefault(m, [0, 0])
            row[0] += sent
            row[1] += received
            self._trim()
            self._save()

    def _save(self) -> None:
        rows = [[m, s, r] for m, (s, r) in sorted(self.bins.items())]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"first_s": self.first_s, "bins": rows}))
        os.replace(tmp, self.path)

    def used(self) -> tuple[int, int]:
        """(bytes sent, bytes received) in the last 24 h."""
        with self._lock:
            self._trim()
            return sum(s for s, _ in self.bins.values()), sum(r for _, r in self.bins.values())

    def covered_s(self) -> float:
        """The part of the last 24 h the ledger covers, s (at most a day)."""
        return min(DAY_S, max(0.0, self.clock() - self.first_s))


def allowance_bytes(budget_bytes: float, covered_s: float) -> float:
    """The day's pro-rata share of ``budget_bytes`` for a ledger covering ``covered_s`` seconds."""
    return budget_bytes * min(1.0, max(covered_s, MIN_SHARE_S) / DAY_S)


def decide(*, used: float, cost: float = 0.0, budget: float, covered_s: float, rounds_sat_out: int) -> str:
    """'sync', 'stronger' (sync, with a stronger codec where the run allows one) or 'sit_out' (see
    the module's docstring). ``used`` (the last 24 h), ``cost`` (what this sync may take) and
    ``budget`` in bytes; ``rounds_sat_out``: in a row, so far."""
    after = used + cost
    if after >= budget:
        return "sit_out"
    allowance = allowance_bytes(budget, covered_s)
    if after >= allowance:  # past the share: the syncs kept against staleness go out stronger too
        stale = rounds_sat_out >= MAX_ROUNDS_SAT_OUT
        return "stronger" if stale and used < STALE_SYNC_MARGIN * allowance else "sit_out"
    return "stronger" if after >= STRONGER_AT * allowance else "sync"


class SatOut(GroupNotFound):
    """This sync was sat out to keep within ``--max-gb-per-day`` (nothing was sent); the round engine
    applies this peer's own Δ after the swarm finished the round (peer/round/syncing.py
    ``GroupSync.keep_to_swarm``)."""


class BudgetedTransport:
    """A round transport (peer/sync/transport.py ``RoundTransport``) whose syncs and state downloads
    follow :func:`decide`; everything else is the wrapped transport's.

    Args:
        transport: the peer's transport.
        ledger: where the bytes go.
        budget_bytes: the day's budget, bytes (> 0).
        pacer: without ``counter``, the bytes are its counters' (:meth:`pacing.Pacer.totals`; default
            :func:`pacing.current`).
        counter: cumulative (bytes sent, bytes received) of this peer, e.g.
            :meth:`wiremeter.WireMeter.totals` (what :func:`budgeted` gives it where it can).
    """

    def __init__(
        self,
        transport,
        ledger: TrafficLedger,
        budget_bytes: float,
        pacer: pacing.Pacer | None = None,
        counter: Callable[[], tuple[int, int]] | None = None,
    ):
        if not budget_bytes > 0:
            raise ValueError(f"budget_bytes = {budget_bytes!r}: must be > 0")
        self._transport, self.ledger, self.budget = transport, ledger, float(budget_bytes)
        if counter is None:
            pacer = pacer if pacer is not None else pacing.current()
            counter = pacer.totals if pacer is not None else None
        self._counter = counter
        self._seen = counter() if counter is not None else (0, 0)
        self._accounting = threading.Lock()
        self.rounds_sat_out = 0
        """Syncs sat out in a row, so far."""
        self.total_sat_out = 0
        self.total_stronger = 0
        """Syncs sent with the stronger codec (peer/sync/pieces.py ``stronger_compression``)."""
        self.last_decision = "sync"
        self.most_sync_bytes = 0
        """The most bytes sent and received during one sync so far: what the next may cost, counted
        against the allowance before it starts (so a sync does not overshoot it; the most, since a
        sync with the stronger codec costs less than one with the run's)."""
        self.last_download_bytes = 0
        """The most bytes a state download took so far (the state's size), counted the same way."""

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def account(self) -> None:
        """Move the bytes the pacer counted since the last call into the ledger (any thread)."""
        if self._counter is None:
            return
        with self._accounting:
            sent, received = self._counter()
            self.ledger.record(sent - self._seen[0], received - self._seen[1])
            self._seen = (sent, received)

    def usage(self) -> dict[str, float]:
        """Today's use against the budget: ``used_gb``, ``budget_gb``, ``allowance_gb``, ``sat_out``."""
        self.account()
        used = sum(self.ledger.used())
        return {
            "used_gb": used / 1e9,
            "budget_gb": self.budget / 1e9,
            "allowance_gb": allowance_bytes(self.budget, self.ledger.covered_s()) / 1e9,
            "sat_out": float(self.total_sat_out),
        }

    def _decision(self) -> str:
        self.account()
        self.last_decision = decide(
            used=sum(self.ledger.used()),
            cost=self.most_sync_bytes,  # what this sync may take: the costliest so far
            budget=self.budget,
            covered_s=self.ledger.covered_s(),
            rounds_sat_out=self.rounds_sat_out,
        )
        return self.last_decision

    def average(self, payload, **kwargs):
        """The wrapped transport's ``average``, or :class:`SatOut` (nothing sent) when this sync is sat out."""
        if self._decision() == "sit_out":
            self.rounds_sat_out += 1
            self.total_sat_out += 1
            u = self.usage()
            raise SatOut(
                f"sat out this sync: {u['used_gb']:.3f} GB sent and received in 24 h, over today's "
                f"share {u['allowance_gb']:.3f} of --max-gb-per-day {u['budget_gb']:g}"
            )
        self.rounds_sat_out = 0
        before = sum(self.ledger.used())
        stronger = self.last_decision == "stronger"
        if stronger:
            self.total_stronger += 1
            if self.total_stronger == 1:
                logger.info(
                    "past %.0f%% of today's share of --max-gb-per-day: sending with a stronger codec where the run has one",
                    100 * STRONGER_AT,
                )
        self._transport.stronger_codec = stronger  # read by the averager's plan for this sync
        try:
            return self._transport.average(payload, **kwargs)
        finally:
            self._transport.stronger_codec = False
            self.account()
            self.most_sync_bytes = max(self.most_sync_bytes, sum(self.ledger.used()) - before)

    def download_state(self, donors, digest_hex: str, timeout_s: float):
        """The wrapped transport's, refused (StateDownloadFailed) where a sync kept for staleness would
        be (past :data:`STALE_SYNC_MARGIN` × the allowance, or the budget): the peer keeps its own φ
        until its use falls back under that line."""
        self.account()
        used = sum(self.ledger.used()) + self.last_download_bytes  # as it would stand after this download
        line = min(self.budget, STALE_SYNC_MARGIN * allowance_bytes(self.budget, self.ledger.covered_s()))
        if used >= line:
            raise StateDownloadFailed(
                f"no state download now: {used / 1e9:.3f} GB sent and received in 24 h, past "
                f"{line / 1e9:.3f} GB of --max-gb-per-day {self.budget / 1e9:g}"
            )
        before = sum(self.ledger.used())
        try:
            return self._transport.download_state(donors, digest_hex, timeout_s)
        finally:
            self.account()
            self.last_download_bytes = max(self.last_download_bytes, sum(self.ledger.used()) - before)


_BUDGET: BudgetedTransport | None = None


def budgeted(transport, data_dir: Path, max_gb_per_day: float | None):
    """``transport`` wrapped in a :class:`BudgetedTransport` with the ledger in ``data_dir``, or
    ``transport`` itself without a budget. The wrapper is what :func:`caps_report` reads. Call it in
    the process that runs ``peer join``, once its DHT runs: the ledger counts the TCP sockets of that
    process and its descendants from then on (a :class:`wiremeter.WireMeter` polled every second by
    a daemon thread), or the pacer's streams where the kernel's counters cannot be read (a warning)."""
    global _BUDGET
    if max_gb_per_day is None:
        return transport
    counter = None
    ok, why = wiremeter.available()
    if ok:
        counter = wiremeter.WireMeter().start().totals  # a daemon thread: it ends with the process
    else:
        logger.warning(
            "--max-gb-per-day counts only the bytes of the peer's paced streams here (%s): not the DHT's "
            "RPCs, HTTP shard downloads or packet headers, so the line carries more than it counts",
            why,
        )
    ledger = TrafficLedger(Path(data_dir) / LEDGER_FILE)
    _BUDGET = BudgetedTransport(transport, ledger, max_gb_per_day * 1e9, counter=counter)
    return _BUDGET


def caps_report() -> dict[str, float] | None:
    """This peer's use against its caps, for its progress record (protocol/records.py ``caps``):
    ``upload_mbit`` (stream bytes while sending, :meth:`Pacer.recent_rate`) and ``upload_cap_mbit``
    with an upload cap; ``day_gb``, ``day_cap_gb``, ``rounds_sat_out``, ``stronger_syncs`` with a
    day's budget. None
    without caps."""
    cap, budget, pacer = pacing.upload_cap_mbit(), _BUDGET, pacing.current()
    if cap is None and budget is None:
        return None
    report: dict[str, float] = {}
    if pacer is not None:
        report["upload_mbit"] = pacer.recent_rate() * 8 / 1e6
    if cap is not None:
        report["upload_cap_mbit"] = cap
    if budget is not None:
        use = budget.usage()
        report.update(
            day_gb=use["used_gb"],
            day_cap_gb=use["budget_gb"],
            rounds_sat_out=float(budget.total_sat_out),
            stronger_syncs=float(budget.total_stronger),
        )
    return report


def describe_caps(caps: dict[str, float] | None) -> str:
    """``caps`` (a record's) as a person reads it: "upload 4.8/5.0 Mbit/s, today 1.20/2.0 GB, 3
    rounds sat out"; "" without caps."""
    if not caps:
        return ""
    parts = []
    if "upload_cap_mbit" in caps:
        parts.append(f"upload {caps.get('upload_mbit', 0.0):.1f}/{caps['upload_cap_mbit']:g} Mbit/s")
    if "day_cap_gb" in caps:
        parts.append(f"today {caps.get('day_gb', 0.0):.2f}/{caps['day_cap_gb']:g} GB")
        if caps.get("stronger_syncs"):
            parts.append(f"{caps['stronger_syncs']:.0f} syncs with a stronger codec")
        if caps.get("rounds_sat_out"):
            parts.append(f"{caps['rounds_sat_out']:.0f} rounds sat out")
    return ", ".join(parts)
