"""The fragment sync schedule (Streaming DiLoCo, arXiv 2501.18512; the rules in
peer/train/streaming.py): the model's P fragments sync at staggered offsets inside the round, one
sync in flight at a time, each mean landing τ inner steps after its sync started (or at the first
step after that its result is there). Fragment 0 syncs at the round's end.

``sync.overlap = "streaming"`` runs it as the run sets P, τ and the merge. The blocking schedule
(peer/round/blocking.py, ``sync.overlap = "none"``) is this schedule with one fragment (the whole
model, synced under the run's own key), no delay (the sync runs on the training thread when its
mean is needed: at once) and θ ← φ at the landing (the merge with α = 0), as torchft's DiLoCo is
its streaming DiLoCo with one fragment.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from peer.progress import SyncReport, combine_sync_reports
from peer.round.loss_gate import LossGate, applied_alone
from peer.round.schedule import BackgroundSchedule, OwnDelta, RoundEnd
from peer.round.syncing import wait_budget_s
from peer.state.snapshot import SealedTensor, seal_tensor
from peer.sync.screening import round_token_cap
from peer.train.outer import (
    GroupChoice,
    check_finite,
    pseudo_gradient,
    step_consuming_mean,
    step_on_copies,
)
from peer.train.step_bound import check_step_bound
from peer.train.streaming import fragment_outers, land, partition, payload_indices, sync_offset
from protocol.errors import BadPayload

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedFragment:
    """A fragment's outer step computed in the sync's thread as soon as its mean arrived, with its
    result sealed for the round's snapshot; the landing installs it as φ_p and the fragment's outer
    state instead of computing it then."""

    mean: list[torch.Tensor]
    """The mean it applied (the landing installs it only for this very mean)."""
    base: tuple[torch.Tensor, ...]
    """The immutable tensors it stepped from (φ_p, then the fragment's outer state): installed only
    while they are still what this peer holds (``RoundState.held``)."""
    sealed: tuple[SealedTensor, ...]
    """φ_p and the fragment's outer state after the step (new tensors), checked and hashed."""


class FragmentSchedule(BackgroundSchedule):
    """P fragments, each synced once a round at its offset, landing τ steps later; with
    :attr:`whole_model`, one fragment synced at the round's end and landing at once."""

    whole_model = False
    """One fragment holding every parameter, no delay, θ ← φ at the landing, the run's own sync key
    (the blocking schedule); else the run's ``sync.fragments``, ``fragment_delay_steps`` and merge."""
    gate: LossGate | None = None
    """The blocking schedule's loss gate (peer/round/loss_gate.py; NoLoCo, set by the Trainer): a
    group's step that leaves φ clearly worse on the next batches than this peer's step alone is
    replaced by that step. Read only with :attr:`whole_model`."""

    def __init__(self, **kwargs: Any) -> None:
        self.inline = self.whole_model
        super().__init__(**kwargs)
        s, spec = self.state, self.state.m.sync
        if self.whole_model:
            self.fragments = [list(range(len(s.phi)))]
            self.fragment_outer = [s.outer]
            self.delay_steps, self.alpha, self.rule = 0, 0.0, "mix"
        else:
            self.fragments = partition(s.names, spec.fragments)
            self.fragment_outer = fragment_outers(s.outer, s.m, self.fragments, s.shapes)
            self.delay_steps, self.alpha, self.rule = (
                spec.fragment_delay_steps,
                spec.fragment_alpha,
                spec.fragment_merge,
            )
            n = len(s.phi)
            for part, index in zip(self.fragment_outer, self.fragments, strict=True):
                s.views.append((part.momentum, [n + k for k in index]))  # rebound with the live state
            phi_from = s.outer.phi_from(n)
            self.sync.fragments = spec.fragments  # each fragment's sync has a key and buffers of its own
            self.sync.fragment_payload = [payload_indices(f, phi_from=phi_from) for f in self.fragments]
        P = len(self.fragments)
        self.offset = [sync_offset(p, inner_steps=s.H, fragments=P) for p in range(P)]
        self.order = sorted(range(P), key=lambda p: self.offset[p])
        """Fragments in the order their syncs come in a round (fragment 0, offset 0, first)."""
        self.tokens = [0] * P
        """Tokens trained since each fragment's last sync: the weight of its Δ in the group mean."""
        self.synced: set[int] = set()
        """The fragments whose sync of the current round started."""
        self.landed: list[SyncReport] = []
        """The fragment syncs that landed in the current round (its ``round`` event reports them)."""
        self.choice: tuple[int, GroupChoice, list] | None = None
        """(round, group choice, live records) of the current round's fragment syncs."""
        self.flight: tuple[int, int, list[torch.Tensor] | None] | None = None
        """(fragment, cumulative inner step its sync started, θ_p then as fp32 host tensors with
        ``fragment_merge = "shift"``, else None) of the sync in flight."""
        self.own: OwnDelta | None = None
        """This peer's own Δ_p of the sync in flight, as its norm once the mean is there, and the cap
        on a weight over its weight: what its outer step's change of φ_p is bounded by
        (``check_step_bound``)."""

    def synced_blocking(self, round_: int) -> bool:
        """Whether a round's mean is applied before the next round starts (no delay)."""
        return self.inline

    # ---- inside the round ---------------------------------------------------------------
    def after_step(self, tokens: int) -> None:
        """Land the fragment sync in flight once τ steps have passed since it started and its mean is
        there (:meth:`land_due`), then start the sync of the next fragment whose offset in the round
        this step reached (fragment 0's, at the round's end, is :meth:`end_round`'s). One sync is in
        flight at a time: while one is, the next fragment's start is postponed to the first step
        after it landed, so the inner loop does not wait for it (its Δ_p then holds those steps
        too); a start postponed past the round's H steps is made in the steps a peer trains on while
        waiting (:meth:`trains_while_waiting`). A peer that jumped ahead in the round (a joiner, or
        after evaluating φ) starts the syncs it jumped over one after another, in the same way."""
        for p in range(len(self.fragments)):
            self.tokens[p] += tokens
        self.land_due()
        for p in self.postponed():
            if self.flight is not None:
                return  # postponed: starts at the first step after the sync in flight landed
            self.start_fragment_sync(p, self.state.pos.round)
            self.land_due()

    def trains_while_waiting(self) -> bool:
        """Past H: a fragment sync in flight, or a fragment due whose start was postponed, keeps the
        round going (the extra steps add to every fragment's next Δ), so fragment 0's sync at the
        round's end finds none in flight."""
        return self.extra_steps_left() and (self.flight is not None or bool(self.postponed()))

    def records_needed_at(self) -> int:
        """The round's first fragment sync, where its group choice is made; then the round's end (the
        re-sync rule needs the records of the round's end, not of its middle)."""
        pos = self.state.pos
        if self.choice is not None and self.choice[0] == pos.round:
            return self.state.H
        return min(
            (o for p, o in enumerate(self.offset) if o > pos.step and p not in self.synced), default=self.state.H
        )

    def restart_round(self) -> None:
        self.state.set_theta_to_phi()
        self.tokens = [0] * len(self.fragments)

    def postponed(self) -> list[int]:
        """The fragments (other than 0) whose offset this round reached and whose sync has not
        started, in offset order."""
        return [p for p in self.order if p not in self.synced and 0 < self.offset[p] <= self.state.pos.step]

    def land_due(self) -> None:
        """Land the fragment sync in flight if τ inner steps passed since it started and its result
        is there; with τ = 0 at once, waiting for it (no overlap).

        τ is the earliest a mean lands. A sync slower than τ steps lands at the first step its result
        is there; the inner loop waits for it only at the round's end, once the steps it may train on
        past H are used up, so a slow uplink costs staleness, not compute. Groupmates may land the
        same mean at different steps: φ_p is touched only by that landing, so they still hold
        identical φ; only their local θ_p differ, as they do anyway. ``Timing.land_at_delay``: exactly
        τ steps after its start, waiting there."""
        if self.flight is None:
            return
        tau, due = self.delay_steps, self.state.inner_step >= self.flight[1] + self.delay_steps
        if tau == 0 or (due and (self.background.done or self.timing.land_at_delay)):
            self.land_fragment()  # waits for the background sync where it is not done

    def round_choice(self, round_: int) -> tuple[GroupChoice, list]:
        """The group choice (and the live records it came from) for ``round_``'s fragment syncs,
        read from the DHT once per round."""
        if self.choice is None or self.choice[0] != round_:
            live = self.records.for_round(round_) if round_ == self.state.pos.round else self.sync.swarm.live()
            self.choice = (round_, self.sync.choose(round_, live), live)
        return self.choice[1], self.choice[2]

    def fragment_state(self, p: int) -> list[int]:
        """Fragment p's state indices: its φ tensors, then its outer state's (one per parameter)."""
        n = len(self.state.phi)
        return [*self.fragments[p], *(n + k for k in self.fragments[p])]

    # ---- one fragment's sync ------------------------------------------------------------
    def start_fragment_sync(self, p: int, round_: int) -> None:
        """Start fragment p's sync of ``round_`` (in the background, or inline: run at its landing):
        Δ_p = φ_p − θ_p, the payload of its tensors only, weighted by the tokens trained since its
        last sync. A sync still in flight lands first (one at a time). A non-finite Δ_p starts
        nothing: the fragment's progress is discarded (θ_p ← φ_p, φ_p unchanged) and the round's
        report says so."""
        s = self.state
        if self.flight is not None:
            self.land_fragment()
        if self.inline:  # the round's end of a blocking sync: the snapshot of the round before the last
            s.release_older_snapshot()  # goes before Δ and the mean are made (its round was for joiners)
        self.synced.add(p)
        index = self.fragments[p]
        phi_p = [s.phi[k] for k in index]
        keep = self.rule == "shift"  # θ_p as it is now is kept for the landing: a copy
        theta_p = [s.params[k].detach().to("cpu", torch.float32, copy=keep) for k in index]
        try:
            delta = pseudo_gradient(phi_p, theta_p)
            check_finite(delta, f"fragment {p}'s pseudo-gradient")
        except BadPayload as exc:
            what = "round" if self.whole_model else f"fragment {p}"
            self.reporter.emit("warning", message=f"{exc}: {what} not synced in round {round_}, its progress discarded")
            self.landed.append(SyncReport(note=f"{exc}: {what} discarded, φ unchanged"))
            self.tokens[p] = 0
            s.await_theta_copy()
            land([s.params[k] for k in index], phi_p, alpha=0.0, rule="mix", at_sync=None)
            return
        # NoLoCo's payload holds φ_p itself: a background sync may read it, as φ is never written in place
        payload = self.fragment_outer[p].payload(phi_p, delta)
        choice, live = self.round_choice(round_)
        # a postponed start and the steps past H make a fragment's steps more than a round's: its claim
        # is capped where its groupmates cap it (the owners' cap of a round's tokens)
        weight = float(min(max(self.tokens[p], 1), round_token_cap(s.m)))
        own = OwnDelta(delta, round_token_cap(s.m) / weight)  # bounds the landing's change of φ_p
        del delta  # the payload and ``own`` hold it until the mean is there
        self.tokens[p] = 0
        digest = s.digest
        due_s = self.sync.groupmates_due_s(live, round_, choice) if self.offset[p] == 0 else 0.0
        # inline: the training thread waits for the whole sync, no budget past the matchmaking window
        budget_s = 0.0 if self.inline else wait_budget_s(s.pos, max(1, s.H // len(self.fragments)))
        base = s.held(self.fragment_state(p))
        key = None if self.whole_model else p

        def sync_and_prepare(dropped):
            mean, report = self.sync.sync(
                payload,
                choice,
                digest,
                round_=round_,
                weight=weight,
                expected_wait_s=due_s,
                wait_budget_s=budget_s,
                fragment=key,
                dropped=dropped,
            )
            own.settle()  # Δ_p's norm; its tensors go with the payload (a failed sync's mean keeps them)
            # the outer step is prepared off the training thread: not inline, where the landing is now
            if mean is not None and not self.inline and not dropped() and not self.stop_event.is_set():
                prepared = self.prepare_fragment(p, base, mean)
                try:  # a step over its bound is not prepared: the landing refuses it, with the warning
                    if prepared is not None:
                        self.check_fragment_step(p, base, [t.tensor for t in prepared.sealed], own)
                except BadPayload:
                    prepared = None
                return mean, report, prepared
            return mean, report

        self.background.start(sync_and_prepare, round_=round_, start_digest=digest)
        self.flight = (p, s.inner_step, theta_p if keep else None)
        self.own = own

    def prepare_fragment(
        self, p: int, base: tuple[torch.Tensor, ...], mean: list[torch.Tensor]
    ) -> PreparedFragment | None:
        """In the sync's background thread, once fragment p's mean arrived: its outer step on copies
        of ``base`` (``step_on_copies``, bit-identical to applying it), the results sealed for the
        round's snapshot (``seal_tensor``: the finiteness check and the chunks' hashes). None when
        the mean is malformed or the step not finite: the landing applies it itself."""
        try:
            self.state.release_older_snapshot()  # before the step's copies are made
            return self._stepped(p, base, mean)
        except (BadPayload, ValueError) as exc:
            logger.debug("outer step of fragment %d not prepared: %s", p, exc)
            return None

    def step_fragment(
        self, p: int, mean: list[torch.Tensor], own: OwnDelta | None, *, consume: bool = False
    ) -> PreparedFragment:
        """Fragment p's outer step from what this peer holds now, on the training thread (no step
        was prepared for this mean), checked against its bound (:meth:`check_fragment_step`); the
        caller installs it. Nothing of the live state changes here.

        Args:
            consume: ``mean`` is this landing's alone (the blocking schedule's): the step may keep its
                new outer state in the mean's tensors (``step_consuming_mean``), which are then
                neither the mean nor to be used again, whatever the outcome.

        Raises:
            BadPayload: a malformed or non-finite mean, a non-finite result, or over its bound.
        """
        base = self.state.held(self.fragment_state(p))
        try:
            prepared = self._stepped(p, base, mean, consume=consume)
        except ValueError as exc:  # a non-finite result, refused by the seal's check
            raise BadPayload(f"the outer step of fragment {p} is not finite: {exc}") from None
        self.check_fragment_step(p, base, [t.tensor for t in prepared.sealed], own)
        return prepared

    def _stepped(
        self, p: int, base: tuple[torch.Tensor, ...], mean: list[torch.Tensor], *, consume: bool = False
    ) -> PreparedFragment:
        """Fragment p's outer step on copies of ``base``, sealed (new tensors: the seal copies nothing);
        with ``consume``, its new outer state written into ``mean``'s tensors (``step_consuming_mean``).

        Raises:
            BadPayload: a malformed or non-finite mean, or a non-finite step (``step_on_copies``).
            ValueError: a non-finite result (``seal_tensor``).
        """
        k = len(self.fragments[p])
        step = step_consuming_mean if consume else step_on_copies
        phi, outer_state = step(self.fragment_outer[p], base[:k], base[k:], mean)
        shapes = self.state.state_shapes()
        sealed = tuple(
            seal_tensor(t, index=i, shapes=shapes, owned=True)
            for i, t in zip(self.fragment_state(p), [*phi, *outer_state], strict=True)
        )
        return PreparedFragment(mean=mean, base=base, sealed=sealed)

    def land_fragment(self) -> None:
        """The fragment sync in flight lands (waiting for it if needed): φ_p ← OuterOpt_p(φ_p, mean)
        with its slice of the outer state, then θ_p by ``sync.fragment_merge``: θ_p ← α·θ_p +
        (1 − α)·φ_p (Streaming DiLoCo's merge) or θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync) ('shift',
        θ_p^sync kept when the sync started). Its report joins the round's. A failed sync applies
        this peer's own payload, as a failed blocking sync does; an outer step that would not be
        finite leaves φ_p as it was. On a stop nothing is applied: the sync is dropped, and θ keeps
        the fragment's progress."""
        s = self.state
        mean, report, prepared = self.take_background()
        assert self.flight is not None
        (p, started, at_sync), self.flight = self.flight, None
        if not self.inline:
            report = dataclasses.replace(report, overlap_steps=(s.inner_step - started,))
        if self.stop_event.is_set() and not self.inline:
            # stopping (a background sync was cancelled, or will not be trusted): dropped, as at the end;
            # an inline one ran to its end on this thread (a cancelled one applies this peer's own payload)
            return
        index = self.fragments[p]
        own, self.own = self.own, None
        phi_before = None  # φ_p before the group's step, where θ_p keeps its progress on kept rows
        if mean is not None:
            try:
                with s.lock:
                    installed = self.install_fragment(prepared, p, mean)  # a prepared step was checked in its thread
                    if not installed:
                        s.release_older_snapshot()  # before the outer step's new tensors are made
                        # inline: the mean is this landing's alone (a copy out of the shared buffers, or
                        # the failed sync's own payload), so the step keeps its new outer state in it
                        prepared = self.step_fragment(p, mean, own, consume=self.inline)
                if not installed:
                    assert prepared is not None
                    prepared, report = self.gated(p, prepared, report)
                    with s.lock:
                        self.install_fragment(prepared, p, prepared.mean)
                phi_before = prepared.base[: len(index)] if prepared is not None else None
            except BadPayload as exc:
                self.reporter.emit("warning", message=f"{exc}: fragment {p}'s outer step skipped")
                report = dataclasses.replace(
                    report,
                    failed=True,
                    agreeing=(),
                    completed=(),
                    note=f"fragment {p}: outer step skipped ({exc})",
                    kept_rows=(),
                )
        s.await_theta_copy()
        phi_p = [s.phi[k] for k in index]  # as installed now
        kept = report.kept_rows if phi_before is not None else ()
        theta_p = [s.params[k] for k in index]
        land(theta_p, phi_p, alpha=self.alpha, rule=self.rule, at_sync=at_sync, kept_rows=kept, phi_before=phi_before)
        self.landed.append(report)

    def gated(self, p: int, prepared: PreparedFragment, report: SyncReport) -> tuple[PreparedFragment, SyncReport]:
        """The blocking schedule's loss gate (:attr:`gate`, peer/round/loss_gate.py) on the group's step
        ``prepared`` of the landing that ``report`` describes: that step, or, when the gate refuses it,
        this peer's own step alone (its payload as the mean, as after a failed sync) with the report
        saying so (no groupmate holds this peer's state). Not gated: no gate, a streamed fragment,
        or no group (a failed sync or no partner: the step is this peer's own already).

        Raises:
            BadPayload: this peer's own step is not finite (:meth:`step_fragment`).
        """
        if self.gate is None or not self.whole_model or report.failed or report.group_size < 2:
            return prepared, report
        s, k, outer = self.state, len(self.fragments[p]), self.fragment_outer[p]
        s.await_theta_copy()
        phi_p = [s.phi[i] for i in self.fragments[p]]
        theta_p = [s.params[i].detach().to("cpu", torch.float32) for i in self.fragments[p]]
        own_payload = outer.payload(phi_p, pseudo_gradient(phi_p, theta_p))
        del theta_p
        # the step alone on copies, unsealed: sealed (hashed) only when it is the one applied
        alone_phi, _ = step_on_copies(outer, phi_p, s.held(self.fragment_state(p))[k:], own_payload)
        problem = self.gate.refusal(alone_phi, [t.tensor for t in prepared.sealed[:k]])
        del alone_phi
        if problem is None:
            return prepared, report
        alone = self.step_fragment(p, own_payload, None)
        return alone, applied_alone(self.reporter, report, problem)

    def install_fragment(self, prepared: PreparedFragment | None, p: int, mean: list[torch.Tensor]) -> bool:
        """Install a prepared fragment step as φ_p and the fragment's outer state (call under the
        lock; ``RoundState.install``: rebound, not copied) and keep its sealed tensors for the round's
        snapshot; whether it was installed. Only a step prepared from this very ``mean`` and from
        fragment p's tensors as this peer still holds them (an adoption since replaced them); else
        the caller applies ``mean``."""
        s = self.state
        held = s.held(self.fragment_state(p))
        if (
            prepared is None
            or prepared.mean is not mean
            or len(held) != len(prepared.base)
            or any(a is not b for a, b in zip(held, prepared.base))
        ):
            return False
        s.install([sealed.index for sealed in prepared.sealed], [sealed.tensor for sealed in prepared.sealed])
        s.sealed.update((sealed.index, sealed) for sealed in prepared.sealed)
        return True

    def check_fragment_step(
        self,
        p: int,
        before: tuple[torch.Tensor, ...],
        after: list[torch.Tensor],
        own: OwnDelta | None,
    ) -> None:
        """Refuse fragment p's outer step (BadPayload) when its change of φ_p, from ``before`` (φ_p then
        the fragment's outer state, as this peer held them) to ``after`` (φ_p, at least), exceeds what
        an honest mean can make from this peer's own Δ_p (``own``: peer/train/outer.py
        ``check_step_bound``). No ``own`` (no sync of this peer's started it): not checked."""
        if own is None:
            return
        k = len(self.fragments[p])
        what = "the round's outer step" if self.whole_model else f"fragment {p}'s outer step"
        check_step_bound(
            self.fragment_outer[p],
            before[:k],
            after[:k],
            own.settle(),
            old_state=before[k:],
            scale=own.scale,
            what=what,
        )

    # ---- the round's end ----------------------------------------------------------------
    def end_round(self) -> RoundEnd:
        """A fragment sync whose start is still postponed starts (waiting for the one in flight, and
        is waited for: the round's extra steps are used up), then fragment 0's (its mean lands τ
        steps into the next round, or later; at once with τ = 0), and the report holds the fragment
        syncs that landed during the round. θ is not reset to φ: each fragment's merge did that part.
        The snapshot of the next round holds every mean landed so far."""
        s = self.state
        choice, live = self.round_choice(s.pos.round)
        start_digest = s.digest
        done = dataclasses.replace(s.pos)
        # fragments due inside the round first (each waits for the one before), fragment 0 last: its
        # sync is the one in flight into the next round (fragment 0 alone has offset 0)
        for p in [*self.postponed(), 0]:
            self.start_fragment_sync(p, done.round)
            self.land_due()
        report = self.take_landed(done.round)
        with s.lock:
            s.pos.start_round(s.pos.round + 1)
        self.synced = set()
        self.guard_phi()
        s.take_snapshot(from_sealed=True)
        return RoundEnd(done=done, live=live, start_digest=start_digest, choice=choice, report=report)

    def take_landed(self, round_: int) -> SyncReport:
        """The fragment syncs that landed since the last call, as one report (noted as the sync of
        ``round_`` when any landed: alone or discarded, nobody else holds this peer's state)."""
        landed, self.landed = self.landed, []
        report = landed[0] if len(landed) == 1 else combine_sync_reports(landed)
        if landed:
            self.history.note_group(round_, report)
        return report

    def finish(self) -> None:
        """At ``max_rounds``: the sync in flight lands, then every fragment synced inside the round
        (offset > 0) syncs once more and lands at once, so the final φ holds every step; θ ← φ. Those
        fragments sync whether or not this peer trained steps since (weight 1 then), so its
        groupmates find it in that sync whatever their timing; fragment 0 only with steps since. On a
        stop the sync in flight is dropped."""
        if self.stop_event.is_set():
            self.background.drop("stopping")
            return
        if self.inline:
            return  # its mean landed at the round's end, with θ ← φ: nothing in flight, nothing left
        s = self.state
        if self.flight is not None:
            self.land_fragment()
        for p in range(len(self.fragments)):
            if self.offset[p] > 0 or self.tokens[p] > 0:
                self.start_fragment_sync(p, s.pos.round)
                if self.flight is not None:
                    self.land_fragment()
        self.take_landed(s.pos.round)
        self.guard_phi()
        s.set_theta_to_phi()
        s.take_snapshot()

    # ---- adoption and restore -----------------------------------------------------------
    def before_adopt(self, round_: int) -> None:
        """Only fragment 0's sync, started at the round's end, is not in the next round's state: kept
        when the adopted state is of the round after it, else dropped."""
        bg = self.background
        if bg.in_flight:
            if (
                bg.round is not None
                and round_ == bg.round + 1
                and (self.flight is None or self.offset[self.flight[0]] == 0)
            ):
                self.adopted_in_flight = True
            else:
                bg.drop("adopted the swarm's state")  # its mean belongs to a φ left behind
                self.flight = None

    def after_adopt(self) -> None:
        """θ = φ: no fragment has progress of its own; this round's syncs are all ahead. With
        'shift', θ_p of a kept sync restarts from the adopted φ_p."""
        if self.adopted_in_flight and self.flight is not None and self.flight[2] is not None:
            p, started, _ = self.flight
            self.flight = (p, started, [self.state.phi[k].clone() for k in self.fragments[p]])
        self.tokens, self.synced, self.landed = [0] * len(self.fragments), set(), []

    def after_restore(self, round_step: int, round_tokens: int) -> None:
        """θ holds this round's steps: weigh each fragment's next Δ by them."""
        self.tokens = [round_tokens] * len(self.fragments)
        self.synced = {p for p, t in enumerate(self.offset) if 0 < t <= round_step}


StreamingSchedule = FragmentSchedule
"""``sync.overlap = "streaming"``: the fragment schedule as the run sets it."""
