"""The overlapped sync schedules, ``delayed`` and ``eager``: a round's sync runs in the background
while the next round trains, and its mean lands at the end of that next round (the update rules in
peer/train/overlap.py; DiLoCoX's one-step delay, arXiv 2506.21263; eager updates, arXiv 2502.12996).
Rounds before ``sync.overlap_from_round`` sync blocking.

A checkpoint taken with a sync in flight holds the last applied φ and this peer's θ; a restart
drops that sync (its own progress stays in θ and joins the next Δ).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from peer.progress import SyncReport
from peer.round.blocking import BlockingSchedule
from peer.round.loss_gate import LossGate, applied_alone
from peer.round.schedule import BackgroundSchedule, OwnDelta, RoundEnd
from peer.round.syncing import wait_budget_s
from peer.state.snapshot import StateSnapshot, make_snapshot
from peer.sync.screening import round_token_cap
from peer.train.outer import check_finite, step_on_copies
from peer.train.overlap import EagerState, keep_skipped_progress, next_start, round_progress
from peer.train.step_bound import check_step_bound
from protocol.errors import BadPayload

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """An outer step computed in the background thread as soon as a sync's mean arrived, for the
    round loop to install at the landing instead of computing it then."""

    mean: list[torch.Tensor]
    """The mean it applied (the landing installs it only for this very mean)."""
    base: bytes
    """Digest of the snapshot (φ and outer state) it was applied to."""
    snapshot: StateSnapshot
    """φ and the outer state after the step, as the next round's snapshot."""


