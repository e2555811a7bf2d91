"""Live swarm monitor: what the DHT's progress records say about a swarm, kept as history.

A :class:`SwarmMonitor` polls the DHT (``list_runs`` + ``read_progress``, so every record is
validated by ``ProgressRecord.from_wire``) from a background thread and keeps, per run and per
peer, the latest record, when the peer was first and last seen, the largest group it synced in
at each round, and every validation loss it published (records carry ``eval_loss`` only at the
rounds a peer evaluated φ, so the history is what makes "loss over time" possible). A peer is
live while its latest record is younger than protocol/liveness.py's bound (about one round's
deadline, from the run's manifest), not until the record expires; peers that went stale or whose
records expired stay in the history, marked not live, and the run's totals count live peers only.

:class:`MonitorServer` publishes a snapshot over HTTP (stdlib ``ThreadingHTTPServer``):

- ``/``            the page (bootstrap.monitor_page: inline JS and SVG, no CDN)
- ``/api/swarm``   the snapshot as JSON (schema in :meth:`SwarmMonitor.snapshot`)
- ``/metrics``     Prometheus text format (bootstrap.monitor_metrics)
- ``/healthz``     200 once the monitor has polled the DHT successfully, 503 before

What is kept per peer between polls is in bootstrap.monitor_history.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bootstrap.monitor_history import PeerHistory, RunHistory
from bootstrap.monitor_metrics import metrics_text
from bootstrap.monitor_page import render_page
from peer.net import dht as swarm_dht
from peer.net.devices import read_devices
from protocol import liveness
from protocol.errors import LocoError, NetworkError
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    poll_interval_s: float = 1.0
    """Seconds between two reads of the progress records."""
    history_samples: int = 2000
    """Record samples kept per peer (oldest dropped first); eval points are all kept."""
    forget_after_s: float = 3600.0
    """Peers not seen for this long are dropped from the snapshot."""
    devices_interval_s: float = 30.0
    """Seconds between two reads of the peers' device records (they do not change while a peer runs)."""

    def __post_init__(self) -> None:
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s = {self.poll_interval_s}: must be > 0")
        if self.history_samples < 1:
            raise ValueError(f"history_samples = {self.history_samples}: must be >= 1")
        if not self.forget_after_s > 0:
            raise ValueError(f"forget_after_s = {self.forget_after_s}: must be > 0")


