"""This peer's checkpoint: written atomically at round ends (in the background) and on a stop,
restored at start (peer/state/checkpoint.py holds the file format).

A stop inside a round checkpoints where it stopped: the inner step k of H, θ with the round's k
steps, AdamW's moments and step, the round's tokens and the data position. A restart resumes there
(the inner lr schedule, indexed by round·H + step, goes on where it was), then, when the swarm went on
inside that same round meanwhile, goes to the swarm's inner step (:meth:`Checkpointing.join_swarm_step`)
so that it reaches the round's sync with the others; a swarm that moved past the round is caught up
with by adoption (peer/round/catchup.py), as a joiner does.

With ``sync.overlap`` a sync is usually in flight: the checkpoint holds the last applied φ, θ (with
this peer's progress not yet in φ) and the committed residuals; a restart from it drops that sync.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from peer.config import TrainerConfig, checkpoint_bytes, checkpoint_interval_s
from peer.progress import Waiting
from peer.reporting import Reporter
from peer.round.schedule import SyncSchedule
from peer.round.state import RoundState
from peer.state.checkpoint import (
    CheckpointWriter,
    PeerState,
    encode_checkpoint,
    export_phi,
    fetch_residuals,
    load_checkpoint,
    move_aside,
    restore_extras,
    write_checkpoint,
)
from peer.state.vouching import Vouching
from peer.sync.membership import RoundSwarm
from peer.sync.transport import RoundTransport
from peer.train.inner import InnerLoop
from protocol.errors import CheckpointError, ConfigError

LIVE = ("theta", "adam_exp_avg", "adam_exp_avg_sq")
"""The checkpoint's groups that the next inner step changes (peer/state/checkpoint.py ``encode_checkpoint``)."""


def checkpoint_due(last: float | None, now: float, every_s: float) -> bool:
    """Whether a round's end writes the checkpoint: every round with ``every_s`` 0, else the first
    round's end and then once ``every_s`` seconds (monotonic clock) have passed since the last one.
    A stop or the run's end always writes one; what a crash loses is at most ``every_s`` seconds of
    this peer's rounds, which a restart then catches up from the swarm like a joiner."""
    return not every_s or last is None or now - last >= every_s


