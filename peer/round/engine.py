"""The round loop of one peer: inner phase → sync (the schedule) → round's end → catch-up.

Implements DiLoCo (arXiv 2311.08105, Algorithm 1) for one worker, or NoLoCo (arXiv 2506.10911)
when the run says so, with the swarm around it. What differs between the outer algorithms (whom to
sync with, whose state to adopt, what to average) lives on the outer algorithm objects
(peer/train/outer.py); what differs between sync modes (when each part of φ is sent and when its
mean lands) on the sync schedule (peer/round/schedule.py). The parts a round shares (φ, θ,
snapshots, position, lock) are one :class:`~peer.round.state.RoundState`, which the schedule,
catch-up (catchup.py), checkpointing (checkpointing.py) and publishing (publishing.py) each take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from peer.config import TrainerConfig
from peer.progress import RoundOutcome, TrainSummary
from peer.reporting import Reporter
from peer.round.blocking import BlockingSchedule
from peer.round.catchup import CatchUp
from peer.round.checkpointing import Checkpointing
from peer.round.loss_gate import LossGate, copy_loss
from peer.round.overlapped import OverlapSchedule
from peer.round.publishing import Publisher
from peer.round.records import RecordReads
from peer.round.schedule import RoundEnd, SyncSchedule
from peer.round.state import RoundState
from peer.round.streamed import StreamingSchedule
from peer.round.syncing import GroupSync, SyncHistory
from peer.round.timing import Timing
from peer.state.vouching import MIN_INNER_STEP_S, Vouching
from peer.sync.membership import RoundSwarm, SwarmView
from peer.sync.transport import RoundTransport
from peer.train.data import BatchSampler, Corpus, PeekSampler, peer_seed
from peer.train.ddp import make_inner_loop
from peer.train.device import Placement, flops_per_token, mfu
from peer.train.inner import InnerLoop
from peer.train.model import embedding_parameter_count, parameter_count
from protocol.errors import BadPayload, HelperDied
from protocol.manifest import RunManifest


def make_schedule(timing: Timing, **parts) -> SyncSchedule:
    """The sync schedule of ``timing.overlap``: 'none' → blocking, 'delayed'/'eager' → overlapped,
    'streaming' → streaming."""
    overlap = timing.overlap
    kind = StreamingSchedule if overlap == "streaming" else OverlapSchedule if overlap != "none" else BlockingSchedule
    return kind(timing=timing, **parts)


class Trainer:
    """Trains one peer. Construct with the swarm view and a started transport; call :meth:`run`.

    Without a placement the peer trains on the CPU in fp32. ``make_inner`` builds the inner loop
    (a pipeline stage's, peer/pipeline/peer.py); ``evaluates_phi`` is False on a pipelined peer;
    ``state_key`` is what its snapshots say they belong to (the run id, or a pipeline stage's key);
    ``timing`` when its syncs' means land (peer/round/timing.py; default: ``Timing.of`` the run's).
    """

    def __init__(
        self,
        *,
        manifest: RunManifest,
        model: torch.nn.Module,
        corpus: Corpus,
        swarm: RoundSwarm,
        transport: RoundTransport,
        config: TrainerConfig,
        reporter: Reporter,
        stop_event: threading.Event,
        placement: Placement | None = None,
        make_inner: Callable[..., InnerLoop] | None = None,
        evaluates_phi: bool = True,
        state_key: str | None = None,
        timing: Timing | None = None,
    ):
        self.m, self.swarm, self.transport, self.cfg = manifest, swarm, transport, config
        self.peer_id, self.reporter, self.stop_event, self.placement = swarm.peer_id, reporter, stop_event, placement
        self.device = placement.device if placement is not None else torch.device("cpu")
        self.H = manifest.sync.inner_steps
        self.state = s = RoundState(
            manifest=manifest, model=model.to(self.device), device=self.device, state_key=state_key or manifest.run_id
        )
        sampler = (
            BatchSampler(
                corpus.train,
                seq_len=manifest.data.seq_len_tokens,
                batch_sequences=manifest.batch_sequences,
                seed=peer_seed(self.peer_id, manifest.model.init_seed),
            )
            if corpus.make_sampler is None  # a sharded corpus: this peer's own shards (peer/shards/)
            else corpus.make_sampler(
                peer_id=self.peer_id,
                run_key=manifest.run_id,
                seq_len=manifest.data.seq_len_tokens,
                batch_sequences=manifest.batch_sequences,
            )
        )
        # NoLoCo's loss gate judges a group's step on the next batches, read ahead (loss_gate.py); not on
        # a pipeline stage (``make_inner``), which holds no model it could evaluate alone
        gated = s.outer.replicas_differ and make_inner is None
        if gated:
            sampler = PeekSampler(sampler)
        # an InnerLoop on the placement's device; several devices: rank 0 of a data-parallel loop (ddp.py)
        self.inner = (make_inner or make_inner_loop)(s.model, manifest.inner_optimizer, sampler, placement)
        self.micro_batch = self.inner.micro_batch_sequences
        layers = getattr(s.model, "layers", None)  # a pipeline stage holds a range of the blocks
        self.flops_per_token = flops_per_token(
            params=parameter_count(s.model),
            embedding_params=embedding_parameter_count(s.model),
            layers=len(layers) if isinstance(layers, range) else manifest.model.num_layers,
            hidden=manifest.model.hidden_size,
            seq_len=manifest.data.seq_len_tokens,
        )
        self.vouching = Vouching(min_round_s=self.H * MIN_INNER_STEP_S)
        """Its ledger of vouchers, the round clock and refused digests (peer/state/vouching.py)."""
        if isinstance(swarm, SwarmView):  # live peers, group sizes, partners: weighed by the ledger (#51 item 5)
            swarm.trust(self.vouching.ledger)
        self.history = SyncHistory(self.peer_id, self.vouching)
        self.records = RecordReads(swarm)
        timing = timing or Timing.of(manifest.sync)
        self.sync = GroupSync(
            manifest=manifest,
            outer=s.outer,
            swarm=swarm,
            transport=transport,
            reporter=reporter,
            stop_event=stop_event,
            timing=timing,
        )
        self.schedule = make_schedule(
            timing,
            state=s,
            sync=self.sync,
            history=self.history,
            records=self.records,
            reporter=reporter,
            stop_event=stop_event,
        )
        self.publisher = Publisher(
            state=s,
            swarm=swarm,
            history=self.history,
            corpus=corpus,
            reporter=reporter,
            evaluates_phi=evaluates_phi,
            serves_state=config.serves_state,
        )
        if gated and isinstance(self.schedule, BlockingSchedule | OverlapSchedule) and isinstance(sampler, PeekSampler):
            # the evaluation copy of φ's evaluations, or one of its own where φ is not evaluated (the lab)
            loss = self.publisher.loss_on if self.publisher.eval_model is not None else copy_loss(s.model)
            self.schedule.gate = LossGate(sampler=sampler, loss=loss)
        self.catchup = CatchUp(
            state=s,
            schedule=self.schedule,
            history=self.history,
            vouching=self.vouching,
            swarm=swarm,
            transport=transport,
            inner=self.inner,
            config=config,
            reporter=reporter,
            stop_event=stop_event,
            publish=self.publisher.publish,
            # the loss check of an adoption (#51): on the publisher's evaluation copy and windows
            loss_of=None if self.publisher.eval_model is None else self.publisher.phi_loss,
            initial_loss=None if self.publisher.eval_model is None else self.publisher.initial_phi_loss,
        )
        self.checkpoints = Checkpointing(
            state=s,
            schedule=self.schedule,
            inner=self.inner,
            transport=transport,
            vouching=self.vouching,
            config=config,
            reporter=reporter,
            measured_phi=self.publisher.measured_phi,
        )
        self.summary = TrainSummary(peer_id=self.peer_id)
        s.take_snapshot()

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> TrainSummary:
        """Train until ``max_rounds`` or until ``stop_event`` is set; return the summary.

        φ is evaluated as training starts, on the host alongside the first inner steps
        (:meth:`_start_initial_eval`). On a stop the current inner step finishes (and that
        evaluation, when still running) and the summary has ``interrupted=True``; the caller writes
        the checkpoint (:meth:`save`). When this peer's averager process dies
        (:class:`~protocol.errors.HelperDied`) the loop stops the same way and the summary's
        ``fatal`` holds the error, for the caller to raise after it wrote the checkpoint.

        Raises:
            HelperDied: the averager process died before the first round (restoring the
                checkpoint's residuals, or catching up).
        """
        self.checkpoints.restore()
        if self.checkpoints.restored_phi_loss is not None:  # measured before the stop: not evaluated again
            with self.state.lock:
                self.catchup.remember(list(self.state.phi), self.checkpoints.restored_phi_loss)
        self.catchup.catch_up()
        self.checkpoints.join_swarm_step(self.swarm)  # a restart inside a round the swarm went on in
        self.transport.share_state(lambda: list(self.state.snapshots))
        self.publisher.publish()
        self._wait_for_peers()
        self._start_initial_eval()
        try:
            while not self._done() and not self.stop_event.is_set():
                self._inner_phase()
                self.reporter.end_steps()
                self._finish_initial_eval(wait=True)  # reported before the round ends, as before
                if self.stop_event.is_set():
                    break
                self._after_round(self._outcome(self.schedule.end_round()))
                if not self._done():
                    self.catchup.catch_up()
            self.schedule.finish()
        except HelperDied as exc:
            # no round can sync any more: stop as on a signal (the round in progress unapplied, a
            # sync in flight dropped); the caller writes the checkpoint, then raises ``fatal``
            self.summary.fatal = exc
            self.stop_event.set()
            self._finish_initial_eval(wait=True)
        finally:
            self.reporter.end_steps()
            self.schedule.close()
            self.checkpoints.flush()
        self.summary.interrupted = self.stop_event.is_set()
        self.summary.final_round = self.state.pos.round
        if not self.summary.interrupted:
            self.summary.final_eval_loss = self.publisher.eval_phi("final")
        self.publisher.publish(wait=True)  # the last record must reach the DHT before it shuts down
        self.transport.share_state(None)
        return self.summary

    def _start_initial_eval(self) -> None:
        """Evaluate φ as this peer starts training from it. On the host it runs alongside the first
        inner steps (:meth:`Publisher.eval_phi_alongside`; issue #53 item 4: a restart trains at
        once), reported after the step it finished in and at the latest before the round ends; on
        an accelerator before them (its activations would take memory the micro-batch was fitted
        to). A φ whose loss the catch-up's check measured (an adopted state's, or this peer's own against
        a refused one: ``CatchUp.known_loss``) is reported with that loss, not evaluated again. Says,
        in one ``status`` line, where training starts."""
        s = self.state
        with s.lock:
            known = self.catchup.known_loss(list(s.phi)) if self.publisher.evaluates_phi else None
        alongside = known is None and self.publisher.evaluates_phi and self.device.type == "cpu"
        if known is not None:  # the catch-up's loss check measured this very φ: not evaluated again
            self.publisher.report_eval("initial", known)
            self.summary.initial_eval_loss = known
        elif alongside:
            self.publisher.eval_phi_alongside("initial")
        else:
            self.summary.initial_eval_loss = self.publisher.eval_phi("initial")
        self.reporter.emit(
            "status",
            message=f"training from round {s.pos.round}, inner step {s.pos.step} of {self.H}"
            + ("; evaluating φ of that round alongside" if alongside else "")
            + (
                "; φ's validation loss of that round is known (the checkpoint's or the catch-up's)"
                if known is not None
                else ""
            ),
        )

    def _finish_initial_eval(self, *, wait: bool) -> None:
        """Report the initial evaluation running alongside once done (``wait``: wait for it)."""
        loss = self.publisher.finish_eval(wait=wait)
        if loss is not None:
            self.summary.initial_eval_loss = loss

    def _done(self) -> bool:
        return self.cfg.max_rounds is not None and self.state.pos.round >= self.cfg.max_rounds

    def _inner_phase(self) -> None:
        """The rest of this round's H inner AdamW steps (DiLoCo Algorithm 1, lines 4-7), and steps
        past H while the schedule trains on waiting for a sync (``trains_while_waiting``)."""
        s, schedule = self.state, self.schedule
        # a pipeline stage after the first steps as its callers do and ends its round when they do
        paced = getattr(self.inner, "paced_by_callers", False)
        while (paced or s.pos.step < self.H or schedule.trains_while_waiting()) and not self.stop_event.is_set():
            # a step past H (while waiting for a sync) keeps the lr of the round's last step
            lr_step = s.inner_step if paced or s.pos.step < self.H else (s.pos.round + 1) * self.H - 1
            try:
                result = self.inner.step(lr_step)
            except BadPayload as exc:
                # A non-finite loss or gradient: drop this round's progress rather than poison θ.
                self.reporter.emit("warning", message=f"{exc}; restarting the round from its start")
                schedule.restart_round()
                s.pos.discard_step()
                continue
            if result.tokens == 0:
                if result.ends_round:
                    return
                continue  # a pipelined step that stopped before any work (stop_event is set)
            s.pos.record(loss=result.loss, tokens=result.tokens, seconds=result.seconds)
            self.reporter.step(
                round_=s.pos.round, step=s.pos.step, steps=self.H, loss=result.loss, tokens_per_s=s.pos.tokens_per_s
            )
            self._finish_initial_eval(wait=False)
            if self.micro_batch is not None and result.micro_batch < self.micro_batch:
                self.reporter.emit(
                    "warning",
                    message=f"out of {self.device} memory: micro-batch halved from "
                    f"{self.micro_batch} to {result.micro_batch} sequences",
                )
            self.micro_batch = result.micro_batch
            self.records.after_step(s.pos, schedule.records_needed_at())
            schedule.after_step(result.tokens)
            if s.pos.step % max(1, self.H // 4) == 0 and s.pos.step < self.H:
                # Mid-round records let a joiner start at the swarm's current inner step.
                self.publisher.publish(train_loss=result.loss, tokens_per_s=s.pos.tokens_per_s)
            if result.ends_round:
                return

    def _outcome(self, end: RoundEnd) -> RoundOutcome:
        """The finished round as its ``round`` event tells it; the position is already in the next round."""
        s, done = self.state, end.done
        peak = self.placement.peak_tflops if self.placement is not None else None
        return RoundOutcome(
            round=s.pos.round,
            train_loss=done.train_loss,
            tokens_per_s=done.tokens_per_s,
            tokens=done.tokens,
            peers=len(end.live) or 1,
            start_digest=end.start_digest,
            state_digest=s.digest,
            planned_group=end.choice.members,
            sync=end.report,
            mfu=mfu(done.tokens_per_s, self.flops_per_token, peak),
            micro_batch=self.micro_batch,
            compute_s=done.compute_s,
            sync_wait_s=s.waited["sync"],
            resync_wait_s=s.waited["resync"],
        )

    def _after_round(self, outcome: RoundOutcome) -> None:
        """Count, publish and report the round; evaluate, checkpoint and export on their cadence."""
        s = self.state
        self.swarm.round_finished()
        self.summary.record(outcome)
        self.publisher.last_round = outcome
        self.publisher.publish()
        self.reporter.emit("round", **outcome.event_fields(self.peer_id))
        s.waited = dict.fromkeys(s.waited, 0.0)
        k = self.cfg.eval_every_rounds
        if (
            k
            and self.publisher.evaluates_phi
            and s.pos.round % k == 0
            and not self._done()
            and self.publisher.evaluates(s.pos.round)
        ):
            self.publisher.eval_phi("periodic")
            self.publisher.keep_pace()
        if self.checkpoints.due(time.monotonic()):
            self.save(background=True)
        k = self.cfg.export_phi_every_rounds
        if k and s.pos.round % k == 0:
            self.checkpoints.export_phi(s.pos.round)

    def _wait_for_peers(self) -> None:
        """Start barrier for launchers that start several peers at once (``peer swarm``)."""
        want = self.cfg.wait_for_peers
        if want <= 1:
            return
        seen = self.swarm.wait_for(
            want, timeout_s=self.cfg.wait_for_peers_timeout_s, stop=self.stop_event, heartbeat=self.publisher.publish
        )
        if seen < want and not self.stop_event.is_set():
            self.reporter.emit(
                "warning",
                message=f"only {seen} of {want} peers appeared within "
                f"{self.cfg.wait_for_peers_timeout_s:.0f} s; starting anyway",
            )

    # ---- what callers use ---------------------------------------------------------------
    @property
    def phi(self) -> list[torch.Tensor]:
        """φ: one fp32 host tensor per parameter."""
        return self.state.phi

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """θ: the model's parameters, on the placement's device."""
        return self.state.params

    @property
    def names(self) -> list[str]:
        return self.state.names

    @property
    def shapes(self) -> list[torch.Size]:
        return self.state.shapes

    @property
    def outer(self):
        """The outer algorithm and its state (peer/train/outer.py)."""
        return self.state.outer

    @property
    def pos(self):
        """The position in the run (peer/progress.py ``RoundProgress``)."""
        return self.state.pos

    @property
    def state_digest(self) -> str:
        return self.state.digest

    def fit_micro_batch(self) -> int | None:
        """On CUDA with no micro-batch asked for, find and use the largest that fits the memory budget
        with a margin (:meth:`InnerLoop.fit_micro_batch`); returns the micro-batch in sequences (None:
        the whole batch at once). Call before :meth:`run`.

        Raises:
            ConfigError: not even one sequence fits.
        """
        p = self.placement
        if (
            p is not None
            and self.device.type == "cuda"
            and p.micro_batch_sequences is None
            and p.memory_budget_gib is not None
        ):
            self.micro_batch = self.inner.fit_micro_batch(budget_bytes=p.memory_budget_gib * 1024**3)
        return self.micro_batch

    def save(self, *, background: bool = False) -> str | None:
        """Write the checkpoint (peer/round/checkpointing.py ``Checkpointing.save``)."""
        return self.checkpoints.save(background=background)

    def eval_phi(self, when: str) -> float | None:
        """Validation loss of φ in nats per token (peer/round/publishing.py ``Publisher.eval_phi``)."""
        return self.publisher.eval_phi(when)