class SwarmMonitor:
    """Polls a DHT for progress records and keeps their history; thread-safe snapshots.

    Args:
        dht: a started ``hivemind.DHT`` (the bootstrap node's own, or a client-mode node).
        config: polling and retention.
        run_ids: runs to watch besides those announced under ``locoswarm_runs`` (e.g. the
            bootstrap node's own run, before its first announcement is readable).
    """

    def __init__(self, dht, config: MonitorConfig = MonitorConfig(), run_ids: dict[str, str] | None = None):
        self.dht, self.cfg = dht, config
        self._known_runs = dict(run_ids or {})
        self._runs: dict[str, RunHistory] = {}
        self._manifests: dict[str, RunManifest] = {}
        self._devices: dict[str, dict[str, str]] = {}
        """Run id → peer id → its device (peer/net/devices.py ``DeviceRecord.describe``)."""
        self._devices_read_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swarm-monitor", daemon=True)
        self.started_at = time.time()
        self.last_poll: float | None = None
        self.last_error: str | None = None

    def start(self) -> SwarmMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a DHT hiccup must not kill the monitor; report it on the page
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.debug("monitor poll failed: %r", exc)
            self._stop.wait(self.cfg.poll_interval_s)

    def poll(self, now: float | None = None) -> None:
        """Read every watched run's progress records once and fold them into the history."""
        runs = dict(self._known_runs)
        runs.update(swarm_dht.list_runs(self.dht))
        for run_id in runs:
            if run_id not in self._manifests:
                try:
                    # shown, never trained on: a manifest with a data path is fine here
                    self._manifests[run_id] = swarm_dht.fetch_manifest(self.dht, run_id, allow_data_path=True)
                except LocoError as exc:  # not announced (yet), or not a manifest we accept
                    logger.debug("no manifest for run %s yet: %s", run_id, exc)
        found = {run_id: swarm_dht.read_progress(self.dht, run_id) for run_id in runs}
        self._read_devices(found)
        self.ingest(runs, found, now)

    def _read_devices(self, found: dict[str, list[swarm_dht.PeerProgress]]) -> None:
        """Read the device records of runs with peers, each at most every ``devices_interval_s``
        (sooner when a peer appears whose device is not known yet)."""
        for run_id, items in found.items():
            known = self._devices.get(run_id, {})
            fresh = time.monotonic() - self._devices_read_at.get(run_id, -math.inf) < self.cfg.devices_interval_s
            if not items or (fresh and all(item.peer_id in known for item in items)):
                continue
            self._devices_read_at[run_id] = time.monotonic()
            try:
                records = read_devices(self.dht, run_id, prefer={item.peer_id for item in items})
            except LocoError as exc:
                logger.debug("no device records for run %s: %s", run_id, exc)
                continue
            with self._lock:
                self._devices[run_id] = {peer_id: record.describe() for peer_id, record in records.items()}

    def ingest(
        self, runs: dict[str, str], found: dict[str, list[swarm_dht.PeerProgress]], now: float | None = None
    ) -> None:
        """Fold one poll's records (already validated) into the history.

        ``now`` is wall-clock time, s since the epoch (hivemind's DHT time is the same clock): a
        record is judged by protocol.liveness against the run's manifest; without the manifest, a
        peer counts as live while its record is in the DHT.
        """
        now = time.time() if now is None else now
        with self._lock:
            for run_id, name in runs.items():
                run = self._runs.setdefault(run_id, RunHistory(run_id=run_id, name=name))
                run.name = name
                manifest = self._manifests.get(run_id)
                if manifest is not None:
                    run.inner_steps = manifest.sync.inner_steps
                present = set()
                for item in found.get(run_id, []):
                    present.add(item.peer_id)
                    peer = run.peers.get(item.peer_id)
                    if peer is None:
                        peer = run.peers[item.peer_id] = PeerHistory(
                            peer_id=item.peer_id, first_seen=now, last_seen=now, last_change=now, record=item.record
                        )
                    peer.update(item.record, now, self.cfg.history_samples, run.inner_steps)
                    peer.device = self._devices.get(run_id, {}).get(item.peer_id, peer.device)
                    if manifest is not None:
                        verdict = liveness.judge(item.record, item.expiration, now, manifest)
                        peer.live, peer.stale_after_s = verdict.live, verdict.stale_after_s
                        peer.published_at = liveness.published_at(item.expiration, manifest)
                for peer_id, peer in list(run.peers.items()):
                    if peer_id not in present:
                        peer.live = False
                        if now - peer.last_seen > self.cfg.forget_after_s:
                            del run.peers[peer_id]
            self.last_poll = now
            self.last_error = None

    @property
    def healthy(self) -> bool:
        return self.last_poll is not None

    def snapshot(self, *, with_samples: bool = True) -> dict[str, Any]:
        """The monitor's state as JSON-able data.

        Schema::

            {"generated_at": s, "started_at": s, "last_poll": s | null, "last_error": str | null,
             "runs": [{"run_id", "name", "inner_steps" (H, or null), "live_peers",
                       "median_round" (the swarm's round: the median of the live peers' rounds,
                                       the lower middle one of an even count; null without one),
                       "max_round" (the highest round any peer, live or gone, reached),
                       "tokens_per_s" (sum over live peers),
                       "live_by_group_size": {"3": 3, ...} (live peers by their last sync's group size),
                       "peers": [{"peer_id", "live", "device" (its device record as one line,
                                  or null), "caps" (its use against its own caps as one line,
                                  peer/net/traffic.py ``describe_caps``, or null), "first_seen", "last_seen", "last_change",
                                  "published_at" (s, or null), "stale_after_s" (or null),
                                  "round", "inner_step", "train_loss",
                                  "eval_loss" (latest seen), "eval_round" (the round of φ it
                                        was measured at: below "round", it is stale; or null),
                                  "tokens_per_s", "group_size", "bytes_sent", "bytes_received",
                                  "last_sync": {"round", "group_size", "bytes_sent",
                                                "bytes_received"} | null,
                                  "rounds_by_group_size": {"3": 2, ...} (rounds whose sync record
                                        the monitor saw),
                                  "first_round" (of the first record seen),
                                  "rounds_unseen" (rounds after first_round that are not in
                                        those counts: finished between two polls, or adopted),
                                  "group_by_round": {"1": 3, ...},
                                  "eval_history": [{"round", "t", "loss"}],
                                  "history": [{"t", "round", "inner_step", "train_loss",
                                               "tokens_per_s", "group_size", "bytes_sent",
                                               "bytes_received"}]}]}]}

        Times are wall-clock seconds since the epoch; losses in nats/token. The top-level fields
        of a peer are its latest record as published (mid-round records may carry group size 1
        and 0 bytes); ``last_sync`` is the latest record written right after a sync.
        ``published_at`` is when the peer stored its latest record and ``stale_after_s`` how old
        that record may grow before the peer counts as gone (protocol/liveness.py); both are
        null until the run's manifest was read.
        """
        with self._lock:
            runs = []
            for run in sorted(self._runs.values(), key=lambda r: r.run_id):
                peers = [
                    p.to_json(with_samples=with_samples) for p in sorted(run.peers.values(), key=lambda p: p.peer_id)
                ]
                live = [p for p in peers if p["live"]]
                by_size: dict[str, int] = {}
                for p in live:
                    if p["last_sync"] is not None:
                        size = str(p["last_sync"]["group_size"])
                        by_size[size] = by_size.get(size, 0) + 1
                runs.append(
                    {
                        "run_id": run.run_id,
                        "name": run.name,
                        "inner_steps": run.inner_steps,
                        "live_peers": len(live),
                        "median_round": statistics.median_low([p["round"] for p in live]) if live else None,
                        "max_round": max((p["round"] for p in peers), default=0),
                        "tokens_per_s": sum(p["tokens_per_s"] for p in live),
                        "live_by_group_size": dict(sorted(by_size.items(), key=lambda kv: int(kv[0]))),
                        "peers": peers,
                    }
                )
            return {
                "generated_at": time.time(),
                "started_at": self.started_at,
                "last_poll": self.last_poll,
                "last_error": self.last_error,
                "runs": runs,
            }


