"""DHT access shared by peers and bootstrap nodes: start a node, announce and fetch run manifests,
publish and read progress records.

Every value read from the DHT is validated before use (manifests by hash and schema, records by
schema); hivemind serializes DHT values with msgpack, never pickle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

from protocol import keys
from protocol.errors import (BadPayload, BadPeerAddress, BootstrapUnreachable, ManifestError,
                             ManifestNotFound, NetworkError)
from protocol.manifest import RunManifest, decode
from protocol.records import ProgressRecord

logger = logging.getLogger(__name__)

MANIFEST_TTL_S = 300.0
"""How long a manifest announcement lives in the DHT; announcers refresh it every TTL/5."""


def quiet_hivemind_logs() -> None:
    """Keep hivemind's own logs off a command's output (``-v`` leaves them on).

    locoswarm reports every failed sync itself, once, on the progress line; hivemind would also
    log each one with a traceback from its averager process.
    """
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)


def parse_initial_peers(addresses: Sequence[str]) -> list[str]:
    """Check that each address is a multiaddr ending in /p2p/PEER_ID.

    Raises:
        BadPeerAddress: names the bad address and shows the expected form.
    """
    from hivemind.utils.multiaddr import Multiaddr

    parsed = []
    for address in addresses:
        try:
            maddr = Multiaddr(address)
            peer_id = maddr.value_for_protocol("p2p")
        except Exception as exc:
            raise BadPeerAddress(
                f"--initial-peers {address!r} is not a valid multiaddr ({exc}); expected the form "
                "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as printed by `bootstrap run` or `peer join`"
            ) from exc
        if not peer_id:
            raise BadPeerAddress(
                f"--initial-peers {address!r} has no /p2p/PEER_ID part; copy the full address printed "
                "by `bootstrap run` or `peer join`"
            )
        parsed.append(str(maddr))
    return parsed


@functools.cache
def _helper_dht_class():
    """hivemind's DHT as a helper process (protocol/lifetime.py), built on first use so that importing
    this module does not import hivemind (and torch)."""
    import hivemind

    from protocol.lifetime import HelperProcess, bind_subprocesses_to_this_process

    class SwarmDHT(HelperProcess, hivemind.DHT):
        """A hivemind DHT whose process and p2pd die with the process that started it, leave
        signals to it, and shut down within ``shutdown_timeout`` even when p2pd is already gone."""

        def run(self) -> None:  # in the DHT process
            bind_subprocesses_to_this_process()  # p2pd dies with this process
            super().run()

        async def _shutdown(self) -> None:
            # When p2pd is gone first (a service manager signals every process of the unit),
            # DHTNode.shutdown raises or waits forever on the closed daemon connection.
            try:
                await asyncio.wait_for(super()._shutdown(), self.shutdown_timeout / 2)
            except Exception as exc:
                logger.debug("DHT node did not shut down cleanly (%r); stopping p2pd", exc)
                try:
                    await asyncio.wait_for(self._node.p2p.shutdown(), self.shutdown_timeout / 4)
                except Exception as p2p_exc:
                    logger.debug("p2pd did not stop cleanly: %r", p2p_exc)

    return SwarmDHT


def new_dht(**kwargs):
    """``hivemind.DHT(**kwargs)`` whose DHT process and p2pd die with this process however it
    dies (``kill -9`` included) and ignore the signals that stop it (protocol/lifetime.py).

    Start it from a thread that outlives it (the kernel kills the DHT process when the thread
    that forked it exits). Raises whatever ``hivemind.DHT`` raises.
    """
    return _helper_dht_class()(**kwargs)


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    announce: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    timeout_s: float = 20.0,
):
    """Start a hivemind DHT node (its own process plus a p2pd daemon) and connect it to the swarm.

    Args:
        initial_peers: multiaddrs of any live node of the swarm (checked by parse_initial_peers).
        host, port: where to listen (port 0: any free port).
        announce: multiaddrs to advertise instead of the listen addresses (e.g. a public IP).
        identity_path: key file fixing the peer id; see protocol.identity.
        timeout_s: how long to wait for an initial peer to answer.

    Returns:
        A started ``hivemind.DHT`` (see :func:`new_dht`). Shut it down with ``dht.shutdown()``.

    Raises:
        BadPeerAddress: an initial peer address is malformed.
        BootstrapUnreachable: no initial peer answered within ``timeout_s``.
        NetworkError: the node could not start (e.g. the port is taken).
    """
    peers = parse_initial_peers(initial_peers)
    kwargs = dict(
        initial_peers=peers,
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        client_mode=client_mode,
        start=True,
        await_ready=True,
        wait_timeout=min(5.0, timeout_s),
        bootstrap_timeout=min(5.0, timeout_s),
    )
    if announce:
        kwargs["announce_maddrs"] = list(announce)
    if identity_path is not None:
        kwargs["identity_path"] = str(identity_path)
    try:
        return new_dht(**kwargs)
    except Exception as exc:
        text = str(exc)
        if peers and ("bootstrap failed" in text or "initial_peers" in text or "connect" in text.lower()):
            raise BootstrapUnreachable(
                f"none of the initial peers answered: {', '.join(peers)}. Check that the node is running, "
                "that HOST:PORT is reachable from here (firewall, NAT) and that the /p2p/ id is current"
            ) from exc
        raise NetworkError(f"could not start the DHT node on {host}:{port}: {text}") from exc


def visible_maddrs(dht) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def store_manifest(dht, manifest: RunManifest, ttl_s: float = MANIFEST_TTL_S) -> bool:
    """Announce ``manifest`` in the DHT for ``ttl_s`` seconds. Returns whether a node accepted it."""
    from hivemind.utils import get_dht_time

    expiration = get_dht_time() + ttl_s
    ok_manifest = dht.store(keys.manifest_key(manifest.run_id), manifest.encode(), expiration)
    ok_index = dht.store(keys.RUNS_KEY, manifest.name, expiration, subkey=manifest.run_id)
    return bool(ok_manifest and ok_index)


def list_runs(dht) -> dict[str, str]:
    """Announced runs: run id → name."""
    found = dht.get(keys.RUNS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    runs = {}
    for run_id, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(run_id, str) and isinstance(value, str):
            runs[run_id] = value
    return runs


def fetch_manifest(dht, run_id: str | None = None) -> RunManifest:
    """Fetch and verify a run manifest from the DHT.

    Args:
        run_id: the run to fetch; if None, the only run announced in the swarm.

    Raises:
        ManifestNotFound: no such run, no run at all, or several runs and none chosen.
        ManifestError: the stored bytes are not a manifest or do not hash to ``run_id``.
        VersionMismatch: the run speaks another protocol version.
    """
    if run_id is None:
        runs = list_runs(dht)
        if not runs:
            raise ManifestNotFound("the swarm announces no run yet; retry in a few seconds or pass --run-id")
        if len(runs) > 1:
            listing = ", ".join(f"{rid} ({name})" for rid, name in sorted(runs.items()))
            raise ManifestNotFound(f"the swarm announces several runs: {listing}; choose one with --run-id")
        run_id = next(iter(runs))
    found = dht.get(keys.manifest_key(run_id), latest=True)
    if found is None:
        raise ManifestNotFound(f"no manifest for run id {run_id} in the DHT; check the id with `peer status`"
                               " or ask the run's owner")
    if not isinstance(found.value, bytes):
        raise ManifestError(f"the DHT value for run {run_id} is not a manifest")
    return decode(found.value, expected_run_id=run_id)


class Periodic:
    """Calls :meth:`tick` at once and then every ``period_s`` on a daemon thread until :meth:`stop`.

    A tick that raises is logged at debug level and tried again next period: the DHT it talks to
    may be starting or shutting down. Subclasses implement :meth:`tick`.
    """

    def __init__(self, *, period_s: float, name: str):
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:
                logger.debug("%s failed: %r; retrying in %.0f s", self._thread.name, exc, self.period_s)
            self._stop.wait(self.period_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; waits up to ``timeout_s`` for a tick in progress."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class ManifestAnnouncer(Periodic):
    """Keeps a manifest alive in the DHT (stored again every ttl/5) until :meth:`stop`."""

    def __init__(self, dht, manifest: RunManifest, ttl_s: float = MANIFEST_TTL_S):
        super().__init__(period_s=ttl_s / 5 if ttl_s > 5 else 1.0, name="manifest-announcer")
        self.dht, self.manifest, self.ttl_s = dht, manifest, ttl_s

    def tick(self) -> None:
        if not store_manifest(self.dht, self.manifest, self.ttl_s):
            logger.debug("no DHT node accepted the manifest announcement; retrying")


def publish_progress(dht, run_id: str, peer_id: str, record: ProgressRecord, ttl_s: float, *, wait: bool = True):
    """Store this peer's record; with ``wait=False`` returns at once (the store finishes in the DHT process)."""
    from hivemind.utils import get_dht_time

    result = dht.store(keys.progress_key(run_id), record.to_wire(), get_dht_time() + ttl_s, subkey=peer_id,
                       return_future=not wait)
    return bool(result) if wait else result


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    record: ProgressRecord
    expiration: float


def read_progress(dht, run_id: str) -> list[PeerProgress]:
    """Live peers' latest progress records; malformed records are skipped with a debug log."""
    found = dht.get(keys.progress_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for peer_id, item in found.value.items():
        try:
            record = ProgressRecord.from_wire(getattr(item, "value", None))
        except BadPayload as exc:
            logger.debug("ignoring progress record of %s: %s", peer_id, exc)
            continue
        out.append(PeerProgress(peer_id=str(peer_id), record=record, expiration=item.expiration_time))
    return out
