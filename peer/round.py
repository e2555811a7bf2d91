"""The round loop of one peer, told once: inner phase → publish → sync → outer step → catch-up.

Implements DiLoCo (arXiv 2311.08105, Algorithm 1) for one worker, or NoLoCo (arXiv 2506.10911)
when the run says so, with the swarm around it: state download when the swarm is ahead, progress
records in the DHT, local checkpoints and a clean stop on a signal. What differs between the
algorithms (whom to sync with, whose state to adopt, what to average) lives on the outer
algorithm objects (peer/train/outer.py); the swarm's records on :class:`SwarmView`; position and
counters on the types of peer/progress.py.

With ``sync.overlap`` a round's sync runs in the background while the next round trains
(:meth:`Trainer._overlap_step`; the update rules in peer/train/overlap.py, the thread in
peer/sync/background.py), from round ``sync.overlap_from_round`` on (the rounds before it sync
blocking, :meth:`Trainer._blocking`). With ``"streaming"`` (Streaming DiLoCo) each fragment of the
model syncs on its own schedule inside the round instead (:meth:`Trainer._stream_after_step`,
:meth:`Trainer._streaming_step`; the rules in peer/train/streaming.py). A checkpoint taken with a
sync in flight holds the last applied φ and this peer's θ; a restart drops that sync (its own
progress stays in θ and joins the next Δ).

Over 300 lines on purpose: the whole round (its phases, catch-up, and the state the loop holds
between them: φ, snapshots, checkpoint) is told in this one file, so it reads top to bottom.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from peer.config import TrainerConfig
from peer.progress import RoundOutcome, RoundProgress, SyncReport, TrainSummary, combine_sync_reports
from peer.reporting import Reporter
from peer.state.checkpoint import (CheckpointWriter, PeerState, copy_live, encode_checkpoint, export_phi,
                                   fetch_residuals, load_checkpoint, restore_extras, write_checkpoint)
from peer.state.snapshot import SealedTensor, StateSnapshot, make_snapshot, make_snapshot_from, seal_tensor
from peer.sync.background import BackgroundSync
from peer.sync.membership import SwarmView
from peer.sync.screening import round_token_cap
from peer.state.download import DownloadedState, check_sanity
from peer.state.vouching import MIN_INNER_STEP_S, Vouching
from peer.sync.transport import NetworkTransport
from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch, validation_bits_per_byte
from peer.train.device import Placement, flops_per_token, mfu
from peer.train.inner import InnerLoop, make_inner_loop
from peer.train.model import embedding_parameter_count, evaluate, parameter_count
from peer.train.outer import GroupChoice, check_finite, make_outer, pseudo_gradient, step_on_copies
from peer.train.overlap import EagerState, next_start, round_progress
from peer.train.streaming import fragment_outers, land, partition, payload_indices, sync_offset
from protocol.errors import BadPayload, CheckpointError, HelperDied, SyncError
from protocol.manifest import RunManifest
from protocol.records import ProgressRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _PreparedStep:
    """An outer step computed in the background thread as soon as a sync's mean arrived
    (:meth:`Trainer._prepare_step`), for the round loop to install at the landing instead of
    computing it then."""

    mean: list[torch.Tensor]
    """The mean it applied (the landing installs it only for this very mean)."""
    base: bytes
    """Digest of the snapshot (φ and outer state) it was applied to."""
    snapshot: StateSnapshot
    """φ and the outer state after the step, as the next round's snapshot."""


@dataclasses.dataclass(frozen=True)
class _PreparedFragment:
    """Streaming: a fragment's outer step computed in the sync's thread as soon as its mean arrived
    (:meth:`Trainer._prepare_fragment`), with its result sealed for the round's snapshot; the
    landing copies it into φ_p and the fragment's outer state instead of computing it then."""

    mean: list[torch.Tensor]
    """The mean it applied (the landing installs it only for this very mean)."""
    base: tuple[torch.Tensor, ...]
    """The immutable tensors it stepped from (φ_p, then the fragment's outer state): installed only
    while they are still what this peer holds (:meth:`Trainer._held`)."""
    sealed: tuple[SealedTensor, ...]
    """φ_p and the fragment's outer state after the step, copied, checked and hashed."""


FINISHING_RECORD_WAIT_S = 5.0
"""How long a peer waits, after a round, for the records of peers finishing the same round before it
runs the re-sync rule (s; their publish normally takes milliseconds to ~1 s)."""


RECORDS_REUSE_S = 1.5
"""A read of the progress records at most this old is reused instead of reading the DHT again: at
a round's end, the read asked for in the background shortly before (:data:`RECORDS_PREFETCH_S`),
and with ``sync.overlap`` in the re-sync rule after the round, the read the round's end used (asked
for up to that lead before the end, plus the round's end work). Each read is tens of milliseconds
of the inner loop's time, and with overlap nothing else holds the loop at a round's end."""

RECORDS_PREFETCH_S = 0.5
"""The round loop asks for the progress records in the background once the inner steps left until
it needs them (the round's end; streaming: the round's first fragment sync) take at most this long
(s, at the last step's time). With inner steps longer than this nothing is asked for ahead: the
loop reads at that point, a read that is then a small part of even one step."""

EXTRA_STEPS_FRACTION = 1.0
"""With ``delayed`` or ``eager`` overlap, a round past its H inner steps whose sync in flight has
not landed yet takes more inner steps instead of waiting, up to this fraction of H
(:meth:`Trainer._trains_while_waiting`): a peer faster than its groupmates otherwise idles at every
landing until the slowest one's contribution is there. 1.0: at most 2·H steps a round."""

JOINER_WAIT_S = 10.0
"""How long a fresh peer keeps reading the records for a state to adopt while peers ahead of it are
live, before it trains from its own initial φ (s; :meth:`Trainer.catch_up`)."""


def checkpoint_due(last: float | None, now: float, every_s: float) -> bool:
    """Whether a round's end writes the checkpoint: every round with ``every_s`` 0, else the first
    round's end and then once ``every_s`` seconds (monotonic clock) have passed since the last one.
    A stop or the run's end always writes one (peer/node.py calls :meth:`Trainer.save`); what a
    crash loses is at most ``every_s`` seconds of this peer's rounds, which a restart then catches
    up from the swarm like a joiner."""
    return not every_s or last is None or now - last >= every_s


