"""`peer join`: start a DHT node, get the run manifest, build everything, train until told to stop."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from contextlib import ExitStack
from typing import cast

import torch

import protocol
from peer import reachability
from peer.config import JoinConfig, checkpoint_bytes
from peer.net import dht as swarm_dht, dht_node, lifetime, traffic
from peer.net.devices import DeviceAnnouncer, DeviceRecord
from peer.net.home_run import bootstrap_ids, read_home_run
from peer.net.identity import ensure_identity
from peer.net.validator import protect_run
from peer.pipeline.peer import LoopThread, pipeline_link, stage_key
from peer.pipeline.routing import stage_to_serve
from peer.pipeline.stage_loop import StageInnerLoop
from peer.pipeline.stages import build_stage
from peer.progress import TrainSummary, Waiting
from peer.reporting import Reporter
from peer.round import Trainer
from peer.run_choice import RUN_ID_LOOK_S, checkpointed_runs, choose_run, refuse_unannounced_run_id, weigher
from peer.shards.corpus import ShardedRun, load_data
from peer.shards.share import ShardSharing
from peer.shards.stream import ShardSampler
from peer.state import disk, memory_check
from peer.state.address_book import FILE_NAME as ADDRESS_BOOK, AddressBook, AddressKeeper, start_dht_remembering
from peer.state.data_dir import hold_data_dir
from peer.sync.membership import SwarmView
from peer.sync.screening import round_token_cap
from peer.sync.transport import NetworkTransport
from peer.train.bpe import is_held, prefetch
from peer.train.cache import default_cache_dir
from peer.train.data import with_local_data
from peer.train.device import place, resolve_device
from peer.train.host_memory import tune_host_allocator
from peer.train.model import build_model, parameter_count
from peer.train.outer import make_outer
from peer.train.sources import describe
from protocol import liveness
from protocol.errors import ConfigError, ManifestNotFound, NetworkError
from protocol.manifest import RunManifest, SignedManifest, sign_manifest
from protocol.signing import OWNER_KEY_FILE, PeerSigner, load_owner_key

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130

LOCAL_RUN_LOOK_S = 2.0
"""How long a peer with its own run (--run/--preset) looks for the swarm's runs index before it
takes the swarm for bare and starts its run (a node that just joined may not see the index at once)."""


def _owner_key_path(cfg: JoinConfig):
    return cfg.owner_key_path if cfg.owner_key_path is not None else cfg.data_dir / OWNER_KEY_FILE


def _holds_owner_key(cfg: JoinConfig, owner: str) -> bool:
    """Whether this peer's owner key file exists and is ``owner``'s (read, never created)."""
    path = _owner_key_path(cfg)
    return path.exists() and load_owner_key(path, create=False).public_hex == owner


def _start_run(local: RunManifest, cfg: JoinConfig) -> SignedManifest:
    """``local`` signed by this peer's owner key (created 0600 on first use): this peer owns the run.

    Raises:
        ConfigError: the owner key file is unusable. ManifestError: ``local`` names another owner.
    """
    return sign_manifest(local, load_owner_key(_owner_key_path(cfg)))


def _announced(dht, only: str | None = None, prefer=()) -> dict[str, SignedManifest]:
    try:  # with --run-id, that run's entry alone; else at most MAX_RUNS_READ, ``prefer`` first
        return swarm_dht.list_announced(dht, only=only, prefer=prefer)
    except NetworkError as exc:
        logger.debug("reading the runs index failed: %s", exc)
        return {}


def _find_run(dht, cfg: JoinConfig, reporter: Reporter) -> SignedManifest:
    """The signed manifest of the run this peer trains, decided by peer/run_choice.py from the swarm's
    validly signed runs, the flags and this peer's checkpoints; waits up to ``cfg.manifest_wait_s``
    while a plain join (or one whose run only its owner can start) finds no run announced.

    Raises:
        RunChoiceNeeded: several runs, or the local run is not the swarm's (message lists the runs);
            ``--run-id`` names no announced run while the swarm announces others, after
            :data:`RUN_ID_LOOK_S` (peer/run_choice.py).
        ManifestNotFound: no run announced in time, or the chosen one's manifest cannot be read.
        ManifestError: the run names a local data path; or this peer would start a run owned by another key.
    """
    local = cfg.new_run
    reporter.emit("status", message="looking for the swarm's run")
    # a run this peer cannot sign (another owner's) is waited for like the run of a plain join
    can_start = local is not None and (not local.owner or _holds_owner_key(cfg, local.owner))
    deadline = time.monotonic() + (LOCAL_RUN_LOOK_S if can_start else cfg.manifest_wait_s)
    from hivemind.utils import get_dht_time

    # the run the bootstrap node dialed announces as its own, signed by it (peer/net/home_run.py)
    home = None if cfg.run_id else read_home_run(dht, bootstrap_ids(cfg.initial_peers))
    prefer = checkpointed_runs(cfg.data_dir) | ({home} if home else set())
    started = time.monotonic()
    while True:
        announced = _announced(dht, cfg.run_id, prefer)
        if announced or time.monotonic() > deadline:
            break
        if cfg.run_id is not None and time.monotonic() - started >= RUN_ID_LOOK_S:
            others = _announced(dht, None, prefer)
            refuse_unannounced_run_id(cfg.run_id, {rid: o.manifest for rid, o in others.items()})
        time.sleep(0.5)

    def stats(run_id: str) -> tuple[int, int] | None:
        try:
            records = swarm_dht.read_progress(dht, run_id)
        except NetworkError:
            return None
        return (len(records), max(r.record.round for r in records)) if records else None

    while True:
        try:
            chosen = choose_run(
                {rid: s.manifest for rid, s in announced.items()},
                local=local,
                local_flag=cfg.run_flag,
                run_id=cfg.run_id,
                new_run=cfg.start_new_run,
                checkpoints=checkpointed_runs(cfg.data_dir),
                stats=stats,
                home=home,
                weight=weigher(
                    {rid: s.manifest for rid, s in announced.items()},
                    lambda rid: swarm_dht.read_progress(dht, rid),
                    get_dht_time,
                ),
            )
            if chosen in announced:
                signed = announced[chosen]
            elif local is not None and chosen in (None, local.run_id):
                if not can_start:
                    raise ManifestNotFound(
                        f"{cfg.run_flag} is run {local.run_id} of owner {local.owner}, which the swarm does not "
                        "announce (yet); retry once a peer of that run is up, or ask its owner"
                    )
                signed = _start_run(local, cfg)
                reporter.emit("status", message=f"starting run {signed.run_id} ({local.name}), owned by this peer")
                return signed
            else:
                signed = swarm_dht.fetch_signed(dht, chosen)
            if local is None or not signed.manifest.same_content(local):
                swarm_dht.refuse_local_data_path(signed.manifest)  # a volunteer's data location is theirs alone
            reporter.emit("status", message=f"joining run {signed.run_id} ({signed.manifest.name})")
            return signed
        except ManifestNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            announced = _announced(dht, cfg.run_id, prefer)


class StopOnSignal(lifetime.StopOnSignal):
    """First SIGINT/SIGTERM sets ``event`` (finish the step, checkpoint); a second one exits now.

    Only this process acts on them: the DHT, averager and p2pd processes ignore a signal sent to
    the whole group and are shut down by :func:`join` on its way out, or die with this process
    however it ends (protocol/lifetime.py).
    """

    def __init__(self, event: threading.Event):
        super().__init__(event, "stopping after the current inner step (signal again to exit now)")


def refuse_unimplemented(manifest: RunManifest) -> None:
    """Refuse a run whose manifest asks for what a peer does not implement.

    Raises:
        ConfigError: pipeline stages with ``sync.overlap`` other than 'none' (a stage's inner steps
            are driven by the stages around it; overlapping its sync is not built).
    """
    if manifest.pipeline.stages > 1 and manifest.sync.overlap != "none":
        raise ConfigError(
            f"run {manifest.run_id} ({manifest.name}) sets pipeline.stages = {manifest.pipeline.stages} "
            f"with sync.overlap = {manifest.sync.overlap!r}: a pipeline stage syncs blocking only; "
            "use sync.overlap = 'none'"
        )


def choose_stage(
    dht, manifest: RunManifest, cfg: JoinConfig, signer: PeerSigner, *, client_mode: bool | None = None
) -> int:
    """The pipeline stage this peer serves: ``--stage``; else the stage it holds a checkpoint of (a
    restarted peer goes back to its stage); else the one with the fewest live replicas read from
    the stages' progress records (peer/pipeline/routing.py ``stage_to_serve``). A peer in client
    mode cannot be called, so it serves stage 0 (which only calls).

    Args:
        client_mode: whether the peer runs in client mode (``Reachability.client_mode``); None:
            ``cfg.client_mode``.

    Raises:
        ConfigError: ``--stage`` outside [0, S), or a stage > 0 asked for in client mode.
    """
    client_mode = cfg.client_mode if client_mode is None else client_mode
    S = manifest.pipeline.stages
    if cfg.stage is not None:
        if cfg.stage >= S:
            raise ConfigError(f"--stage {cfg.stage}: run {manifest.run_id} has {S} pipeline stages (0 to {S - 1})")
        if cfg.stage > 0 and client_mode:
            raise ConfigError(
                f"--stage {cfg.stage} with --client-mode: stages after 0 are called by other peers, "
                "which a peer in client mode cannot be; use --stage 0 or make this peer dialable"
            )
        return cfg.stage
    if client_mode:
        return 0
    held = [k for k in range(S) if stage_checkpoint(cfg, manifest, k).exists()]
    if len(held) == 1:
        return held[0]
    live = {}
    for k in range(S):
        try:
            records = swarm_dht.read_progress(dht, stage_key(manifest.run_id, k))
        except NetworkError:
            records = []
        live[k] = len({r.peer_id for r in records if r.peer_id != signer.peer_id})
    return stage_to_serve(live, S)


def stage_checkpoint(cfg: JoinConfig, manifest: RunManifest, stage: int | None):
    """Where this peer checkpoints its run (``stage``: its pipeline stage, None: the whole model)."""
    run_dir = cfg.data_dir / "runs" / manifest.run_id
    return run_dir / "checkpoint.safetensors" if stage is None else run_dir / f"stage{stage}" / "checkpoint.safetensors"


class _TimedStack(ExitStack):
    """An ``ExitStack`` whose callbacks log, at debug level, how long each release took (``peer join
    -v`` shows where a stop spends its time)."""

    def callback(self, callback, /, *args, **kwds):
        name = getattr(callback, "__qualname__", repr(callback))

        def timed():
            start = time.monotonic()
            try:
                callback(*args, **kwds)
            finally:
                logger.debug("released %s in %.2f s", name, time.monotonic() - start)

        return super().callback(timed)


@dataclasses.dataclass(frozen=True)
class _Peer:
    """What :func:`_assemble` built and :func:`join` trains with (everything else is on its stack)."""

    trainer: Trainer
    watch: lifetime.HelperWatch
    peer_id: str


def join(cfg: JoinConfig, reporter: Reporter, stop_event: threading.Event | None = None) -> tuple[int, TrainSummary]:
    """Join (or start) a swarm and train until ``max_rounds`` or a stop. Returns (exit code, summary):
    0, or :data:`EXIT_INTERRUPTED` when ``stop_event`` (a signal) stopped it.

    The peer is assembled on one ``ExitStack`` (:func:`_assemble`): each resource is registered as
    it is acquired and released in reverse order however ``join`` ends (return, exception, the
    KeyboardInterrupt of a second signal). Acquired in this order:

    1. the data directory's lock (peer/state/data_dir.py): a second peer on the same directory is
       refused before it reads or writes anything there; released last;
    2. the DHT node and its p2pd (shut down; after a fall back to client mode, the restarted one);
    3. the manifest announcer and 4. the address keeper (stopped);
    5. the transport and its averager process (shut down, after the averager's drain);
    6. the helper watch (stopped before the transport and the DHT are shut down on purpose);
    7. the swarm view (closed: a progress record still queued is stored before the DHT goes);
    8. for a pipeline stage, its event loop and 9. its link (closed, then the loop stopped);
    10. the trainer's inner loop (closed: the other ranks of a peer on several devices);
    11. the device announcer (stopped).

    On a stop (signal, ``max_rounds``) or a helper's death the checkpoint is written and the
    ``stopped`` event emitted while everything still runs.

    Raises:
        LocoError subclasses: bad address, unreachable bootstrap, missing or invalid manifest.
        ConfigError: the data directory is held by another peer or not writable; ``--port`` is taken
            (:func:`peer.net.dht_node.check_port_free`); too little free disk for two checkpoints
            and the shard cache (peer/state/disk.py); the run sets
            pipeline stages with sync.overlap (:func:`refuse_unimplemented`), for this peer's own
            run (--run/--preset) before any network work; a bad --stage (:func:`choose_stage`).
        HelperDied: this peer's DHT, p2pd or averager process died (killed for memory, most often);
            the checkpoint was written first, as on a stop, and the ``stopped`` event emitted.
    """
    stop_event = stop_event or threading.Event()
    with _TimedStack() as stack:
        peer = _assemble(stack, cfg, reporter, stop_event)
        reporter.emit(
            "status",
            message="training: catching up with the swarm if it is ahead, then the first round"
            if cfg.initial_peers
            else "training: the first round starts",
        )
        reporter.tick_until_first_round()  # off a terminal, a line every 4 s until the first round's
        stack.callback(reporter.stop_ticking)  # and none on the way out of a peer that never got there
        summary = peer.trainer.run()
        saved = peer.trainer.save()
        reporter.emit("stopped", peer_id=peer.peer_id, **summary.event_fields(), checkpoint=saved)
        if summary.fatal is not None:  # a helper process died: the checkpoint is written, now say why
            raise summary.fatal
        peer.watch.raise_if_died()
        return (EXIT_INTERRUPTED if summary.interrupted else 0), summary


def _read_local_run(cfg: JoinConfig, reporter: Reporter):
    """The run known before any network work (--run, --preset, or a new swarm's default; None for a
    plain join) and its corpus, read now so that a wrong data path fails in seconds. Also sets up
    this process: the device is resolved, torch's threads and the host allocator set.

    Returns:
        ``(local, corpus)``, both None for a plain join; the corpus None too when there are initial
        peers and the run's tokenizer is held nowhere here (read after the DHT starts, the run's
        peers asked for the tokenizer first).

    Raises:
        ConfigError: the local run sets pipeline stages with sync.overlap; the device is missing.
        DataError and the like: the local run's data cannot be read (peer/train/data.py).
    """
    if cfg.new_run is not None:
        refuse_unimplemented(cfg.new_run)
    device = resolve_device(cfg.device.device)  # a device this machine lacks fails now, before the DHT starts
    if device.type != "cpu":  # the sync runs beside a card's training thread: it goes second
        lifetime.lower_background_priority()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    # before the transport forks its averager, which inherits the thresholds
    tune_host_allocator()
    local = cfg.new_run if cfg.new_run is not None or cfg.initial_peers else RunManifest()
    corpus = None
    if local is not None and cfg.initial_peers and not is_held(local.data, cache_dir=default_cache_dir()):
        reporter.emit("status", message="the run's tokenizer is not on this machine: asking the peers once connected")
        return local, None  # read once the DHT is up (_assemble), the peers asked for the tokenizer first
    if local is not None:
        data = with_local_data(local.data, cfg.data_path, run=f"run {local.run_id} ({local.name})")
        reporter.emit("status", message=f"reading the data of run {local.run_id} ({local.name}): {describe(data)}")
        with Waiting("reading the run's data"):  # hashing it (and at first tokenizing) takes a while
            corpus = _load_data(data, cfg)
    return local, corpus


def _load_data(data, cfg: JoinConfig, peers=None):
    """The run's corpus, or its shard list and validation shards (peer/shards/corpus.py), asking
    ``peers`` (a PeerSource) too."""
    cap = None if cfg.data_cache_gb is None else int(cfg.data_cache_gb * 1e9)
    if data.source == "shards":
        return load_data(data, cache_dir=default_cache_dir(), cache_bytes=cap, peers=peers)
    return load_data(data, cache_dir=default_cache_dir())


def _check_disk_space(checkpoint, size_bytes: int, corpus) -> None:
    """Refuse to train without room for two checkpoints of ``size_bytes`` beside ``checkpoint`` and,
    for a sharded run, for its shard cache (peer/state/disk.py).

    Raises:
        ConfigError: a disk is short (exit 78), naming the directory, the free and the needed GB.
    """
    needs = [disk.checkpoint_need(checkpoint, size_bytes)]
    if isinstance(corpus.make_sampler, ShardedRun):
        store = corpus.make_sampler.store
        needs.append(disk.shard_cache_need(store.root, cap_bytes=store.cap_bytes, run_bytes=corpus.corpus_bytes))
    disk.check_disk_space(needs)


def _assemble(stack: ExitStack, cfg: JoinConfig, reporter: Reporter, stop_event: threading.Event) -> _Peer:
    """Acquire everything :func:`join` lists, in that order, each registered on ``stack`` right
    after it is acquired; emit ``started``. An exception leaves what was acquired on ``stack``.

    Raises:
        What :func:`join` raises, but for HelperDied from training.
    """
    stack.enter_context(hold_data_dir(cfg.data_dir))
    # a taken --port fails now, naming it, not as a failed bootstrap once p2pd cannot listen
    dht_node.check_port_free(cfg.host, cfg.port)
    local, corpus = _read_local_run(cfg, reporter)
    identity = ensure_identity(cfg.data_dir / "identity.key")
    signer = PeerSigner.from_identity(identity)  # signs this peer's records under its peer id
    # Peers seen before (peers.json): the way back into the swarm when the initial peers are gone.
    book = AddressBook.load(cfg.data_dir / ADDRESS_BOOK)
    where = f"{cfg.host}:{cfg.port}" if cfg.port else f"{cfg.host}, any free port"
    reporter.emit(
        "status",
        message=f"starting the DHT node on {where}"
        + (f", connecting to {len(cfg.initial_peers)} initial peer(s)" if cfg.initial_peers else " (a new swarm)"),
    )
    dht = first_dht = start_dht_remembering(
        lambda peers: reachability.start_node(
            peers,
            host=cfg.host,
            port=cfg.port,
            announce=cfg.announce,
            identity_path=str(identity),
            client_mode=cfg.client_mode,
        ),
        cfg.initial_peers,
        book,
    )
    stack.callback(first_dht.shutdown)
    # can the swarm dial this peer? one line says; an unreachable peer goes on in client mode, relayed
    dht, reach = reachability.reach_out(dht, cfg, reporter, identity_path=str(identity))
    if dht is not first_dht:  # restarted in client mode (the first node is shut down already)
        stack.callback(dht.shutdown)
    signed = _start_run(local, cfg) if not cfg.initial_peers else _find_run(dht, cfg, reporter)
    manifest = signed.manifest
    refuse_unimplemented(manifest)  # the swarm's run, known only now
    S = manifest.pipeline.stages
    for k in range(S):  # this node stores only signed records of its run (and of its stages)
        protect_run(dht, stage_key(manifest.run_id, k))
    stage = choose_stage(dht, manifest, cfg, signer, client_mode=reach.client_mode) if S > 1 else None
    key = manifest.run_id if stage is None else stage_key(manifest.run_id, stage)
    # Every peer keeps its run's signed manifest alive, so the swarm outlives its bootstrap node.
    announcer = swarm_dht.ManifestAnnouncer(dht, signed).start()
    stack.callback(announcer.stop)
    peer_id = str(dht.peer_id)
    if peer_id != signer.peer_id:
        raise ConfigError(
            f"the DHT runs as peer {peer_id}, but {identity} is the key of {signer.peer_id}: "
            "move the identity file away to create a new identity"
        )
    keeper = AddressKeeper(dht, book, run_id=manifest.run_id, signer=signer, publish=not reach.client_mode).start()
    stack.callback(keeper.stop)
    # a sharded run, or one with a BPE: shards and the tokenizer to and from the peers (peer/shards/share.py)
    sharing: ShardSharing | None = None
    live: list[SwarmView] = []
    if manifest.data.source == "shards" or manifest.data.tokenizer == "bpe":
        known = [a.rsplit("/p2p/", 1)[1] for a in cfg.initial_peers if "/p2p/" in a]
        sharing = ShardSharing(
            dht,
            manifest.run_id,
            lambda: [*(p.peer_id for s in live for p in s.others()), *known],
            tokenizer_sha256=manifest.data.tokenizer_sha256,
            cache_dir=default_cache_dir(),
        )
        stack.callback(sharing.close)
    if corpus is None or manifest.data != local.data:
        data = with_local_data(manifest.data, cfg.data_path, run=f"run {manifest.run_id} ({manifest.name})")
        reporter.emit("status", message=f"reading the run's data: {describe(data)}")
        with Waiting("reading the run's data"):  # hashing it (and at first tokenizing) takes a while
            if sharing is not None:  # a tokenizer held nowhere here: the peers first (peer/train/bpe.py)
                prefetch(data, cache_dir=default_cache_dir(), peers=sharing.fetch_tokenizer)
            corpus = _load_data(data, cfg, peers=[sharing.source] if sharing else None)
    if sharing is not None and isinstance(corpus.make_sampler, ShardedRun):
        sharing.serve(corpus.make_sampler)
    reporter.emit("status", message="building the model and starting the averager")
    setting_up = stack.enter_context(Waiting("building the model and starting the averager"))

    def make_model() -> torch.nn.Module:
        if stage is None:
            return build_model(manifest.model, corpus.tokenizer)
        return build_stage(manifest.model, S, stage, corpus.tokenizer)

    # The averager's process is forked before the model and the round state exist: a child forked
    # after them would keep its own copy of every page of θ, φ and the outer state the peer later
    # writes (copy-on-write), a few copies of the model for nothing. Shapes come from a model on the
    # meta device (no storage); ``freeze_for_fork`` keeps the garbage collectors off the pages parent and
    # child share (peer/net/lifetime.py).
    with torch.device("meta"):
        skeleton = make_model()
        shapes = [p.shape for p in skeleton.parameters()]
        outer = make_outer(manifest, shapes)
        payload_shapes, phi_from = outer.payload_shapes(shapes), outer.phi_from(len(shapes))
        size = checkpoint_bytes(
            parameters=sum(s.numel() for s in shapes), outer_state=sum(t.numel() for t in outer.state_tensors())
        )
    del skeleton, outer
    # a model too big for this machine fails now, in one line, not by the OOM killer mid-round (a stage: not sized)
    need = memory_check.check_join(manifest, cfg.device) if stage is None else None
    checkpoint = stage_checkpoint(cfg, manifest, stage)
    _check_disk_space(checkpoint, size, corpus)  # a full disk fails now, not at the first checkpoint
    # a pipeline stage syncs, publishes and serves its state under its own key, among its replicas
    lifetime.freeze_for_fork()
    transport = NetworkTransport(
        dht,
        shapes,
        payload_shapes,
        key,
        manifest.sync,
        compression=manifest.compression,
        phi_from=phi_from,
        client_mode=reach.client_mode,
        uplink_mbps=cfg.uplink_mbps,
        max_weight_tokens=round_token_cap(manifest),
        memory_dir=checkpoint.parent,  # whom it leaves out, kept beside the checkpoint across restarts
        signer=signer,  # seals the means it sends as an owner
    )
    stack.callback(transport.shutdown)  # the averager first drains the means its groupmates still read
    model = make_model()
    # a helper killed (for memory, most often) stops the peer as a signal would, then exits 75
    watch = (
        lifetime.HelperWatch(stop_event, lifetime.PEER_RESTART)
        .watch_dht("peer's", dht)
        .watch("peer's averager", transport.averager)
        .start()
    )
    stack.callback(watch.stop)  # runs before the helpers are shut down on purpose
    # One ttl for every peer of the run (protocol/liveness.py), so readers know when a record was published.
    # records are signed and stored, and read ahead of a round's end, off the training thread
    swarm = SwarmView(
        dht,
        run_id=key,
        signer=signer,
        record_ttl_s=liveness.record_ttl_s(manifest),
        max_sync_s=transport.max_sync_seconds,
    ).start_background()
    stack.callback(swarm.close)  # a record still queued reaches the DHT before it shuts down
    live.append(swarm)  # the peers a sharded run asks for shards: the live ones, then the initial ones
    trainer_cfg = dataclasses.replace(cfg.trainer, checkpoint_path=checkpoint, serves_state=not reach.client_mode)
    # CUDA is first touched here, after the transport forked its averager (docs/algorithms.md §8)
    d = cfg.device
    placement, notes = place(
        d.device,
        precision=d.precision,
        compile=d.compile,
        micro_batch_sequences=d.micro_batch_sequences,
        max_memory_gib=d.max_memory_gib,
        peak_tflops=d.peak_tflops,
        activation_checkpointing=d.activation_checkpointing,
    )
    if need is not None:  # the card's free memory, known once CUDA is touched (after the averager's fork)
        memory_check.check_card(need, placement.device)
    make_inner = None
    if stage is not None:
        if len(placement.devices) > 1:
            raise ConfigError(f"--device {d.device}: a pipeline stage trains on one device; name one")
        loop = LoopThread()
        stack.callback(loop.stop)
        link = pipeline_link(dht, loop, manifest, stage, corpus.tokenizer.vocab_size, swarm, signer, reporter)
        stack.callback(link.close)
        make_inner = functools.partial(StageInnerLoop.for_placement, link=link, stop=stop_event)
    trainer = Trainer(
        manifest=manifest,
        model=model,
        corpus=corpus,
        swarm=swarm,
        transport=traffic.budgeted(transport, cfg.data_dir, cfg.max_gb_per_day),  # --max-gb-per-day
        config=trainer_cfg,
        reporter=reporter,
        stop_event=stop_event,
        placement=placement,
        make_inner=make_inner,
        evaluates_phi=stage is None,
        state_key=key,
    )
    if corpus.make_sampler is not None:  # a sharded run: its loader thread (peer/shards/stream.py)
        stack.callback(cast(ShardSampler, trainer.inner.sampler).close)
    stack.callback(trainer.inner.close)  # the other ranks of a peer on several devices (peer/train/ddp.py)
    if stage is not None:  # a stage after 0 registers its server at its first inner step
        blocks = cast(range, model.layers)  # a pipeline stage holds a range of the blocks (peer/pipeline/stages.py)
        reporter.emit(
            "status", message=f"pipeline stage {stage} of 0-{S - 1} (blocks {blocks.start}-{blocks.stop - 1})"
        )
    micro_batch = trainer.fit_micro_batch()
    setting_up.close()
    device_fields = placement.event_fields()
    # what this peer trains on, for `peer status` and the monitor (signed, like its records)
    devices = DeviceAnnouncer(dht, manifest.run_id, signer, DeviceRecord.from_event(device_fields)).start()
    stack.callback(devices.stop)
    reporter.emit(
        "started",
        version=protocol.__version__,
        peer_id=peer_id,
        **device_fields,
        micro_batch=micro_batch or manifest.batch_sequences,
        batch_sequences=manifest.batch_sequences,
        maddrs=reachability.printable_maddrs(dht, reach),
        relayed_at=reachability.relay_maddrs(dht, reach),
        run_id=manifest.run_id,
        run_name=manifest.name,
        parameters=parameter_count(model),
        inner_steps=manifest.sync.inner_steps,
        stage=stage,
        threads=torch.get_num_threads(),
    )
    for note in notes:
        reporter.emit("warning", message=note)
    return _Peer(trainer=trainer, watch=watch, peer_id=peer_id)