# ---- HTTP ---------------------------------------------------------------------------------


def _handler(monitor: SwarmMonitor, title: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "locoswarm-monitor"

        def do_GET(self) -> None:  # (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                body = render_page(title, json.dumps(monitor.snapshot()))
                self._send(200, "text/html; charset=utf-8", body.encode())
            elif path == "/api/swarm":
                self._send(200, "application/json", json.dumps(monitor.snapshot()).encode())
            elif path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST

                self._send(200, CONTENT_TYPE_LATEST, metrics_text(monitor))
            elif path == "/healthz":
                ok = monitor.healthy
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"starting\n")
            else:
                self._send(404, "text/plain", b"not found: try /, /api/swarm, /metrics or /healthz\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("monitor http: " + fmt, *args)

    return Handler


class MonitorServer:
    """The monitor's HTTP server on its own thread; ``url`` says where it listens."""

    def __init__(self, monitor: SwarmMonitor, host: str, port: int, title: str = "locoswarm"):
        try:
            self.httpd = ThreadingHTTPServer((host, port), _handler(monitor, title))
        except OSError as exc:
            raise NetworkError(
                f"the monitor cannot listen on {host}:{port}: {exc.strerror}; "
                "pick another --monitor-port (0: any free port)"
            ) from exc
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="monitor-http", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> MonitorServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def run_monitor(
    dht,
    *,
    host: str,
    port: int,
    config: MonitorConfig,
    stop: threading.Event,
    on_ready: Callable[[str], None],
    run_ids: dict[str, str] | None = None,
    title: str = "locoswarm",
) -> None:
    """Serve the monitor for ``dht`` until ``stop`` is set; ``on_ready(url)`` once it listens.

    Raises:
        NetworkError: the HTTP port cannot be bound.
    """
    monitor = SwarmMonitor(dht, config, run_ids).start()
    try:
        server = MonitorServer(monitor, host, port, title).start()
    except LocoError:
        monitor.stop()
        raise
    try:
        on_ready(server.url)
        stop.wait()
    finally:
        server.stop()
        monitor.stop()