class Trainer:
    """Trains one peer. Construct with the swarm view and a started transport; call :meth:`run`.

    θ (and AdamW, gradients, the eval copy of the model) live on ``placement``'s device; φ and the
    outer state stay fp32 on the host (pinned when the device is CUDA), so Δ = φ − θ is formed in
    fp32 on the host and peers that complete a round together hold bit-identical φ whatever they
    trained on (ALGORITHMS.md §8). Without a placement the peer trains on the CPU in fp32.
    """

    def __init__(self, *, manifest: RunManifest, model: torch.nn.Module, corpus: Corpus, swarm: SwarmView,
                 transport: NetworkTransport, config: TrainerConfig, reporter: Reporter, stop_event: threading.Event,
                 placement: Placement | None = None, make_inner=None, evaluates_phi: bool = True,
                 state_key: str | None = None):
        self.m, self.swarm, self.transport = manifest, swarm, transport
        self.state_key = state_key or manifest.run_id
        """What its snapshots say they belong to: the run id, or a pipeline stage's key (peer/pipeline/peer.py)."""
        self.peer_id, self.cfg, self.reporter, self.stop_event = swarm.peer_id, config, reporter, stop_event
        self.placement = placement
        self.device = placement.device if placement is not None else torch.device("cpu")
        self.model = model = model.to(self.device)
        self.H = manifest.sync.inner_steps
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        pin = self.device.type == "cuda"
        self.phi = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        if pin:
            self.phi = [f.pin_memory() for f in self.phi]
        self.outer = make_outer(manifest, self.shapes)
        sampler = BatchSampler(corpus.train, seq_len=manifest.data.seq_len_tokens,
                               batch_sequences=manifest.batch_sequences,
                               seed=peer_seed(self.peer_id, manifest.model.init_seed))
        # an InnerLoop on the placement's device; several devices: rank 0 of a data-parallel loop (ddp.py)
        # (a pipelined peer's: the stage's loop, peer/pipeline/peer.py, through ``make_inner``)
        self.inner = (make_inner or make_inner_loop)(model, manifest.inner_optimizer, sampler, placement)
        self._micro_batch = self.inner.micro_batch_sequences
        layers = getattr(model, "layers", None)  # a pipeline stage holds a range of the blocks
        self._flops_per_token = flops_per_token(
            params=parameter_count(model), embedding_params=embedding_parameter_count(model),
            layers=len(layers) if isinstance(layers, range) else manifest.model.num_layers,
            hidden=manifest.model.hidden_size, seq_len=manifest.data.seq_len_tokens)
        self.evaluates_phi = evaluates_phi
        """False on a pipelined peer: it holds one stage's φ, not a model it could evaluate alone."""
        self.val_windows = validation_batch(corpus, manifest.data)
        self.tokenizer = corpus.tokenizer
        self._eval_model = copy.deepcopy(model) if evaluates_phi else None
        self.pos = RoundProgress()
        self._lock = threading.Lock()
        """Guards φ, the outer state and the position against the thread that serves joiners."""
        self._last_round = RoundOutcome(round=0, train_loss=0.0, tokens_per_s=0.0, tokens=0, peers=1, start_digest="",
                                        state_digest="", planned_group=None, sync=SyncReport())
        """The last finished round (its figures go into every progress record until the next one)."""
        self._last_eval: tuple[int, float | None] = (-1, None)
        self._snapshots: deque[StateSnapshot] = deque(maxlen=2)
        """States at the start of this and the last round, served to joiners (newest last)."""
        self._completed_with: tuple[str, ...] = (self.peer_id,)
        self._vouching = Vouching(min_round_s=self.H * MIN_INNER_STEP_S)
        """Its ledger of vouchers, the round clock and refused digests (peer/state/vouching.py)."""
        self._groupmates: tuple[str, ...] = ()
        """Who completed this peer's last sync with it: its signed statement in every record."""
        self._disagreed: set[str] = set()
        """Groupmates of the last sync that landed who had started it from another state than this peer's."""
        self._last_sync_failed = False
        """With overlap: the last sync that landed failed (this peer applied its own payload: off the swarm's φ)."""
        self._prefetched: tuple[int, int] | None = None
        """(round, inner step it is for) of the last read of the records asked for in the background
        ahead of the loop's read (:meth:`_prefetch_records`)."""
        self._prefetched_at = float("-inf")
        """When (monotonic s) that read was asked for."""
        self._waited = {"sync": 0.0, "resync": 0.0}
        """Seconds the training thread waited since the last ``round`` event: for a sync's mean
        (blocking: the whole sync; overlap: the part of a background sync still running when its
        mean was needed) and in the re-sync rule's catch-up (its reads, waits and downloads)."""
        self.summary = TrainSummary(peer_id=self.peer_id)
        self.fatal: HelperDied | None = None
        """Why :meth:`run` stopped without a signal: this peer's averager process died (raise it
        after :meth:`save`); None otherwise."""
        self._checkpoints = CheckpointWriter()
        """Writes each round's checkpoint in the background (:meth:`save`)."""
        self._copying: threading.Event | None = None
        """Set once the writer's thread copied θ and the moments for the last checkpoint (:meth:`save`)."""
        self._last_checkpoint: float | None = None
        """``time.monotonic()`` of the last round-end checkpoint (``checkpoint_every_s``'s clock)."""
        self.overlap = manifest.sync.overlap
        self._background = BackgroundSync() if self.overlap != "none" else None
        """With ``sync.overlap``: the last round's sync, running while this round trains."""
        self._overlap_from = manifest.sync.overlap_from_round
        """K: with ``delayed`` or ``eager``, rounds before K sync blocking (:meth:`_blocking`)."""
        self._anchor: list[torch.Tensor] | None = None
        """ψ, where this round's inner steps started, when not φ (peer/train/overlap.py)."""
        self._eager = EagerState()
        """Eager with outer momentum: this peer's own part of its outer state (never sent, not saved)."""
        self._adopted_in_flight = False
        """This peer adopted a state while the sync in flight ran, and kept it (see :meth:`_adopt`)."""
        self._prepared: _PreparedStep | None = None
        """With ``delayed`` or ``eager``: the outer step of the sync in flight, prepared by its thread."""
        self._sealed: dict[int, SealedTensor] = {}
        """Streaming: by state index (φ, then the outer state), the tensors that fragments' landings
        changed since the last snapshot, sealed (copied, checked, hashed: by the sync's thread when
        the step was prepared, else at the landing); the round's end snapshots from them and the
        last snapshot (:meth:`_take_snapshot`)."""
        self._fragment_prepared: _PreparedFragment | None = None
        """Streaming: the outer step of the fragment sync in flight, prepared by its thread."""
        self._fragments: list[list[int]] = []
        """Streaming: the parameter indices of each fragment (peer/train/streaming.py); [] otherwise."""
        self._flight: tuple[int, int, list[torch.Tensor] | None] | None = None
        """Streaming: (fragment, cumulative inner step its sync started, θ_p then as fp32 host tensors with
        ``fragment_merge = "shift"``, else None) of the sync in flight."""
        if self.overlap == "streaming":
            P = manifest.sync.fragments
            self._fragments = partition(self.names, P)
            self._fragment_outer = fragment_outers(self.outer, manifest, self._fragments, self.shapes)
            phi_from = self.outer.phi_from(len(self.phi))
            self._fragment_payload = [payload_indices(f, phi_from=phi_from) for f in self._fragments]
            self._fragment_offset = [sync_offset(p, inner_steps=self.H, fragments=P) for p in range(P)]
            self._fragment_order = sorted(range(P), key=lambda p: self._fragment_offset[p])
            """Fragments in the order their syncs come in a round (fragment 0, offset 0, first)."""
            self._fragment_tokens = [0] * P
            """Tokens trained since each fragment's last sync: the weight of its Δ in the group mean."""
            self._fragments_synced: set[int] = set()
            """The fragments whose sync of the current round started."""
            self._landed: list[SyncReport] = []
            """The fragment syncs that landed in the current round (its ``round`` event reports them)."""
            self._choice: tuple[int, GroupChoice, list] | None = None
            """(round, group choice, live records) of the current round's fragment syncs."""
        self._take_snapshot()

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> TrainSummary:
        """Train until ``max_rounds`` or until ``stop_event`` is set; return the summary.

        On a stop the current inner step finishes and the summary has ``interrupted=True``; the
        caller writes the checkpoint (:meth:`save`). When this peer's averager process dies
        (:class:`~protocol.errors.HelperDied`) the loop stops the same way and leaves the error in
        :attr:`fatal`, for the caller to raise after it wrote the checkpoint.

        Raises:
            HelperDied: the averager process died before the first round (restoring the
                checkpoint's residuals, or catching up).
        """
        if self.cfg.checkpoint_path is not None and self.cfg.checkpoint_path.exists():
            self._restore(self.cfg.checkpoint_path)
        self.catch_up()
        self.transport.share_state(lambda: list(self._snapshots))
        self._publish()
        self._wait_for_peers()
        self.summary.initial_eval_loss = self.eval_phi("initial")
        try:
            while not self._done() and not self.stop_event.is_set():
                self._inner_phase()
                if self.stop_event.is_set():
                    break
                outcome = (self._sync_and_step() if self._blocking(self.pos.round) else
                           self._streaming_step() if self._fragments else self._overlap_step())
                self._after_round(outcome)
                if not self._done():
                    self.catch_up()
            self._land_last_sync()
        except HelperDied as exc:
            # no round can sync any more: stop as on a signal (the round in progress unapplied, a
            # sync in flight dropped); the caller writes the checkpoint, then raises ``fatal``
            self.fatal = self.summary.fatal = exc
            self.stop_event.set()
        finally:
            if self._background is not None:
                self._background.shutdown(wait=False)
            try:
                self._checkpoints.flush()  # the last round's checkpoint is on disk when run() returns
            except CheckpointError as exc:
                self.reporter.emit("warning", message=str(exc))
        self.summary.interrupted = self.stop_event.is_set()
        self.summary.final_round = self.pos.round
        if not self.summary.interrupted:
            self.summary.final_eval_loss = self.eval_phi("final")
        self._publish(wait=True)  # the last record must reach the DHT before it shuts down
        self.transport.share_state(None)
        return self.summary

    def _done(self) -> bool:
        return self.cfg.max_rounds is not None and self.pos.round >= self.cfg.max_rounds

    def _inner_phase(self) -> None:
        """The rest of this round's H inner AdamW steps (DiLoCo Algorithm 1, lines 4-7)."""
        # a pipeline stage after the first steps as its callers do and ends its round when they do
        paced = getattr(self.inner, "paced_by_callers", False)
        while (paced or self.pos.step < self.H or self._trains_while_waiting()) and not self.stop_event.is_set():
            # a step past H (while waiting for a sync) keeps the lr of the round's last step
            lr_step = self.inner_step if paced or self.pos.step < self.H else (self.pos.round + 1) * self.H - 1
            try:
                result = self.inner.step(lr_step)
            except BadPayload as exc:
                # A non-finite loss or gradient: drop this round's progress rather than poison θ.
                self.reporter.emit("warning", message=f"{exc}; restarting the round from its start")
                self._set_theta(self.phi if self._anchor is None else self._anchor)
                self.pos.discard_step()
                if self._fragments:
                    self._fragment_tokens = [0] * len(self._fragments)
                continue
            if result.tokens == 0:
                if result.ends_round:
                    return
                continue  # a pipelined step that stopped before any work (stop_event is set)
            self.pos.record(loss=result.loss, tokens=result.tokens, seconds=result.seconds)
            if self._micro_batch is not None and result.micro_batch < self._micro_batch:
                self.reporter.emit("warning", message=f"out of {self.device} memory: micro-batch halved from "
                                                      f"{self._micro_batch} to {result.micro_batch} sequences")
            self._micro_batch = result.micro_batch
            self._prefetch_records(self.pos.step_s)
            if self._fragments:
                self._stream_after_step(result.tokens)
            if self.pos.step % max(1, self.H // 4) == 0 and self.pos.step < self.H:
                # Mid-round records let a joiner start at the swarm's current inner step.
                self._publish(train_loss=result.loss, tokens_per_s=self.pos.tokens_per_s)
            if result.ends_round:
                return

    def _blocking(self, round_: int) -> bool:
        """Whether the sync of round ``round_`` holds the round loop until its mean is applied:
        without ``sync.overlap``, and with ``delayed`` or ``eager`` in the rounds before
        ``sync.overlap_from_round`` (the swarm's round index, so a whole group switches at once; the
        first overlapping round, K, lands no earlier sync and starts its own in the background, as a
        run's first round with overlap does)."""
        return self._background is None or round_ < self._overlap_from

    def _trains_while_waiting(self) -> bool:
        """Past the round's H inner steps with ``delayed`` or ``eager`` overlap: whether to take one
        more inner step instead of waiting for the sync in flight, whose mean (and prepared outer
        step) is not there yet; at most ``EXTRA_STEPS_FRACTION``·H more. A peer faster than the
        slowest of its group would otherwise idle at every landing: its sync's all-reduce starts
        only when the slowest groupmate finished its round. The extra steps take the lr of the
        round's last step (the schedule never runs past round·H + H − 1), add to this round's Δ,
        and weigh in the group mean as the tokens they trained, up to the owners' cap of H steps'
        tokens (peer/sync/screening.py ``round_token_cap``). With streaming the same holds for its
        last fragment syncs of the round: a fragment sync in flight, or a fragment due whose start
        :meth:`_stream_after_step` postponed, keeps the round going (the extra steps add to every
        fragment's next Δ), so fragment 0's sync at the round's end finds none in flight."""
        bg = self._background
        if bg is None or self.pos.step >= self.H + int(EXTRA_STEPS_FRACTION * self.H):
            return False
        if self._fragments:
            # streaming: the round ends when its last fragment sync landed (fragment 0's then starts
            # without waiting); a fragment whose start was postponed starts during these steps
            return self._flight is not None or bool(self._postponed())
        return bg.in_flight and not bg.done

    def _prefetch_records(self, step_s: float) -> None:
        """After an inner step, the round's steps so far having taken ``step_s`` seconds each on
        average: ask for the progress records in the background (``SwarmView.prefetch``) when the
        steps left until the loop reads them take at most :data:`RECORDS_PREFETCH_S`, so the read at
        that point is not the inner loop's time: before the round's end (the group choice,
        :meth:`_round_records`, and the re-sync rule after the round, :meth:`catch_up`, which reuse
        it); with streaming also before the round's first fragment sync, where its group choice is
        made (a round's end then reads again: the re-sync rule needs the records of the round's end,
        not of its middle).

        Once asked, and past the round's H steps (it trains on while its sync is out:
        :meth:`_trains_while_waiting`) where the end comes when that sync lands, which no step count
        predicts, a read is asked for again whenever the last one asked is :data:`RECORDS_REUSE_S`
        − :data:`RECORDS_PREFETCH_S` old, so the point that reads finds one young enough to reuse
        even when the steps slowed down after the ask (on cores shared with other processes one
        step can take four times another)."""
        needed_at = self.H  # the round's end: the group choice and the re-sync rule after it
        if self._fragments and not (self._choice is not None and self._choice[0] == self.pos.round):
            # streaming's group choice is made at the round's first fragment sync
            needed_at = min((o for p, o in enumerate(self._fragment_offset)
                             if o > self.pos.step and p not in self._fragments_synced), default=self.H)
        # past needed_at only past H: a streaming offset is always ahead of the step
        if self.pos.step > needed_at or self._prefetched == (self.pos.round, needed_at):
            now = time.monotonic()
            if now - self._prefetched_at >= RECORDS_REUSE_S - RECORDS_PREFETCH_S and self.swarm.prefetch():
                self._prefetched, self._prefetched_at = (self.pos.round, needed_at), now
            return
        left = needed_at - self.pos.step  # 0: the read is now, nothing left to overlap it with
        if 0 < left and left * step_s <= RECORDS_PREFETCH_S and self.swarm.prefetch():
            self._prefetched, self._prefetched_at = (self.pos.round, needed_at), time.monotonic()

    def _round_records(self) -> list:
        """The live records the round's group choice comes from: the read asked for shortly before
        (:meth:`_prefetch_records`), waited for if still running, when it is at most
        :data:`RECORDS_REUSE_S` old; else a read now."""
        prefetched = self._prefetched is not None and self._prefetched[0] == self.pos.round
        return self.swarm.live(max_age_s=RECORDS_REUSE_S if prefetched else 0.0)

    def _sync_and_step(self) -> RoundOutcome:
        """Δ = φ − θ, the group's mean payload, the outer step, θ ← φ (Algorithm 1, lines 8-12)."""
        live = self._round_records()
        choice = self.outer.choose_group(self.peer_id, round_=self.pos.round, run_id=self.m.run_id,
                                         live=[(r.peer_id, r.record.round) for r in live if r.peer_id != self.peer_id])
        start_digest = self.state_digest
        try:
            delta = pseudo_gradient(self.phi, self._theta_on_host())
            check_finite(delta, "this peer's pseudo-gradient")
            payload = self.outer.payload(self.phi, delta)
        except BadPayload as exc:
            mean, report = None, SyncReport(note=f"{exc}: round discarded, φ unchanged")
        else:
            mean, report = self._sync(payload, choice, start_digest, round_=self.pos.round,
                                      weight=float(max(self.pos.tokens, 1)),
                                      expected_wait_s=self._groupmates_due_s(live, self.pos.round, choice))
            self._waited["sync"] += report.sync_s  # a blocking sync: the inner loop waited all of it
        done = dataclasses.replace(self.pos)  # the finished round's figures, before the position moves on
        with self._lock:
            if mean is not None:
                self.outer.apply(self.phi, mean)
            self.pos.start_round(self.pos.round + 1)
        self._set_theta_to_phi()
        self._note_group(done.round, report)
        self._take_snapshot()
        return self._outcome(done, live=live, start_digest=start_digest, choice=choice, report=report)

    def _overlap_step(self) -> RoundOutcome:
        """The end of a round with ``sync.overlap`` (peer/train/overlap.py): take the last round's
        sync from the background (waiting only if it is slower than a round) and apply its mean to
        φ, start this round's sync in the background, and start the next round from ψ (delayed:
        φ + this round's progress; eager: φ previewed with this peer's share of its fresh Δ).

        The outcome's ``sync`` is the sync that just landed (the last round's); the first round
        has none. A non-finite Δ or eager preview starts no sync and the next round from φ.

        The outer step of the landing sync and the snapshot after it were prepared by the sync's
        thread when its mean arrived (:meth:`_prepare_step`) and are installed here
        (:meth:`_install`); the price is one more copy of φ and the outer state in host memory
        from that moment until the landing (the snapshot deque's next entry, made early).
        """
        live = self._round_records()
        choice = self.outer.choose_group(self.peer_id, round_=self.pos.round, run_id=self.m.run_id,
                                         live=[(r.peer_id, r.record.round) for r in live if r.peer_id != self.peer_id])
        start_digest = self.state_digest
        done = dataclasses.replace(self.pos)
        try:
            delta = round_progress(self.phi if self._anchor is None else self._anchor, self._theta_on_host())
            check_finite(delta, "this round's progress")
        except BadPayload as exc:
            delta, problem = None, f"{exc}: round discarded"
        mean, report = None, SyncReport(note="overlap: this round's sync lands at the end of the next")
        if self._background.in_flight:
            mean, report = self._take_background()
        prepared, self._prepared = self._prepared, None
        with self._lock:
            installed = mean is not None and self._install(prepared, mean)
            if mean is not None and not installed:
                self.outer.apply(self.phi, mean)
            self.pos.start_round(self.pos.round + 1)
        if mean is not None:
            self._note_group(max(0, done.round - 1), report)  # the sync landing is the last round's
        if installed:
            self._snapshots.append(prepared.snapshot)
        else:
            self._take_snapshot()
        start = self.phi
        if delta is not None:
            # NoLoCo's payload holds φ itself: the sync reads a copy, φ may move under a dropped one
            payload = [t.clone() if any(t is p for p in self.phi) else t for t in self.outer.payload(self.phi, delta)]
            try:
                start = next_start(self.overlap, self.outer, self.phi, delta, payload,
                                   share=1.0 / max(1, choice.expected_size), eager=self._eager)
            except BadPayload as exc:
                problem = f"{exc}: round discarded"
            else:
                # the extra steps taken while waiting weigh up to the owners' cap of a round's tokens
                digest, weight = self.state_digest, float(min(max(done.tokens, 1), round_token_cap(self.m)))
                due_s = self._groupmates_due_s(live, done.round, choice)
                budget_s = self._wait_budget_s(done, max(self.H, done.steps_done))  # with its extra steps

                def sync_and_prepare(dropped):
                    mean, report = self._sync(payload, choice, digest, round_=done.round, weight=weight,
                                              expected_wait_s=due_s, wait_budget_s=budget_s, dropped=dropped)
                    if not dropped() and not self.stop_event.is_set():
                        self._prepared = self._prepare_step(mean, lands_in=done.round + 2)
                    return mean, report

                self._background.start(sync_and_prepare, round_=done.round, start_digest=digest)
        if start is self.phi:
            self.reporter.emit("warning", message=problem)
            self._eager.reset()  # the next round starts from φ, as a fresh worker's does
        self._anchor = None if start is self.phi else start
        self._set_theta(start)
        return self._outcome(done, live=live, start_digest=start_digest, choice=choice, report=report)

    def _outcome(self, done: RoundProgress, *, live: list, start_digest: str, choice: GroupChoice,
                 report: SyncReport) -> RoundOutcome:
        """The finished round ``done`` (its figures, taken before the position moved on) as its
        ``round`` event tells it; the position is already in the next round."""
        peak = self.placement.peak_tflops if self.placement is not None else None
        return RoundOutcome(round=self.pos.round, train_loss=done.train_loss, tokens_per_s=done.tokens_per_s,
                            tokens=done.tokens, peers=len(live) or 1, start_digest=start_digest,
                            state_digest=self.state_digest, planned_group=choice.members, sync=report,
                            mfu=mfu(done.tokens_per_s, self._flops_per_token, peak), micro_batch=self._micro_batch,
                            compute_s=done.compute_s, sync_wait_s=self._waited["sync"],
                            resync_wait_s=self._waited["resync"])

    def _take_background(self) -> tuple[list[torch.Tensor] | None, SyncReport]:
        """The sync in flight's mean and report; no mean when it failed after this peer adopted
        another state (its own payload belongs to the φ it left)."""
        start = time.monotonic()
        mean, report, _ = self._background.result()
        self._waited["sync"] += time.monotonic() - start
        self._last_sync_failed = report.failed
        adopted, self._adopted_in_flight = self._adopted_in_flight, False
        return (None if adopted and report.failed else mean), report

    def _prepare_step(self, mean: list[torch.Tensor], *, lands_in: int) -> _PreparedStep | None:
        """In the sync's background thread, once its mean arrived: the outer step applied to copies of
        the last snapshot's φ and outer state (``step_on_copies``), and the snapshot of the result
        (copy, finiteness check, hash) with the meta of round ``lands_in``, the round the landing
        starts. The round loop installs it at the landing (:meth:`_install`), so neither the outer
        step nor the snapshot is the inner loop's time (tens of milliseconds per million parameters
        each). None when the mean is malformed or the step not finite: the landing applies it
        itself, and reports it as without overlap. Reads only the snapshot deque's last entry
        (immutable, appended atomically by the round loop)."""
        base, n = self._snapshots[-1], len(self.phi)
        try:
            phi, state = step_on_copies(self.outer, base.tensors[:n], base.tensors[n:], mean)
            meta = {"run_id": self.state_key, "round": lands_in, "inner_step": lands_in * self.H}
            return _PreparedStep(mean=mean, base=base.digest, snapshot=make_snapshot(meta, [*phi, *state], owned=True))
        except (BadPayload, ValueError) as exc:
            logger.debug("outer step of round %d not prepared: %s", lands_in - 2, exc)
            return None

    def _install(self, prepared: _PreparedStep | None, mean: list[torch.Tensor]) -> bool:
        """Copy a prepared outer step into φ and the outer state (call under ``_lock``, before the
        position moves to the next round); whether it was installed. Only a step prepared from this
        very ``mean``, from the state this peer still holds (the last snapshot: an adoption since
        made another) and for the round the landing starts; else the caller applies ``mean``. Its
        snapshot is the caller's to append, after the position moved."""
        if (prepared is None or prepared.mean is not mean or prepared.base != self._snapshots[-1].digest
                or prepared.snapshot.meta["round"] != self.pos.round + 1):
            return False
        with torch.no_grad():
            for dst, src in zip([*self.phi, *self.outer.state_tensors()], prepared.snapshot.tensors, strict=True):
                dst.copy_(src)
        return True

    # ---- streaming (Streaming DiLoCo, arXiv 2501.18512; peer/train/streaming.py) ---------------
    def _stream_after_step(self, tokens: int) -> None:
        """After an inner step with ``sync.overlap = "streaming"``: land the fragment sync in flight
        once τ steps have passed since it started and its mean is there (:meth:`_land_due`), then
        start the sync of the next fragment whose offset in the round this step reached (fragment
        0's, at the round's end, is :meth:`_streaming_step`'s). One sync is in flight at a time:
        while one is, the next fragment's start is postponed to the first step after it landed, so
        the inner loop does not wait for it (its Δ_p then holds those steps too); a start postponed
        past the round's H steps is made in the steps a peer trains on while waiting
        (:meth:`_trains_while_waiting`). A peer that jumped ahead in the round (a joiner, or after
        evaluating φ) starts the syncs it jumped over one after another, in the same way."""
        for p in range(len(self._fragments)):
            self._fragment_tokens[p] += tokens
        self._land_due()
        for p in self._postponed():
            if self._flight is not None:
                return  # postponed: starts at the first step after the sync in flight landed
            self._start_fragment_sync(p, self.pos.round)
            self._land_due()

    def _postponed(self) -> list[int]:
        """The fragments (other than 0) whose offset this round reached and whose sync has not
        started, in offset order."""
        return [p for p in self._fragment_order
                if p not in self._fragments_synced and 0 < self._fragment_offset[p] <= self.pos.step]

    def _land_due(self) -> None:
        """Land the fragment sync in flight if τ inner steps passed since it started and its result
        is there; with τ = 0 at once, waiting for it (no overlap).

        τ is the earliest a mean lands (Streaming DiLoCo's delay, arXiv 2501.18512: merged after τ
        overlapped steps). A sync slower than τ steps lands at the first step its result is there
        (the next fragment's start waits for that step: :meth:`_stream_after_step`); the inner loop
        waits for it only at the round's end, once the steps it may train on past H are used up
        (:meth:`_trains_while_waiting`), so a slow uplink costs staleness, not compute. Groupmates
        may land the same mean at different steps: φ_p is touched only by that landing, so they
        still hold identical φ; only their local θ_p differ, as they do anyway. Each landing's
        overlap, in steps, is in the round's report (``overlap_steps``)."""
        if self._flight is None:
            return
        tau = self.m.sync.fragment_delay_steps
        if tau == 0 or (self.inner_step >= self._flight[1] + tau and self._background.done):
            self._land_fragment()

    def _round_choice(self, round_: int) -> tuple[GroupChoice, list]:
        """The group choice (and the live records it came from) for ``round_``'s fragment syncs,
        read from the DHT once per round."""
        if self._choice is None or self._choice[0] != round_:
            live = self._round_records() if round_ == self.pos.round else self.swarm.live()
            choice = self.outer.choose_group(self.peer_id, round_=round_, run_id=self.m.run_id,
                                             live=[(r.peer_id, r.record.round) for r in live
                                                   if r.peer_id != self.peer_id])
            self._choice = (round_, choice, live)
        return self._choice[1], self._choice[2]

    def _start_fragment_sync(self, p: int, round_: int) -> None:
        """Start fragment p's sync of ``round_`` in the background: Δ_p = φ_p − θ_p, the payload of
        its tensors only (``tensors`` of ``NetworkTransport.average``), weighted by the tokens
        trained since its last sync. A sync still in flight lands first (one at a time). A
        non-finite Δ_p starts nothing (a warning; the fragment's progress stays in θ)."""
        if self._flight is not None:
            self._land_fragment()
        self._fragments_synced.add(p)
        index = self._fragments[p]
        phi_p = [self.phi[k] for k in index]
        keep = self.m.sync.fragment_merge == "shift"   # θ_p as it is now is kept for the landing: a copy
        theta_p = [self.params[k].detach().to("cpu", torch.float32, copy=keep) for k in index]
        try:
            delta = pseudo_gradient(phi_p, theta_p)
            check_finite(delta, f"fragment {p}'s pseudo-gradient")
        except BadPayload as exc:
            self.reporter.emit("warning", message=f"{exc}: fragment {p} not synced in round {round_}")
            return
        # NoLoCo's payload holds φ_p itself: the sync reads a copy, φ may move under a dropped one
        payload = [t.clone() if any(t is q for q in phi_p) else t for t in self._fragment_outer[p].payload(phi_p, delta)]
        choice, live = self._round_choice(round_)
        # a postponed start and the steps past H make a fragment's steps more than a round's: its claim
        # is capped where its groupmates cap it (the owners' cap of a round's tokens)
        weight = float(min(max(self._fragment_tokens[p], 1), round_token_cap(self.m)))
        self._fragment_tokens[p] = 0
        digest = self.state_digest
        due_s = self._groupmates_due_s(live, round_, choice) if self._fragment_offset[p] == 0 else 0.0
        budget_s = self._wait_budget_s(self.pos, max(1, self.H // len(self._fragments)))
        base = self._held(self._fragment_state(p))

        def sync_and_prepare(dropped):
            mean, report = self._sync(payload, choice, digest, round_=round_, weight=weight, expected_wait_s=due_s,
                                      wait_budget_s=budget_s, fragment=p, dropped=dropped)
            if mean is not None and not dropped() and not self.stop_event.is_set():
                self._fragment_prepared = self._prepare_fragment(p, base, mean)
            return mean, report

        self._fragment_prepared = None
        self._background.start(sync_and_prepare, round_=round_, start_digest=digest)
        self._flight = (p, self.inner_step, theta_p if keep else None)

    def _fragment_state(self, p: int) -> list[int]:
        """Fragment p's state indices: its φ tensors, then its outer state's (one per parameter)."""
        n = len(self.phi)
        return [*self._fragments[p], *(n + k for k in self._fragments[p])]

    def _held(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """Immutable tensors equal to what this peer holds now at these state indices: the last
        snapshot's, or the sealed result of a landing since."""
        last = self._snapshots[-1].tensors
        return tuple(self._sealed[i].tensor if i in self._sealed else last[i] for i in indices)

    def _prepare_fragment(self, p: int, base: tuple[torch.Tensor, ...], mean: list[torch.Tensor]
                          ) -> _PreparedFragment | None:
        """In the sync's background thread, once fragment p's mean arrived: its outer step on copies
        of ``base`` (``step_on_copies``, bit-identical to applying it), the results sealed for the
        round's snapshot (``seal_tensor``: the finiteness check and the chunks' hashes). None when
        the mean is malformed or the step not finite: the landing applies it itself."""
        k = len(self._fragments[p])
        try:
            phi, state = step_on_copies(self._fragment_outer[p], base[:k], base[k:], mean)
            shapes = self._state_shapes()
            sealed = tuple(seal_tensor(t, index=i, shapes=shapes, owned=True)
                           for i, t in zip(self._fragment_state(p), [*phi, *state], strict=True))
        except (BadPayload, ValueError) as exc:
            logger.debug("outer step of fragment %d not prepared: %s", p, exc)
            return None
        return _PreparedFragment(mean=mean, base=base, sealed=sealed)

    def _land_fragment(self) -> None:
        """The fragment sync in flight lands (waiting for it if needed): φ_p ← OuterOpt_p(φ_p, mean)
        with its slice of the outer state, then θ_p by ``sync.fragment_merge``: θ_p ← α·θ_p +
        (1 − α)·φ_p (Streaming DiLoCo's merge) or θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync) ('shift',
        θ_p^sync kept when the sync started). Its report joins the round's. A failed sync applies
        this peer's own payload, as a failed blocking sync does; an outer step that would not be
        finite leaves φ_p as it was. On a stop nothing is applied: the sync is dropped, and θ keeps
        the fragment's progress."""
        mean, report = self._take_background()
        (p, started, at_sync), self._flight = self._flight, None
        report = dataclasses.replace(report, overlap_steps=(self.inner_step - started,))
        if self.stop_event.is_set():
            return  # stopping (the sync was cancelled, or will not be trusted): dropped, as at the end
        index = self._fragments[p]
        phi_p = [self.phi[k] for k in index]
        prepared, self._fragment_prepared = self._fragment_prepared, None
        if mean is not None:
            try:
                with self._lock:
                    if not self._install_fragment(prepared, p, mean):
                        self._fragment_outer[p].apply(phi_p, mean)
                        self._seal_fragment(p)
            except BadPayload as exc:
                self.reporter.emit("warning", message=f"{exc}: fragment {p}'s outer step skipped")
                report = dataclasses.replace(report, failed=True, agreeing=(), completed=(),
                                             note=f"fragment {p}: outer step skipped ({exc})")
        self._await_theta_copy()
        land([self.params[k] for k in index], phi_p, alpha=self.m.sync.fragment_alpha,
             rule=self.m.sync.fragment_merge, at_sync=at_sync)
        self._landed.append(report)

    def _install_fragment(self, prepared: _PreparedFragment | None, p: int, mean: list[torch.Tensor]) -> bool:
        """Copy a prepared fragment step into φ_p and the fragment's outer state (call under
        ``_lock``) and keep its sealed tensors for the round's snapshot; whether it was installed.
        Only a step prepared from this very ``mean`` and from fragment p's tensors as this peer still
        holds them (an adoption since replaced them); else the caller applies ``mean``."""
        held = self._held(self._fragment_state(p))
        if (prepared is None or prepared.mean is not mean or len(held) != len(prepared.base)
                or any(a is not b for a, b in zip(held, prepared.base))):
            return False
        live = [*self.phi, *self.outer.state_tensors()]
        with torch.no_grad():
            for sealed in prepared.sealed:
                live[sealed.index].copy_(sealed.tensor)
        self._sealed.update((sealed.index, sealed) for sealed in prepared.sealed)
        return True

    def _seal_fragment(self, p: int) -> None:
        """Seal fragment p's φ_p and outer state as they are now (a landing without a prepared step:
        copied and hashed on this thread), for the round's snapshot and the next prepared step's base."""
        live, shapes = [*self.phi, *self.outer.state_tensors()], self._state_shapes()
        self._sealed.update((i, seal_tensor(live[i], index=i, shapes=shapes)) for i in self._fragment_state(p))

    def _state_shapes(self) -> list[torch.Size]:
        return [*self.shapes, *(t.shape for t in self.outer.state_tensors())]

    def _streaming_step(self) -> RoundOutcome:
        """The end of a round with ``sync.overlap = "streaming"``: a fragment sync whose start is
        still postponed starts (waiting for the one in flight, and is waited for: the round's extra
        steps are used up), then fragment 0's (its mean lands τ steps into the next round, or
        later; at once with τ = 0), and the round's outcome reports the fragment syncs that landed
        during it. θ is not reset to φ: each fragment's merge did that part. The snapshot of the
        next round holds every mean landed so far."""
        choice, live = self._round_choice(self.pos.round)
        start_digest = self.state_digest
        done = dataclasses.replace(self.pos)
        # fragments due inside the round first (a start postponed this far, or jumped over: each
        # waits for the one before), fragment 0 last: its sync is the one in flight into the next
        # round (fragment 0 alone has offset 0, and syncs only here)
        for p in [*self._postponed(), 0]:
            self._start_fragment_sync(p, done.round)
            self._land_due()
        report = self._take_landed(done.round)
        with self._lock:
            self.pos.start_round(self.pos.round + 1)
        self._fragments_synced = set()
        self._take_snapshot(from_sealed=True)
        return self._outcome(done, live=live, start_digest=start_digest, choice=choice, report=report)

    def _take_landed(self, round_: int) -> SyncReport:
        """The fragment syncs that landed since the last call, as one report (noted as the sync of
        ``round_`` when any was tried)."""
        report, self._landed = combine_sync_reports(self._landed), []
        if report.attempts:
            self._note_group(round_, report)
        return report

    def _land_last_streaming_syncs(self) -> None:
        """At ``max_rounds`` with streaming: the sync in flight lands, then every fragment synced
        inside the round (offset > 0) syncs once more and lands at once, so the final φ holds every
        step (as the simulation's finish does); θ ← φ. Those fragments sync whether or not this
        peer trained steps since (a start postponed to the round's end leaves it none, weight 1),
        so its groupmates find it in that sync whatever their timing; fragment 0, synced at the
        round's end, only with steps since (never in a run without a skipped sync)."""
        if self._flight is not None:
            self._land_fragment()
        for p in range(len(self._fragments)):
            if self._fragment_offset[p] > 0 or self._fragment_tokens[p] > 0:
                self._start_fragment_sync(p, self.pos.round)
                if self._flight is not None:
                    self._land_fragment()
        self._take_landed(self.pos.round)
        self._set_theta_to_phi()
        self._take_snapshot()

    def _land_last_sync(self) -> None:
        """When training ends with a sync in flight: at ``max_rounds`` wait for it and apply its mean
        (φ then holds every round, θ ← φ); on a stop drop it, so φ stays the last applied one and
        θ keeps this peer's unsynced progress (what a checkpoint then holds)."""
        if self._background is None or not (self._background.in_flight or self._fragments):
            return
        if self.stop_event.is_set():
            self._background.drop("stopping")
            return
        if self._fragments:
            self._land_last_streaming_syncs()
            return
        mean, report = self._take_background()
        self._prepared = None  # applied here, once: nothing of the training thread overlaps it any more
        with self._lock:
            if mean is not None:
                self.outer.apply(self.phi, mean)
        self._note_group(max(0, self.pos.round - 1), report)
        self._anchor = None
        self._eager.reset()
        self._set_theta_to_phi()
        self._take_snapshot()

    def _note_group(self, round_: int, report: SyncReport) -> None:
        """Remember, of the sync of ``round_`` that just landed, who holds this peer's state after it
        (its own class in the re-sync rule), who completed it with this peer in full (its ledger of
        vouchers, and the statement its next records sign), and who averaged with it from another
        state (:meth:`_wait_for_peers_finishing` waits for their next records)."""
        self._completed_with = tuple(sorted({*report.agreeing, self.peer_id}))
        self._vouching.ledger.record_group(round_, report.completed)
        self._groupmates = tuple(sorted(report.completed))
        self._disagreed = set(report.group) - set(report.agreeing) - {self.peer_id}

    def _groupmates_due_s(self, live, round_: int, choice: GroupChoice) -> float:
        """Seconds until the last groupmate expected at ``round_``'s sync gets there, predicted from
        ``live`` (progress records: step and throughput); the matchmaking window covers it."""
        if choice.expected_size <= 1:
            return 0.0
        return self.swarm.seconds_to_finish(round_, live, inner_steps=self.H,
                                            batch_size_tokens=self.m.inner_optimizer.batch_size_tokens,
                                            peers=set(choice.members) if choice.members else None)

    @staticmethod
    def _wait_budget_s(progress: RoundProgress, steps: int) -> float:
        """How long a sync started now in the background may wait for late groupmates
        (peer/sync/deadlines.py ``wait_budget_s``): the inner-step time of the ``steps`` steps
        after which its mean is needed (delayed and eager: a round; streaming: H/P steps, when the
        next fragment's sync starts), at ``progress``'s seconds per step. A groupmate that comes
        at the very end costs the others the all-reduce's time at the landing; one that misses
        the group costs itself a failed sync (three windows) and a state download. 0 before any
        step was timed."""
        return steps * progress.step_s

    def _sync(self, payload: list[torch.Tensor], choice: GroupChoice, start_digest: str, *, round_: int,
              weight: float, expected_wait_s: float = 0.0, wait_budget_s: float = 0.0,
              fragment: int | None = None,
              dropped: Callable[[], bool] = lambda: False) -> tuple[list[torch.Tensor], SyncReport]:
        """The group's token-weighted mean payload, or this peer's own when there is no group or
        the sync fails (failed rounds are recorded, not fatal: DiLoCo paper Fig. 8). Reads no
        state of the loop, so it may run in the background thread (peer/sync/background.py).
        ``expected_wait_s``: until the last expected groupmate arrives (:meth:`_groupmates_due_s`).
        ``wait_budget_s``: a background sync's (:meth:`_wait_budget_s`); 0 for a blocking one.
        ``dropped``: a background sync's flag (peer/sync/background.py): it gives up, as on a stop.
        ``fragment``: streaming, the fragment whose tensors ``payload`` holds (its own key and buffers)."""
        if choice.expected_size <= 1:
            return payload, SyncReport(note=choice.note)
        # the ``sync`` event comes from the thread that syncs: a background sync's emit (a write to
        # stdout) is then not the inner loop's time
        self.reporter.emit("sync", round=round_, expected_group_size=choice.expected_size, peer_id=self.peer_id,
                           **({} if fragment is None else {"fragment": fragment}))
        start = time.monotonic()
        extra = {} if fragment is None else dict(fragment=fragment, fragments=len(self._fragments),
                                                 tensors=self._fragment_payload[fragment])
        try:
            result = self.transport.average(payload, weight=weight, round_=round_,
                                            expected_group_size=choice.expected_size, group_index=choice.index,
                                            start_digest=start_digest,
                                            should_stop=lambda: self.stop_event.is_set() or dropped(),
                                            expected_wait_s=expected_wait_s, wait_budget_s=wait_budget_s,
                                            **extra)
            check_finite(result.mean, "the group's mean payload")
        except (SyncError, BadPayload) as exc:
            note = f"no group: applied own step ({exc})"
            logger.info("round %d: %s", round_, note)
            return payload, SyncReport(bytes_sent=getattr(exc, "bytes_sent", 0),
                                       bytes_received=getattr(exc, "bytes_received", 0),
                                       sync_s=time.monotonic() - start, deadline_s=getattr(exc, "deadline_s", 0.0),
                                       note=note, failed=True)
        # groupmates that started from this peer's state hold the same state after the round
        refused = set(getattr(result, "refused", ()))  # owners whose means it refused vouch for nothing
        agreeing = [p for p, d in (result.start_digests or {}).items() if d == start_digest and p not in refused]
        completed = [p for p in result.group if p != self.peer_id and p not in refused]
        note = ""
        if refused:
            note = (f"refused the means of {getattr(result, 'refused_pieces', 0)} piece(s) from "
                    f"{', '.join(sorted(refused))} (applied as zeros / own values)")
        if result.excluded or result.partial_pieces:
            agreeing = completed = []  # which groupmates completed is not known here
            note = "; ".join(filter(None, [note, f"{result.partial_pieces} piece(s) averaged without a failed "
                                                 f"groupmate ({result.excluded} excluded here)"]))
        return result.mean, SyncReport(group_size=result.group_size, group=tuple(result.group),
                                       bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
                                       sync_s=result.seconds, deadline_s=result.deadline_s, attempts=result.attempts,
                                       note=note, agreeing=tuple(agreeing), completed=tuple(completed))

    def _after_round(self, outcome: RoundOutcome) -> None:
        """Count, publish and report the round; evaluate, checkpoint and export on their cadence."""
        self.swarm.round_finished()
        self.summary.record(outcome)
        self._last_round = outcome
        self._publish()
        self.reporter.emit("round", **outcome.event_fields(self.peer_id))
        self._waited = dict.fromkeys(self._waited, 0.0)
        k = self.cfg.eval_every_rounds
        if k and self.evaluates_phi and self.pos.round % k == 0 and not self._done() and self._evaluates(self.pos.round):
            self.eval_phi("periodic")
            self._keep_pace()
        if checkpoint_due(self._last_checkpoint, time.monotonic(), self.cfg.checkpoint_every_s):
            self._last_checkpoint = time.monotonic()
            self.save(background=True)
        k = self.cfg.export_phi_every_rounds
        if k and self.cfg.checkpoint_path is not None and self.pos.round % k == 0:
            with self._lock:
                phi = [t.clone() for t in self.phi]
            directory, round_ = self.cfg.checkpoint_path.parent, self.pos.round
            self._checkpoints.submit_call(lambda: export_phi(directory, names=self.names, phi=phi,
                                                             run_id=self.m.run_id, round_=round_))

    def _keep_pace(self) -> None:
        """After evaluating φ for the swarm, start this round at the inner step the swarm reached
        meanwhile (as a joiner does), not at step 0: otherwise this peer reaches the next sync an
        evaluation's time after its groupmates, often after their group formed, and trains that
        round alone. It trains fewer tokens this round; the all-reduce weights it by those it did.
        The inner lr schedule follows the step (round·H + step), as on every peer."""
        now = self.swarm.step_now(self.pos.round, inner_steps=self.H,
                                  batch_size_tokens=self.m.inner_optimizer.batch_size_tokens)
        if now > self.pos.step:
            logger.info("round %d: evaluated φ for the swarm; starting at inner step %d with the others",
                        self.pos.round, now)
            self.pos.step = now

    # ---- catch-up -----------------------------------------------------------------------
    def catch_up(self, attempts: int = 3) -> None:
        """Adopt the swarm's state while this peer is behind or diverged (the outer algorithm's
        re-sync rule, peer/state/resync.py), again while the swarm moved on during a download.

        A fresh peer (round 0, no step trained) that finds no state to adopt while live peers are
        ahead reads the records again twice a second, up to :data:`JOINER_WAIT_S`, before it
        trains from its own initial φ: the joiner's rule counts only states the records attest, and
        right after a round a groupmate's record can still be the last round's (it publishes four
        times a round), so the first read may attest nothing. Training alone from scratch instead
        would cost it a round and, with ``sync.overlap``, the sync it then drops on adopting."""
        started = time.monotonic()
        try:
            self._wait_for_peers_finishing()
            deadline, adopted = time.monotonic() + JOINER_WAIT_S, 0
            while adopted < attempts and not self.stop_event.is_set():
                if self._catch_up_once():
                    adopted += 1
                    continue
                fresh = self.pos.round == 0 and self.pos.step == 0
                if not (fresh and any(r.record.round > 0 for r in self.swarm.others())) or time.monotonic() >= deadline:
                    return
                self.stop_event.wait(0.5)
        finally:
            self._waited["resync"] += time.monotonic() - started

    def _wait_for_peers_finishing(self) -> None:
        """Wait until most peers whose last record is in the last quarter of the previous round
        published the round this peer is now in, at most :data:`FINISHING_RECORD_WAIT_S`; a stop
        ends the wait. Its groupmates finished the same sync at the same moment, so their next
        record is milliseconds to a second away.

        Without it the re-sync rule, run first, sees them one round behind (which it ignores), and a
        peer that differs from its group by one mean (a joiner that dropped a sync in flight on
        adopting) keeps syncing with it every round but never notices that it diverged.

        Not waited for: the groupmates that completed this peer's last landed sync from its own
        state (``_completed_with``): they applied the same mean to the same φ and hold this peer's
        state, so their next record can change nothing the re-sync rule decides. With
        ``sync.overlap`` also not the other peers in the last quarter unless this peer's last sync
        failed: nothing holds peers together at a round's end, a peer outside its group is then
        the one off the swarm's φ (it follows the swarm itself), and the wait was idle time of the
        inner loop, up to the whole bound while that peer sat in a failing sync of its own.

        Also waited for, wherever they are in that round: the groupmates of the last sync that
        landed who had started it from another state. With ``sync.overlap`` no sync holds peers
        together at a round's end, so a diverged peer can run ahead of its group by more than the
        last quarter of a round, round after round; without waiting for them it would see them a
        round behind every time and never adopt their state.
        """
        round_, closing = self.pos.round - 1, self.H - max(1, self.H // 4)
        blocking = self._blocking(round_)  # how the round just ended synced
        outsiders = blocking or self._last_sync_failed
        reuse_s = 0.0 if blocking else RECORDS_REUSE_S
        finishing = {r.peer_id for r in self.swarm.others(max_age_s=reuse_s)
                     if r.record.round == round_ and ((outsiders and r.peer_id not in self._completed_with and
                                                       r.record.inner_step - round_ * self.H >= closing) or
                                                      r.peer_id in self._disagreed)}
        deadline = time.monotonic() + FINISHING_RECORD_WAIT_S
        while finishing and not self.stop_event.is_set() and time.monotonic() < deadline:
            still = sum(1 for r in self.swarm.others() if r.peer_id in finishing and r.record.round == round_)
            if 2 * still < len(finishing):
                return
            self.stop_event.wait(0.1)

    def _catch_up_once(self) -> bool:
        """Download φ, outer state and round from every peer publishing the target digest at once
        (peer/state/download.py), checked against the digest, and start at the swarm's current inner
        step. A failed download is reported and leaves this peer's state unchanged."""
        target = self._resync_target()
        if target is not None and self._about_to_sync(target[0], target[2]):
            # Its donors are in the last quarter of their round: a state downloaded now would reach
            # the sync after their group formed (this peer alone for a round, then downloading
            # again). Wait for the state they publish after the sync instead.
            self._wait_until_past(target[0], target[2])
            target = self._resync_target()
        if target is None:
            return False
        round_, digest, donors = target
        start = time.monotonic()
        try:
            download = self.transport.download_state(donors, digest, self.cfg.state_download_timeout_s)
        except (BadPayload, SyncError) as exc:
            self.reporter.emit("warning", message=f"state download of round {round_} failed, continuing from "
                                                  f"round {self.pos.round}: {exc}")
            return False
        state = download.state
        try:
            with self._lock:
                check_sanity(state, self.phi)
        except BadPayload as exc:
            self._vouching.refused.add(digest)
            self.reporter.emit("warning", message=f"refused the state of round {round_} ({digest}) from "
                                                  f"{', '.join(donors)}, continuing from round {self.pos.round}: {exc}")
            return False
        reason = ("behind" if state.round > self.pos.round else "diverged" if state.round == self.pos.round
                  else "raced ahead")
        self._adopt(state)
        # Start where the swarm is inside this round (read again: it went on during the download), so
        # this peer reaches the sync with the others; the all-reduce weights its shorter round by the
        # tokens it actually processed.
        self.pos.step = self.swarm.step_now(self.pos.round, inner_steps=self.H,
                                            batch_size_tokens=self.m.inner_optimizer.batch_size_tokens)
        self.reporter.emit("adopted_state", round=self.pos.round, inner_step=self.inner_step,
                           seconds=time.monotonic() - start, reason=reason,
                           state_digest=self.state_digest, donors=download.chunks_by_donor,
                           failed_donors=download.failed, bytes=download.bytes_received)
        self._publish()
        return True

    def _resync_target(self) -> tuple[int, str, list[str]] | None:
        """The outer algorithm's re-sync rule over the records that may vouch, counting only the
        peers this peer completed a sync with in an earlier round, or, without history, what the
        records' signed ``groupmates`` attest (issue #17, item 3: :meth:`Vouching.screen`).

        With ``sync.overlap`` and a sync in flight, records one round ahead are left out, as records
        one round behind are: nothing holds peers together at a round's end, so a faster groupmate
        leads by up to a round (it goes on until it needs the mean this peer's sync in flight
        brings), and its state is this peer's own next one once that sync lands. Adopting it would
        skip a round and leave the leader's next sync without this peer (which then fails, and both
        adopt each other's states round after round). Not left out: a groupmate that averaged with
        this peer from another state in its last sync, and anyone when this peer's last landed
        sync failed (it applied its own payload: it is off the swarm's φ, and a peer that keeps
        missing its group falls further behind each round; it must follow the swarm)."""
        # the read just made at the round's end, with overlap (a blocking sync came after it)
        reuse_s = 0.0 if self._blocking(self.pos.round - 1) else RECORDS_REUSE_S
        others, vouchers = self._vouching.screen(self.swarm.others(max_age_s=reuse_s), round_=self.pos.round)
        if self._background is not None and self._background.in_flight and not self._last_sync_failed:
            others = [r for r in others
                      if not (r.record.round == self.pos.round + 1 and r.peer_id not in self._disagreed)]
        return self.outer.resync_target(
            [(r.peer_id, r.record.round, r.record.state_digest) for r in others],
            round_=self.pos.round, digest=self.state_digest, completed_with=self._completed_with,
            fresh=self.pos.round == 0 and self.pos.step == 0, vouchers=vouchers,
            groupmates={r.peer_id: r.record.groupmates for r in others},
            defers=not self.cfg.serves_state)  # client mode: its state cannot be adopted, so it follows

    def _about_to_sync(self, round_: int, donors: list[str]) -> bool:
        """Whether a donor of ``round_``'s state published a step in the last quarter of that round
        (records come four times a round, so this is the last one before its sync)."""
        closing = self.H - max(1, self.H // 4)
        return any(r.peer_id in donors and r.record.round == round_ and
                   r.record.inner_step - round_ * self.H >= closing for r in self.swarm.others())

    def _wait_until_past(self, round_: int, donors: list[str]) -> None:
        """Wait until most donors left ``round_`` (they synced and published the next round; a hung
        one must not hold this peer), at most one sync's bound, polling the DHT twice a second; a
        stop ends the wait."""
        deadline = time.monotonic() + self.swarm.max_sync_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            still = sum(1 for r in self.swarm.others() if r.peer_id in donors and r.record.round == round_)
            if 2 * still < len(donors):
                return
            self.stop_event.wait(0.5)

    def _adopt(self, state: DownloadedState) -> None:
        """Take a downloaded state. With overlap, a sync in flight of round k is kept when the state
        is of round k+1: its groupmates apply that mean to exactly this φ (so a joiner, whose first
        download always lacks the mean then in flight, is in step after its second); else dropped."""
        bg = self._background
        if bg is not None and bg.in_flight:
            # streaming: only fragment 0's sync, started at the round's end, is not in the next round's state
            if state.round == bg.round + 1 and (self._flight is None or self._fragment_offset[self._flight[0]] == 0):
                self._adopted_in_flight = True
            else:
                bg.drop("adopted the swarm's state")  # its mean belongs to a φ left behind
                if self._fragments:
                    self._flight = None
        self._anchor = None
        self._eager.reset()  # a peer that adopts starts from φ: a fresh worker in eager's terms
        with self._lock:
            for dst, src in zip([*self.phi, *self.outer.state_tensors()], [*state.phi, *state.outer_state]):
                dst.copy_(src)
            self.pos.start_round(state.round)
        self._set_theta_to_phi()
        if self._adopted_in_flight and self._flight is not None and self._flight[2] is not None:
            # 'shift': θ_p restarts from the adopted φ_p, so the steps to keep at the landing are those since
            p, started, _ = self._flight
            self._flight = (p, started, [self.phi[k].clone() for k in self._fragments[p]])
        self.inner.reset_optimizer()  # a joiner starts a fresh AdamW (ALGORITHMS.md §6.3)
        self.transport.reset_error_feedback()  # residuals of a φ this peer no longer holds
        self._completed_with = (self.peer_id,)
        self._groupmates = ()  # its last groupmates do not hold this state
        self._disagreed, self._last_sync_failed = set(), False
        if self._fragments:  # θ = φ: no fragment has progress of its own; this round's syncs are all ahead
            self._fragment_tokens, self._fragments_synced, self._landed = [0] * len(self._fragments), set(), []
        self._take_snapshot()

    def _wait_for_peers(self) -> None:
        """Start barrier for launchers that start several peers at once (``peer swarm``)."""
        want = self.cfg.wait_for_peers
        if want <= 1:
            return
        seen = self.swarm.wait_for(want, timeout_s=self.cfg.wait_for_peers_timeout_s, stop=self.stop_event,
                                   heartbeat=self._publish)
        if seen < want and not self.stop_event.is_set():
            self.reporter.emit("warning", message=f"only {seen} of {want} peers appeared within "
                                                  f"{self.cfg.wait_for_peers_timeout_s:.0f} s; starting anyway")

    # ---- state --------------------------------------------------------------------------
    @property
    def inner_step(self) -> int:
        """Cumulative inner steps of φ's history: indexes the inner lr schedule."""
        return self.pos.inner_step(self.H)

    @property
    def state_digest(self) -> str:
        return self._snapshots[-1].digest.hex()

    def _take_snapshot(self, *, from_sealed: bool = False) -> None:
        """Snapshot φ, outer state and position at a round boundary; its digest is what this peer
        publishes and what joiners download (peer/state/snapshot.py).

        ``from_sealed`` (streaming's round end, where φ and the outer state changed since the last
        snapshot only by the landings of fragments, each sealed): the last snapshot with the sealed
        tensors in place (``make_snapshot_from``: the same snapshot as one made afresh, with
        nothing copied or hashed here when the sync's thread sealed them); else one made afresh."""
        with self._lock:
            meta = {"run_id": self.state_key, "round": self.pos.round, "inner_step": self.pos.round * self.H}
            if from_sealed:
                snapshot = make_snapshot_from(self._snapshots[-1], meta, self._sealed.values())
            else:
                snapshot = make_snapshot(meta, [*self.phi, *self.outer.state_tensors()])
            self._sealed = {}
        self._snapshots.append(snapshot)

    def fit_micro_batch(self) -> int | None:
        """On CUDA with no micro-batch asked for, find and use the largest that fits the memory budget
        with a margin (:meth:`InnerLoop.fit_micro_batch`); returns the micro-batch in sequences (None:
        the whole batch at once). Call before :meth:`run`.

        Raises:
            ConfigError: not even one sequence fits.
        """
        p = self.placement
        if p is not None and self.device.type == "cuda" and p.micro_batch_sequences is None \
                and p.memory_budget_gib is not None:
            self._micro_batch = self.inner.fit_micro_batch(budget_bytes=p.memory_budget_gib * 1024 ** 3)
        return self._micro_batch

    def _set_theta_to_phi(self) -> None:
        """θ ← φ (see :meth:`_set_theta`)."""
        self._set_theta(self.phi)

    def _set_theta(self, source: list[torch.Tensor]) -> None:
        """θ ← ``source`` (fp32 host tensors shaped like φ): to the device, asynchronous from pinned
        memory and waited for here, so the host tensors may change again once this returns. Waits
        first for a checkpoint's copy of θ still under way (:meth:`save`)."""
        self._await_theta_copy()
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            for p, f in zip(self.params, source):
                p.copy_(f, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)

    def _await_theta_copy(self) -> None:
        """Before θ is written other than by an inner step's update (which waits on its own): wait
        for a checkpoint's copy of θ and AdamW's moments still under way in the writer's thread."""
        if self._copying is not None:
            self._copying.wait()
            self._copying = None

    def _theta_on_host(self) -> list[torch.Tensor]:
        """θ as fp32 host tensors (θ itself on a CPU peer, copies from a GPU)."""
        return [p.detach().to("cpu", torch.float32) for p in self.params]

    def save(self, *, background: bool = False) -> str | None:
        """Write the checkpoint (atomically, peer/state/checkpoint.py); its path, or None without one.

        With ``background`` the state is written by a background thread (the round loop's
        checkpoint every round: the training thread does not wait for the disk). φ and the outer
        state are the last snapshot's copies; θ and AdamW's moments are copied by that thread when
        it is idle, while the next inner step's forward and backward passes run, and the step's
        update (or any write of θ before it: θ ← φ, a streaming landing's merge) waits until the
        copy is done; when a write is still under way they are copied here instead. Otherwise the
        write in progress is waited for and this one written before returning.

        With ``sync.overlap`` a sync is usually in flight: the checkpoint holds the last applied φ,
        θ (with this peer's progress not yet in φ) and the committed residuals; a restart from it
        drops that sync (peer/train/overlap.py).

        Raises:
            CheckpointError: this write failed (without ``background``), or the last background one
                did; the checkpoint before it is intact.
        """
        if self.cfg.checkpoint_path is None:
            return None
        # θ and the moments are copied in the writer's thread while the next step's forward and
        # backward passes run (its update waits for the copy; every other writer of θ, a streaming
        # landing's merge included, waits in _await_theta_copy): not when a write is still under way
        # (the copy would wait for it), nor for a pipeline stage (its steps are its callers')
        defer = background and self._checkpoints.idle() and type(self.inner).step is InnerLoop.step
        adam = self.inner.state_dict()
        # fetched anew every time: after an adoption the averager holds none, so none are saved
        residuals, problem = fetch_residuals(self.transport.error_feedback_residuals)
        if problem:
            self.reporter.emit("warning", message=problem)
        with self._lock:
            phi, momentum, private = self.phi, self.outer.state_tensors(), ()
            snapshot = self._snapshots[-1]
            if not self._sealed and snapshot.meta["round"] == self.pos.round:
                # φ and the outer state change only with a new snapshot, or by a streaming landing
                # (which seals what it changed): its private copies are theirs, and need no second
                # copy on the training thread
                phi, momentum = list(snapshot.tensors[:len(phi)]), list(snapshot.tensors[len(phi):])
                private = ("phi", "momentum")
            file = encode_checkpoint(PeerState(
                run_id=self.m.run_id, round=self.pos.round, inner_step=self.inner_step, round_step=self.pos.step,
                round_tokens=self.pos.tokens, names=self.names, phi=phi, momentum=momentum,
                theta=list(self.params) if defer else self._theta_on_host(), adam_exp_avg=adam and adam["exp_avg"],
                adam_exp_avg_sq=adam and adam["exp_avg_sq"], adam_step=adam["step"] if adam else 0,
                residuals=residuals, data=self.inner.sampler.state(), vouchers=self._vouching.ledger.as_dict()),
                private=private, live=("theta", "adam_exp_avg", "adam_exp_avg_sq") if defer else ())
        if defer:
            copied, path = threading.Event(), self.cfg.checkpoint_path

            def copy_and_write() -> None:
                try:
                    done = copy_live(file)
                finally:
                    copied.set()
                write_checkpoint(path, done)

            self._checkpoints.submit_call(copy_and_write)  # raises for an earlier failed write: nothing held
            self.inner.hold_updates(copied)
            self._copying = copied
        elif background:
            self._checkpoints.submit(self.cfg.checkpoint_path, file)
        else:
            self._checkpoints.flush()
            write_checkpoint(self.cfg.checkpoint_path, file)
        return str(self.cfg.checkpoint_path)

    def _restore(self, path: Path) -> None:
        try:
            state = load_checkpoint(path, run_id=self.m.run_id, names=self.names, shapes=self.shapes)
        except CheckpointError as exc:
            self.reporter.emit("warning", message=f"{exc}; starting without it")
            return
        with torch.no_grad():
            for dst, src in zip([*self.phi, *self.outer.state_tensors(), *self.params],
                                [*state.phi, *state.momentum, *state.theta]):
                dst.copy_(src)
        if state.adam_exp_avg is not None and state.adam_exp_avg_sq is not None:
            self.inner.load_state_dict({"exp_avg": state.adam_exp_avg, "exp_avg_sq": state.adam_exp_avg_sq,
                                        "step": state.adam_step})
        self.pos.start_round(state.round, state.round_step)
        self.pos.tokens = state.round_tokens
        if self._fragments:  # θ holds this round's steps: weigh each fragment's next Δ by them
            self._fragment_tokens = [state.round_tokens] * len(self._fragments)
            self._fragments_synced = {p for p, t in enumerate(self._fragment_offset) if 0 < t <= state.round_step}
        if state.vouchers:
            self._vouching.ledger.load(state.vouchers)  # validated by load_checkpoint
        residuals, problems = restore_extras(state, load_residuals=self.transport.load_error_feedback,
                                             sampler=self.inner.sampler)
        for problem in problems:
            self.reporter.emit("warning", message=problem)
        self._take_snapshot()
        self.reporter.emit("resumed", path=str(path), round=self.pos.round, round_step=self.pos.step,
                           state_digest=self.state_digest, residuals=residuals,
                           batches_drawn=self.inner.sampler.batches_drawn)

    # ---- records and evaluation ---------------------------------------------------------
    def _publish(self, *, train_loss: float | None = None, tokens_per_s: float | None = None,
                 wait: bool = False) -> None:
        """Store this peer's progress record: the last round's figures (or the given mid-round loss
        and throughput), and the validation loss while it is of the current round."""
        last, (eval_round, eval_loss) = self._last_round, self._last_eval
        self.swarm.publish(ProgressRecord(
            round=self.pos.round, inner_step=self.inner_step,
            train_loss=last.train_loss if train_loss is None else train_loss,
            tokens_per_s=last.tokens_per_s if tokens_per_s is None else tokens_per_s,
            group_size=last.sync.group_size, bytes_sent=last.sync.bytes_sent, bytes_received=last.sync.bytes_received,
            eval_loss=eval_loss if eval_round == self.pos.round else None,
            # a peer nobody can dial (client mode) serves no state: it offers no digest to download
            state_digest=self.state_digest if self.cfg.serves_state else "",
            groupmates=self._groupmates), wait=wait)

    def _evaluates(self, round_: int) -> bool:
        """Whether this peer evaluates φ for the swarm at ``round_``: the live peer whose id hashes
        lowest with the round does, so one peer per cadence round spends the time, not all, and the
        choice moves between peers. Every peer decides from its own view of the records; views that
        differ for a moment cost one evaluation more or fewer, never a wrong result."""
        ids = {r.peer_id for r in self.swarm.live()} | {self.peer_id}
        return self.peer_id == min(ids, key=lambda p: hashlib.sha256(f"{p}:{round_}".encode()).digest())

    def eval_phi(self, when: str) -> float | None:
        """Validation loss of φ (not of this peer's θ), in nats per token; emits an ``eval`` event
        with it and in bits per UTF-8 byte (``bpb``: compares across tokenizers). None, and no event,
        on a pipelined peer (``evaluates_phi`` False)."""
        if not self.evaluates_phi:
            return None
        with self._lock, torch.no_grad():
            for p, f in zip(self._eval_model.parameters(), self.phi):
                p.copy_(f)
        loss = evaluate(self._eval_model, self.val_windows)
        self._last_eval = (self.pos.round, loss)
        self._publish()
        self.reporter.emit("eval", when=when, round=self.pos.round, loss=loss, peer_id=self.peer_id,
                           bpb=validation_bits_per_byte(loss, self.val_windows, self.tokenizer))
        return loss