class Checkpointing:
    """Writes and restores this peer's checkpoint at ``config.checkpoint_path`` (None: never)."""

    def __init__(
        self,
        *,
        state: RoundState,
        schedule: SyncSchedule,
        inner: InnerLoop,
        transport: RoundTransport,
        vouching: Vouching,
        config: TrainerConfig,
        reporter: Reporter,
        measured_phi: Callable[[], tuple[str, float] | None] | None = None,
    ):
        """``measured_phi``: (snapshot digest, validation loss) of the last evaluation of the current φ,
        or None (peer/round/publishing.py ``Publisher.measured_phi``): kept in the checkpoint."""
        self.state, self.schedule, self.inner, self.transport = state, schedule, inner, transport
        self.measured_phi = measured_phi
        self.vouching, self.path, self.reporter = vouching, config.checkpoint_path, reporter
        # --checkpoint-every, else sized to what this peer's checkpoint holds (a pipeline stage: its own)
        self.every_s = checkpoint_interval_s(
            config.checkpoint_every_s,
            checkpoint_bytes(
                parameters=sum(p.numel() for p in state.params),
                outer_state=sum(t.numel() for t in state.outer.state_tensors()),
            ),
        )
        self.writer = CheckpointWriter()
        """Writes each round's checkpoint in the background."""
        self.last: float | None = None
        """``time.monotonic()`` of the last round-end checkpoint (``checkpoint_every_s``'s clock)."""
        self.resumed_at: tuple[int, int] | None = None
        """(round, inner step of that round) the restored checkpoint resumed at; None: nothing restored."""
        self.restored_phi_loss: float | None = None
        """The validation loss (nats/token) of the restored φ as the checkpoint recorded it, when the
        restored state's digest is the one it was measured on; None: none recorded."""

    def due(self, now: float) -> bool:
        """Whether the round's end at ``now`` writes the checkpoint (:func:`checkpoint_due`); marks it written."""
        if checkpoint_due(self.last, now, self.every_s):
            self.last = now
            return True
        return False

    def save(self, *, background: bool = False) -> str | None:
        """Write the checkpoint (atomically); its path, or None without one.

        Nothing model-sized is copied (issue #67, item 2): the file is written tensor by tensor from
        the tensors as held (peer/state/checkpoint.py ``write_checkpoint``), θ and AdamW's moments
        first; φ and the outer state are the last snapshot's (never written in place), the
        residuals the averager's copy.

        With ``background`` the state is written by the background thread (the round loop's
        checkpoint): θ and the moments while the next inner step's forward and backward passes run,
        and the step's update (or any write of θ before it) waits until they are in the file (into
        the page cache; the fsync comes after the rest). A write still under way (a slow disk)
        means no checkpoint at this round's end, the next round's end writes it instead: queued
        behind it, θ's update would wait for the disk. A pipeline stage (its steps are its callers',
        they cannot be held) copies θ and the moments here and writes in the background. Without
        ``background`` the write in progress is waited for and this one written before returning.

        Returns:
            The path; None without one, or when ``background`` skipped this round's end.

        Raises:
            CheckpointError: this write failed (without ``background``), or the last background one
                did; the checkpoint before it is intact.
        """
        if self.path is None:
            return None
        s = self.state
        # θ and the moments are written first by the writer's thread while the next step's forward
        # and backward passes run (its update waits until they are in the file; every other writer
        # of θ waits in RoundState.await_theta_copy); not for a pipeline stage (its steps are its
        # callers'): it copies them here
        defer = background and type(self.inner).step is InnerLoop.step
        if defer and not self.writer.idle():
            self.last = None  # the next round's end writes it
            return None
        adam = self.inner.state_dict()
        # fetched anew every time: after an adoption the averager holds none, so none are saved
        residuals, problem = fetch_residuals(self.transport.error_feedback_residuals)
        if problem:
            self.reporter.emit("warning", message=problem)
        # φ and the outer state are never written in place, only rebound (peer/round/state.py), and the
        # residuals are the averager's copy: the tensors held now are written as they are, not copied
        held = ("phi", "momentum", "residual") if background else ("phi", "momentum", "residual", *LIVE)
        measured = self.measured_phi() if self.measured_phi is not None else None
        with s.lock:
            phi, momentum = list(s.phi), list(s.outer.state_tensors())
            file = encode_checkpoint(
                PeerState(
                    run_id=s.m.run_id,
                    round=s.pos.round,
                    inner_step=s.inner_step,
                    round_step=s.pos.step,
                    round_tokens=s.pos.tokens,
                    names=s.names,
                    phi=phi,
                    momentum=momentum,
                    theta=list(s.params),
                    adam_exp_avg=adam["exp_avg"] if adam else None,
                    adam_exp_avg_sq=adam["exp_avg_sq"] if adam else None,
                    adam_step=adam["step"] if adam else 0,
                    residuals=residuals,
                    data=self.inner.sampler.state(),
                    vouchers=self.vouching.ledger.as_dict(),
                    # the φ written is the last snapshot's: its loss only when measured on that snapshot
                    phi_eval=measured if measured is not None and measured[0] == s.digest else None,
                ),
                private=held,
                live=LIVE if defer else (),
            )
        if defer:
            released, path = threading.Event(), self.path
            # raises for an earlier failed write: then nothing is held
            self.writer.submit_call(lambda: write_checkpoint(path, file, released=released))
            self.inner.hold_updates(released)
            s.copying = released
        elif background:
            self.writer.submit(self.path, file)
        else:
            self.writer.flush()
            write_checkpoint(self.path, file)
        return str(self.path)

    def export_phi(self, round_: int) -> None:
        """Queue a copy of φ for export as a model file beside the checkpoint (peer/state/checkpoint.py)."""
        if self.path is None:
            return
        s = self.state
        with s.lock:
            phi = list(s.phi)  # never written in place: no copy needed
        directory, names, run_id = self.path.parent, s.names, s.m.run_id
        self.writer.submit_call(lambda: export_phi(directory, names=names, phi=phi, run_id=run_id, round_=round_))

    def flush(self) -> None:
        """Wait for the background writes; a failed one is reported as a warning."""
        try:
            self.writer.flush()  # the last round's checkpoint is on disk when this returns
        except CheckpointError as exc:
            self.reporter.emit("warning", message=str(exc))

    def restore(self) -> None:
        """Resume from the checkpoint when there is one; one that cannot be used (unreadable, another
        run's or model's) is renamed to ``<name>.corrupt-<UTC time>`` (:func:`move_aside`: never
        overwritten, never deleted), reported in one warning naming where it went, and skipped (this
        peer then starts as a joiner).

        Raises:
            ConfigError: such a checkpoint cannot be renamed (exit 78); it is left as it was.
        """
        if self.path is None or not self.path.exists():
            return
        with Waiting(f"restoring the checkpoint {self.path}"):
            self._restore(self.path)

    def _restore(self, path: Path) -> None:
        s = self.state
        try:
            state = load_checkpoint(path, run_id=s.m.run_id, names=s.names, shapes=s.shapes)
        except CheckpointError as exc:
            try:  # kept, never overwritten by this peer's next checkpoint: it may be the only copy
                moved = move_aside(path)
            except CheckpointError as why:  # left in place, it would be: stop instead
                raise ConfigError(
                    f"{exc}, and {why}: move it away yourself (the peer never overwrites it), or pass another --data-dir"
                ) from why
            self.reporter.emit("warning", message=f"{exc}; moved to {moved}; starting without it")
            return
        with s.lock:  # φ and the outer state are rebound, never written (peer/round/state.py)
            s.install_all([t.detach().to("cpu", torch.float32).contiguous() for t in [*state.phi, *state.momentum]])
        with torch.no_grad():
            for dst, src in zip(s.params, state.theta):
                dst.copy_(src)
        if state.adam_exp_avg is not None and state.adam_exp_avg_sq is not None:
            self.inner.load_state_dict(
                {"exp_avg": state.adam_exp_avg, "exp_avg_sq": state.adam_exp_avg_sq, "step": state.adam_step}
            )
        s.pos.start_round(state.round, state.round_step)
        s.pos.tokens = state.round_tokens
        self.schedule.after_restore(state.round_step, state.round_tokens)
        if state.vouchers:
            self.vouching.ledger.load(state.vouchers)  # validated by load_checkpoint
        residuals, problems = restore_extras(
            state, load_residuals=self.transport.load_error_feedback, sampler=self.inner.sampler
        )
        for problem in problems:
            self.reporter.emit("warning", message=problem)
        s.take_snapshot()
        self.resumed_at = (s.pos.round, s.pos.step)
        if state.phi_eval is not None and state.phi_eval[0] == s.digest:
            self.restored_phi_loss = state.phi_eval[1]
        self.reporter.emit(
            "resumed",
            path=str(path),
            round=s.pos.round,
            round_step=s.pos.step,
            state_digest=s.digest,
            residuals=residuals,
            batches_drawn=self.inner.sampler.batches_drawn,
        )

    def join_swarm_step(self, swarm: RoundSwarm) -> int:
        """After the restore and the first catch-up: when this peer still stands where its checkpoint
        left it (no adoption moved it) and the live peers in that same round went further meanwhile
        (``swarm.step_now``: the furthest one's step, at most H − 1), go to their inner step, as a
        joiner does after an adoption; never back. Otherwise this peer, a restart's downtime behind,
        reaches the round's sync after the others' group formed and syncs alone, and the swarm then
        holds two states. θ keeps the k steps it trained; the all-reduce weighs its Δ by the round's
        tokens (those k steps' and the ones to come); the inner lr schedule follows the step
        (round·H + step), as on every peer. One ``status`` line says it.

        Not on a pipeline stage: its steps are its callers' (``paced_by_callers``), which set its pace.

        Returns:
            The inner steps skipped (0: nothing restored, the peer was moved by an adoption, the
            swarm is not further along in this round, or a pipeline stage).
        """
        s = self.state
        if self.resumed_at is None or (s.pos.round, s.pos.step) != self.resumed_at:
            return 0
        if getattr(self.inner, "paced_by_callers", False):
            return 0
        now = swarm.step_now(s.pos.round, inner_steps=s.H, batch_size_tokens=s.m.inner_optimizer.batch_size_tokens)
        k = s.pos.step
        if now <= k:
            return 0
        s.pos.step = now
        self.schedule.after_restore(now, s.pos.tokens)  # streaming: the fragment syncs before it are passed
        self.reporter.emit(
            "status",
            message=f"the swarm went on to inner step {now} of {s.H} of round {s.pos.round} meanwhile: "
            f"joining it there from step {k}, to sync with it at the round's end",
        )
        return now - k
