"""A bootstrap node: DHT entry with a persistent identity that keeps a run manifest announced."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from protocol import dht as swarm_dht
from protocol.identity import ensure_identity
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    host: str = "0.0.0.0"
    port: int = 31337
    announce: tuple[str, ...] = ()
    identity_path: Path
    initial_peers: tuple[str, ...] = ()
    """Other bootstrap nodes or peers to link with (optional)."""
    manifest: RunManifest

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port = {self.port}: must be in [0, 65535]")


def serve(cfg: BootstrapConfig, stop: threading.Event, on_ready: Callable[[list[str]], None]) -> None:
    """Run the node until ``stop`` is set; call ``on_ready(multiaddrs)`` once it listens.

    Raises:
        ConfigError: unusable identity file. NetworkError: the port cannot be bound.
    """
    identity = ensure_identity(cfg.identity_path)
    dht = swarm_dht.start_dht(initial_peers=cfg.initial_peers, host=cfg.host, port=cfg.port,
                              announce=cfg.announce, identity_path=str(identity))
    announcer = swarm_dht.ManifestAnnouncer(dht, cfg.manifest)
    try:
        announcer.start()
        on_ready(swarm_dht.visible_maddrs(dht))
        stop.wait()
    finally:
        announcer.stop()
        dht.shutdown()
