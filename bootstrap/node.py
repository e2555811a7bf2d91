"""A bootstrap node: DHT entry with a persistent identity that keeps a run manifest announced,
serves as a libp2p circuit relay for peers behind NAT, and optionally hosts the swarm monitor."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bootstrap.monitor import MonitorConfig, MonitorServer, SwarmMonitor
from peer.net import dht as swarm_dht, dht_node
from peer.net.home_run import HomeRunAnnouncer
from peer.net.identity import ensure_identity
from peer.net.lifetime import HelperWatch
from peer.net.reachability import serve_dialback
from peer.net.uplink import serve_uplink
from peer.net.validator import protect_run
from protocol.manifest import SignedManifest
from protocol.signing import PeerSigner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    host: str = "0.0.0.0"
    port: int = 31337
    announce: tuple[str, ...] = ()
    """Multiaddrs to advertise instead of the listen addresses (a public IP, a DNS name)."""
    identity_path: Path
    initial_peers: tuple[str, ...] = ()
    """Other bootstrap nodes or peers to link with (optional)."""
    manifest: SignedManifest | None
    """The run to announce, signed by its owner (protocol/manifest.py ``sign_manifest``); None: the
    node announces no manifest and serves ``home_run_id``, a run its peers announce."""
    home_run_id: str | None = None
    """The run this node announces as its own, signed by its identity (peer/net/home_run.py): a plain
    ``peer join`` that dials it trains that run. None: ``manifest``'s."""
    relay: bool = True
    """Serve as a libp2p circuit relay (v2) so peers behind NAT can be reached through this node."""
    monitor_host: str = "127.0.0.1"
    monitor_port: int | None = None
    """HTTP port of the swarm monitor (page, /api/swarm, /metrics, /healthz); None: no monitor."""
    monitor_poll_s: float = 1.0
    """Seconds between two reads of the progress records by the monitor."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port = {self.port}: must be in [0, 65535]")
        if self.monitor_port is not None and not 0 <= self.monitor_port <= 65535:
            raise ValueError(f"monitor_port = {self.monitor_port}: must be in [0, 65535]")
        if not self.monitor_poll_s > 0:
            raise ValueError(f"monitor_poll_s = {self.monitor_poll_s}: must be > 0")
        if self.manifest is None and self.home_run_id is None:
            raise ValueError("a bootstrap node needs a manifest to announce or a home run id")
        if self.manifest is not None and self.home_run_id not in (None, self.manifest.run_id):
            raise ValueError(f"home_run_id = {self.home_run_id}: the manifest's run id is {self.manifest.run_id}")


def serve(cfg: BootstrapConfig, stop: threading.Event, on_ready: Callable[[list[str], str | None], None]) -> None:
    """Run the node until ``stop`` is set; call ``on_ready(multiaddrs, monitor_url)`` once it listens.

    Raises:
        ConfigError: unusable identity file, or ``cfg.port`` held by another process (exit 78, the port
            named: :func:`peer.net.dht_node.check_port_free`). NetworkError: a port cannot be bound.
        HelperDied: the node's DHT process died (exit 75; a service manager restarts the node).
    """
    identity = ensure_identity(cfg.identity_path)
    dht_node.check_port_free(cfg.host, cfg.port)
    dht = dht_node.start_dht(  # peers behind NAT reserve a relay slot here (peer/reachability.py)
        initial_peers=cfg.initial_peers,
        host=cfg.host,
        port=cfg.port,
        announce=cfg.announce,
        identity_path=str(identity),
        relay="serve" if cfg.relay else None,
    )
    serve_dialback(dht)  # joiners ask whether the swarm can dial them (peer/net/reachability.py)
    serve_uplink(dht)  # and `peer doctor` measures its uplink against it (peer/net/uplink.py)
    announcer = None if cfg.manifest is None else swarm_dht.ManifestAnnouncer(dht, cfg.manifest)
    run_id = cfg.manifest.run_id if cfg.manifest is not None else cfg.home_run_id
    assert run_id is not None  # BootstrapConfig checks it
    run_name = cfg.manifest.manifest.name if cfg.manifest is not None else run_id
    home = HomeRunAnnouncer(dht, PeerSigner.from_identity(identity), run_id)
    monitor = server = None
    # its DHT process killed (for memory, most often), the node is no node: stop, and exit 75
    watch = HelperWatch(stop, "run the bootstrap node again").watch_dht("bootstrap node's", dht).start()
    try:
        protect_run(dht, run_id)
        home.start()
        if announcer is not None:
            announcer.start()
        if cfg.monitor_port is not None:
            monitor = SwarmMonitor(
                dht, MonitorConfig(poll_interval_s=cfg.monitor_poll_s), run_ids={run_id: run_name}
            ).start()
            server = MonitorServer(monitor, cfg.monitor_host, cfg.monitor_port, title=run_name).start()
        on_ready(swarm_dht.visible_maddrs(dht), server.url if server else None)
        stop.wait()
        watch.raise_if_died()
    finally:
        watch.stop()
        if server is not None:
            server.stop()
        if monitor is not None:
            monitor.stop()
        if announcer is not None:
            announcer.stop()
        home.stop()
        dht.shutdown()