class OverlapSchedule(BackgroundSchedule):
    """``delayed`` or ``eager``: the sync of round t lands at the end of round t + 1."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode = self.state.m.sync.overlap
        self.from_round = self.state.m.sync.overlap_from_round
        """K: rounds before K sync blocking (the swarm's round index, so a whole group switches at once)."""
        self.blocking = BlockingSchedule(**kwargs)
        self.anchor: list[torch.Tensor] | None = None
        """ψ, where this round's inner steps started, when not φ (peer/train/overlap.py)."""
        self.eager = EagerState()
        """Eager with outer momentum: this peer's own part of its outer state (never sent, not saved)."""
        self.own: OwnDelta | None = None
        """This peer's own Δ of the sync in flight, as its norm once the mean is there, and the cap on
        a weight over its weight: what its outer step's change of φ is bounded by
        (``check_step_bound``)."""

    @property
    def gate(self) -> LossGate | None:
        """NoLoCo's loss gate (peer/round/loss_gate.py, set by the Trainer), one for the blocking rounds
        before ``sync.overlap_from_round`` and the delayed landings after (:meth:`_gated`)."""
        return self.blocking.gate

    @gate.setter
    def gate(self, gate: LossGate | None) -> None:
        self.blocking.gate = gate

    def synced_blocking(self, round_: int) -> bool:
        """Rounds before K sync blocking; round K lands no earlier sync and starts its own in the
        background, as a run's first round with overlap does."""
        return round_ < self.from_round

    def trains_while_waiting(self) -> bool:
        """Past H with the sync in flight not landed yet: one more step (the lr of the round's last
        step; the extra steps add to this round's Δ and weigh in the group mean up to the owners'
        cap of H steps' tokens, peer/sync/screening.py ``round_token_cap``)."""
        bg = self.background
        return self.extra_steps_left() and bg.in_flight and not bg.done

    def after_step(self, tokens: int) -> None:
        self.blocking.after_step(tokens)  # its weight, should the round sync blocking

    def restart_round(self) -> None:
        self.blocking.restart_round()
        if self.anchor is not None:
            self.state.set_theta(self.anchor)

    def after_adopt(self) -> None:
        self.blocking.after_adopt()

    def after_restore(self, round_step: int, round_tokens: int) -> None:
        self.blocking.after_restore(round_step, round_tokens)

    def end_round(self) -> RoundEnd:
        """Take the last round's sync from the background (waiting only if it is slower than a
        round) and apply its mean to φ, start this round's sync in the background, and start the
        next round from ψ (delayed: φ + this round's progress; eager: φ previewed with this peer's
        share of its fresh Δ).

        The report is of the sync that just landed (the last round's); the first round has none. A
        non-finite Δ or eager preview starts no sync and the next round from φ. The outer step of
        the landing sync and the snapshot after it were prepared by the sync's thread when its mean
        arrived (:meth:`_prepare_step`) and are installed here (:meth:`_install`)."""
        s = self.state
        if self.synced_blocking(s.pos.round):
            return self.blocking.end_round()
        live, choice = self._choose()
        start_digest = s.digest
        done = dataclasses.replace(s.pos)
        problem, delta = "", None
        phi_before = list(s.phi)  # φ before the landing (rebound by it, never written in place)
        anchor = s.phi if self.anchor is None else self.anchor
        try:
            progress = round_progress(anchor, s.theta_on_host())
            check_finite(progress, "this round's progress")
            delta = progress
        except BadPayload as exc:
            problem = f"{exc}: round discarded"
        mean, report, prepared = None, SyncReport(note="overlap: this round's sync lands at the end of the next"), None
        if self.background.in_flight:
            mean, report, prepared = self.take_background()
            mean, report, prepared = self._gated(mean, report, prepared, phi_before)
        own, self.own = self.own, None
        refused = None
        with s.lock:
            installed = mean is not None and self._install(prepared, mean)  # a prepared step was checked
            if mean is not None and not installed:
                try:
                    self._apply_checked(mean, own)
                except BadPayload as exc:
                    refused = exc
            s.pos.start_round(s.pos.round + 1)
        if refused is not None:
            report = self._refused(refused, report)
        if mean is not None:
            self.history.note_group(max(0, done.round - 1), report)  # the sync landing is the last round's
        if installed and prepared is not None:
            s.snapshots.append(prepared.snapshot)  # checked (finite, within its bound) in the sync's thread
        else:
            self.guard_phi()
            s.take_snapshot()
        start = s.phi
        if delta is not None:
            payload = s.outer.payload(s.phi, delta)  # φ's tensors: never written in place
            try:
                start = next_start(
                    self.mode,
                    s.outer,
                    s.phi,
                    delta,
                    payload,
                    share=1.0 / max(1, choice.expected_size),
                    eager=self.eager,
                )
            except BadPayload as exc:
                problem = f"{exc}: round discarded"
            else:
                self._start(payload, choice, live, done)
        if start is s.phi:
            self.reporter.emit("warning", message=problem)
            self.eager.reset()  # the next round starts from φ, as a fresh worker's does
        self.anchor = None if start is s.phi else start
        kept = report.kept_rows if mean is not None and refused is None and start is not s.phi else ()
        s.set_theta(keep_skipped_progress(start, anchor, delta, s.phi, phi_before, kept) if kept and delta else start)
        return RoundEnd(done=done, live=live, start_digest=start_digest, choice=choice, report=report)

    def _gated(
        self,
        mean: list[torch.Tensor] | None,
        report: SyncReport,
        prepared: PreparedStep | None,
        phi: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor] | None, SyncReport, PreparedStep | None]:
        """The loss gate (:attr:`gate`) on a delayed landing, as on a blocking one (peer/round/streamed.py
        ``FragmentSchedule.gated``): the group's step, or, when it leaves φ clearly worse on the next
        batches than this peer's own step alone, that step (its own payload as the mean, as after a
        failed sync) with the report saying so (no groupmate holds this peer's state). The own payload
        is rebuilt from what the peer holds: the landing sync's Δ was ψ_{t−1} − θ, and the round that
        just ended started from ψ_t = φ − Δ (``next_start``), so Δ = φ − ψ_t with φ the one the sync
        sent (``phi``, before this landing; NoLoCo's φ half). Not gated: no gate, eager (its start is
        not φ − Δ), no mean, a failed sync or no partner (the step is this peer's own already).
        """
        s = self.state
        if self.gate is None or self.mode != "delayed" or mean is None or self.anchor is None:
            return mean, report, prepared
        if report.failed or report.group_size < 2:
            return mean, report, prepared
        n = len(s.phi)
        own_payload = s.outer.payload(phi, [f - a for f, a in zip(phi, self.anchor, strict=True)])
        base = s.live_tensors()[n:]
        try:  # a malformed mean or a non-finite step: left to the landing, which refuses it
            alone, _ = step_on_copies(s.outer, phi, base, own_payload)
            if prepared is not None and prepared.base == s.snapshots[-1].digest:
                grouped = list(prepared.snapshot.tensors[:n])
            else:
                grouped = step_on_copies(s.outer, phi, base, mean)[0]
        except BadPayload:
            return mean, report, prepared
        problem = self.gate.refusal(alone, grouped)
        del alone, grouped
        if problem is None:
            return mean, report, prepared
        return own_payload, applied_alone(self.reporter, report, problem), None

    def _start(self, payload, choice, live, done) -> None:
        """Start the finished round's sync in the background; its thread prepares the outer step."""
        s = self.state
        # the extra steps taken while waiting weigh up to the owners' cap of a round's tokens
        digest, weight = s.digest, float(min(max(done.tokens, 1), round_token_cap(s.m)))
        own = OwnDelta(payload[: len(s.phi)], round_token_cap(s.m) / weight)  # bounds the landing's change of φ
        due_s = self.sync.groupmates_due_s(live, done.round, choice)
        budget_s = wait_budget_s(done, max(s.H, done.steps_done))  # with its extra steps

        def sync_and_prepare(dropped):
            mean, report = self.sync.sync(
                payload,
                choice,
                digest,
                round_=done.round,
                weight=weight,
                expected_wait_s=due_s,
                wait_budget_s=budget_s,
                dropped=dropped,
            )
            own.settle()  # Δ's norm; its tensors go with the payload (a failed sync's mean keeps them)
            if dropped() or self.stop_event.is_set():
                return mean, report
            return mean, report, self._prepare_step(mean, lands_in=done.round + 2, own=own)

        self.background.start(sync_and_prepare, round_=done.round, start_digest=digest)
        self.own = own

    def _prepare_step(
        self, mean: list[torch.Tensor], *, lands_in: int, own: OwnDelta | None = None
    ) -> PreparedStep | None:
        """In the sync's background thread, once its mean arrived: the outer step applied to copies of
        the last snapshot's φ and outer state (``step_on_copies``), and the snapshot of the result
        (copy, finiteness check, hash) with the meta of round ``lands_in``, the round the landing
        starts, so neither is the inner loop's time. None when the mean is malformed, the step not
        finite or over its bound from this peer's own Δ (``own``: ``check_step_bound``): the landing
        applies it itself (and refuses it). Reads only the snapshot deque's last entry
        (immutable, appended atomically by the round loop)."""
        s = self.state
        base, n = s.snapshots[-1], len(s.phi)
        s.release_older_snapshot()  # before the step's copies are made
        try:
            phi, outer_state = step_on_copies(s.outer, base.tensors[:n], base.tensors[n:], mean)
            if own is not None:
                check_step_bound(
                    s.outer, base.tensors[:n], phi, own.settle(), old_state=base.tensors[n:], scale=own.scale
                )
            meta = {"run_id": s.state_key, "round": lands_in, "inner_step": lands_in * s.H}
            return PreparedStep(
                mean=mean, base=base.digest, snapshot=make_snapshot(meta, [*phi, *outer_state], owned=True)
            )
        except (BadPayload, ValueError) as exc:
            logger.debug("outer step of round %d not prepared: %s", lands_in - 2, exc)
            return None

    def _apply_checked(self, mean: list[torch.Tensor], own: OwnDelta | None) -> None:
        """Apply ``mean`` to φ and the outer state (call under the lock): the step on copies
        (``step_on_copies``), installed (``RoundState.install``) unless its change of φ exceeds what
        an honest mean can make from this peer's own Δ (``check_step_bound``).

        Raises:
            BadPayload: the step was refused (malformed or non-finite mean, a non-finite result, or
                over its bound); φ and the outer state are as they were.
        """
        s = self.state
        n, before = len(s.phi), s.live_tensors()
        phi, outer_state = step_on_copies(s.outer, before[:n], before[n:], mean)
        if own is not None:
            check_step_bound(s.outer, before[:n], phi, own.settle(), old_state=before[n:], scale=own.scale)
        s.install_all([*phi, *outer_state])

    def _refused(self, exc: BadPayload, report: SyncReport) -> SyncReport:
        """A landing whose outer step was refused: warn, and mark its report failed (φ unchanged)."""
        self.reporter.emit("warning", message=f"{exc}: the landing sync's outer step skipped")
        self.history.last_failed = True
        return dataclasses.replace(report, failed=True, agreeing=(), completed=(), note=f"outer step skipped ({exc})")

    def _install(self, prepared: PreparedStep | None, mean: list[torch.Tensor]) -> bool:
        """Install a prepared outer step's snapshot as φ and the outer state (call under the lock,
        before the position moves to the next round; ``RoundState.install``: rebound, not copied);
        whether it was installed. Only a step prepared from this
        very ``mean``, from the state this peer still holds (the last snapshot: an adoption since
        made another) and for the round the landing starts; else the caller applies ``mean``."""
        s = self.state
        if (
            prepared is None
            or prepared.mean is not mean
            or prepared.base != s.snapshots[-1].digest
            or prepared.snapshot.meta["round"] != s.pos.round + 1
        ):
            return False
        s.install_all(prepared.snapshot.tensors)
        return True

    def finish(self) -> None:
        """At ``max_rounds`` wait for the sync in flight and apply its mean (φ then holds every round,
        θ ← φ); on a stop drop it, so φ stays the last applied one and θ keeps this peer's unsynced
        progress (what a checkpoint then holds)."""
        if not self.background.in_flight:
            return
        if self.stop_event.is_set():
            self.background.drop("stopping")
            return
        s = self.state
        mean, report, _ = self.take_background()  # applied here, once: its prepared step is not needed
        own, self.own = self.own, None
        refused = None
        with s.lock:
            if mean is not None:
                try:
                    self._apply_checked(mean, own)
                except BadPayload as exc:
                    refused = exc
        if refused is not None:
            report = self._refused(refused, report)
        self.history.note_group(max(0, s.pos.round - 1), report)
        self.anchor = None
        self.eager.reset()
        self.guard_phi()
        s.set_theta_to_phi()
        s.take_snapshot()

    def before_adopt(self, round_: int) -> None:
        """A sync in flight of round k is kept when the adopted state is of round k+1: its groupmates
        apply that mean to exactly this φ (so a joiner, whose first download always lacks the mean
        then in flight, is in step after its second); else dropped."""
        bg = self.background
        if bg.in_flight:
            if bg.round is not None and round_ == bg.round + 1:
                self.adopted_in_flight = True
            else:
                bg.drop("adopted the swarm's state")  # its mean belongs to a φ left behind
        self.anchor = None
        self.eager.reset()  # a peer that adopts starts from φ: a fresh worker in eager's terms
