"""`peer join`: start a DHT node, get the run manifest, build everything, train until told to stop."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

import protocol
from peer.train.cache import default_cache_dir
from peer.train.data import load_corpus
from peer.train.device import place, resolve_device
from peer.train.model import build_model, parameter_count
from peer.train.outer import make_outer
from peer.reporting import Reporter
from peer.progress import TrainSummary
from peer.config import JoinConfig
from peer.round import Trainer
from peer.state.address_book import FILE_NAME as ADDRESS_BOOK, AddressBook, AddressKeeper, start_dht_remembering
from peer.sync.membership import SwarmView
from peer.sync.screening import round_token_cap
from peer.sync.transport import NetworkTransport
from protocol import dht as swarm_dht, lifetime, liveness
from protocol.errors import ManifestNotFound
from protocol.identity import ensure_identity
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


def _fetch_manifest(dht, run_id: str | None, wait_s: float) -> RunManifest:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return swarm_dht.fetch_manifest(dht, run_id)
        except ManifestNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class StopOnSignal(lifetime.StopOnSignal):
    """First SIGINT/SIGTERM sets ``event`` (finish the step, checkpoint); a second one exits now.

    Only this process acts on them: the DHT, averager and p2pd processes ignore a signal sent to
    the whole group and are shut down by :func:`join` on its way out, or die with this process
    however it ends (protocol/lifetime.py).
    """

    def __init__(self, event: threading.Event):
        super().__init__(event, "stopping after the current inner step (signal again to exit now)")


def join(cfg: JoinConfig, reporter: Reporter, stop_event: threading.Event | None = None) -> tuple[int, TrainSummary]:
    """Join (or start) a swarm and train. Returns (exit code, summary).

    Raises:
        LocoError subclasses: bad address, unreachable bootstrap, missing or invalid manifest.
    """
    stop_event = stop_event or threading.Event()
    resolve_device(cfg.device.device)  # a device this machine lacks fails now, before the DHT starts
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    identity = ensure_identity(cfg.data_dir / "identity.key")
    # Peers seen before (peers.json): the way back into the swarm when the initial peers are gone.
    book = AddressBook.load(cfg.data_dir / ADDRESS_BOOK)
    dht = start_dht_remembering(
        lambda peers: swarm_dht.start_dht(initial_peers=peers, host=cfg.host, port=cfg.port, announce=cfg.announce,
                                          identity_path=str(identity), client_mode=cfg.client_mode),
        cfg.initial_peers, book)
    announcer = transport = keeper = None
    try:
        if cfg.new_run is not None or not cfg.initial_peers:
            manifest = cfg.new_run or RunManifest()
        else:
            manifest = _fetch_manifest(dht, cfg.run_id, cfg.manifest_wait_s)
        # Every peer keeps its run's manifest alive, so the swarm outlives its bootstrap node.
        announcer = swarm_dht.ManifestAnnouncer(dht, manifest).start()
        peer_id = str(dht.peer_id)
        keeper = AddressKeeper(dht, book, run_id=manifest.run_id, peer_id=peer_id, publish=not cfg.client_mode).start()
        corpus = load_corpus(manifest.data, cache_dir=default_cache_dir())
        model = build_model(manifest.model, corpus.tokenizer)
        shapes = [p.shape for p in model.parameters()]
        outer = make_outer(manifest, shapes)
        transport = NetworkTransport(dht, shapes, outer.payload_shapes(shapes), manifest.run_id, manifest.sync,
                                     compression=manifest.compression, phi_from=outer.phi_from(len(shapes)),
                                     client_mode=cfg.client_mode, uplink_mbps=cfg.uplink_mbps,
                                     max_weight_tokens=round_token_cap(manifest))
        # One ttl for every peer of the run (protocol/liveness.py), so readers know when a record was published.
        swarm = SwarmView(dht, run_id=manifest.run_id, peer_id=peer_id,
                          record_ttl_s=liveness.record_ttl_s(manifest), max_sync_s=transport.max_sync_seconds)
        checkpoint = cfg.data_dir / "runs" / manifest.run_id / "checkpoint.safetensors"
        trainer_cfg = dataclasses.replace(cfg.trainer, checkpoint_path=checkpoint)
        # CUDA is first touched here, after the transport forked its averager (ALGORITHMS.md §8)
        d = cfg.device
        placement, notes = place(d.device, precision=d.precision, compile=d.compile,
                                 micro_batch_sequences=d.micro_batch_sequences, max_memory_gib=d.max_memory_gib,
                                 peak_tflops=d.peak_tflops)
        trainer = Trainer(manifest=manifest, model=model, corpus=corpus, swarm=swarm, transport=transport,
                          config=trainer_cfg, reporter=reporter, stop_event=stop_event, placement=placement)
        micro_batch = trainer.fit_micro_batch()
        reporter.emit("started", version=protocol.__version__, peer_id=peer_id, **placement.event_fields(),
                      micro_batch=micro_batch or manifest.batch_sequences, batch_sequences=manifest.batch_sequences,
                      maddrs=swarm_dht.visible_maddrs(dht), run_id=manifest.run_id, run_name=manifest.name,
                      parameters=parameter_count(model), inner_steps=manifest.sync.inner_steps,
                      threads=torch.get_num_threads())
        for note in notes:
            reporter.emit("warning", message=note)
        summary = trainer.run()
        saved = trainer.save()
        reporter.emit("stopped", peer_id=peer_id, **summary.event_fields(), checkpoint=saved)
        return (EXIT_INTERRUPTED if summary.interrupted else 0), summary
    finally:
        if announcer is not None:
            announcer.stop()
        if keeper is not None:
            keeper.stop()
        if transport is not None:
            transport.shutdown()
        dht.shutdown()
