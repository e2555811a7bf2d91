"""Catch-up: adopting the swarm's state while this peer is behind or diverged (the outer
algorithm's re-sync rule, peer/train/resync.py, over the records that may vouch,
peer/state/vouching.py), and a joiner's first adoption.

No adoption without agreement (issue #51, item 2): the rule picks only a class enough counted peers
hold; the downloaded state must then be of the round its records claim (``check_agrees``), within
the norm bound (``check_sanity``) and not clearly worse on this peer's validation windows than its
own φ (:func:`loss_refusal`, a joiner's own φ being φ_0); anything that fails, or raises, leaves the
peer on its own state and the digest is not downloaded again.

A joiner's evidence (issue #65, item 6). A peer without history (the joiner's rule: no voucher live)
counts identities whose signed records name each other, which fresh keys can do at once, and its
own φ (φ_0 for a fresh joiner) is no bar: any state better than random passed. So it also holds the
state against what the records claim: its validation loss may be at most :data:`CLAIM_MARGIN` above
the lowest loss a counted class claims (``ProgressRecord.claimed_loss``, the lower median of the
class's members; classes as big as the rule requires, ahead of this peer, claims not yet fallen).
A state above it is *outclaimed*: refused, and the claiming class's state is downloaded next to
check the claim. A class whose own state fails (its claim was a lie) or cannot be downloaded then
is believed no more, and what it outclaimed may be tried again (peer/state/vouching.py). A state
that is merely better than random now fails while honest peers claim the swarm's loss; capturing
a joiner takes a state about as good as the swarm's, i.e. the training, not only keys. Forged low
claims cost the joiner a download each.

A peer nobody can dial (client mode) that raced ahead alone steps back to the swarm behind it (the
re-sync rule's ``defers``): nobody can adopt its state, so its own φ, better by every round it trained
alone, is not what the swarm's is held against; the run's initial φ is (a state worse than no
training is still refused). Held against its own φ, it would refuse the swarm's state for good and
the two would never average again.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from peer.config import TrainerConfig
from peer.progress import Waiting
from peer.reporting import Reporter
from peer.round.records import RECORDS_REUSE_S
from peer.round.schedule import SyncSchedule
from peer.round.state import RoundState
from peer.round.syncing import SyncHistory
from peer.state.download import DownloadedState, check_agrees, check_sanity
from peer.state.vouching import Vouching, class_claims
from peer.sync.membership import RoundSwarm
from peer.sync.transport import RoundTransport
from peer.train.inner import InnerLoop
from peer.train.model import evaluate
from peer.train.resync import MIN_HOLDERS, Target, counted
from protocol.errors import BadPayload, HelperDied, StateDownloadFailed, SyncError

if TYPE_CHECKING:
    from peer.net.dht import PeerProgress

FINISHING_RECORD_WAIT_S = 5.0
"""How long a peer waits, after a round, for the records of peers finishing the same round before it
runs the re-sync rule (s)."""

JOINER_WAIT_S = 10.0
"""How long a fresh peer keeps reading the records for a state to adopt while peers ahead of it are
live, before it trains from its own initial φ (s)."""

LOSS_MARGIN = 0.10
"""How much worse, relative to this peer's own φ's validation loss, a downloaded φ's may be and still
be adopted: 10 %. Measured with the tiny preset (bench/adoption_margin.py, 4 peers, 40 rounds, 2
seeds; bench/results/adoption_margin.json): the swarm's averaged state, which a peer that fell back
to its own Δ must be able to adopt, was at most 1.3 % worse than that peer's own θ; 10 % leaves that
over seven times, while the states of issue #51's attacks were 87 % to 460 % worse (−φ: 14.19 vs
2.54, a Sybil group's 8.77 vs 2.3, sub-clip poisoning 4.74 vs 2.54)."""

CLAIM_MARGIN = 0.5
"""How far above the best loss the counted records claim (``ProgressRecord.claimed_loss``) a state a
peer without history downloads may measure on its validation windows and still be adopted: 50 %.
A claim is usually a training loss of θ during the round after the state (a single batch's,
mid-round), so an honest state measures above it by up to a round's progress plus the batch's noise
and the gap between training and validation data; the attacks of issue #51 were 87 % to 460 %
worse than the honest state, and a state merely better than random (φ_0: 5.55 nats/token at 256
tokens) fails as soon as the swarm claims under 3.7."""

PhiLoss = Callable[[Sequence[torch.Tensor]], float]
"""The validation loss (nats/token) of a φ (fp32 tensors shaped as the model's parameters)."""


def phi_loss(model: torch.nn.Module, windows: torch.Tensor, phi: Sequence[torch.Tensor]) -> float:
    """The mean validation loss of ``phi`` over ``windows`` (peer/train/model.py ``evaluate``), in nats
    per token, computed on ``model`` (an evaluation copy: its parameters are overwritten).

    Raises:
        ValueError: ``phi`` does not have one tensor per parameter of ``model``.
    """
    params = list(model.parameters())
    if len(params) != len(phi):
        raise ValueError(f"φ has {len(phi)} tensors, the model {len(params)} parameters")
    with torch.no_grad():
        for p, f in zip(params, phi):
            p.copy_(f)
    return evaluate(model, windows)


def loss_refusal(theirs: float, own: float, *, tie: bool, margin: float = LOSS_MARGIN) -> str | None:
    """Why a state of validation loss ``theirs`` must not replace one of loss ``own``, or None.

    Refused: a non-finite ``theirs``; ``theirs`` over ``own · (1 + margin)`` (clearly worse); with
    ``tie`` (the re-sync rule's tie-break, resync.py ``Target.tie``), ``theirs`` not below ``own``.
    """
    if not theirs == theirs or theirs in (float("inf"), float("-inf")):
        return f"its validation loss is {theirs}"
    if tie and not theirs < own:
        return f"its validation loss {theirs:.4f} is not below this peer's {own:.4f} (a tie between classes)"
    if theirs > own * (1.0 + margin):
        return f"its validation loss {theirs:.4f} is more than {margin:.0%} above this peer's {own:.4f}"
    return None


class ClaimCheck(Target):
    """The class whose claimed loss refused another state (:class:`Outclaimed`): its own state is
    downloaded next, to check the claim; a download that fails takes the claim back."""


class Outclaimed(BadPayload):
    """A downloaded state's validation loss is more than :data:`CLAIM_MARGIN` above the best claim.

    Attributes:
        by: the digest of the class whose claim it fails, when only that claim refuses it (the
            state is tried again if that claim falls); None when it fails its own class's claim too.
    """

    def __init__(self, message: str, *, by: str | None):
        super().__init__(message)
        self.by = by


class CatchUp:
    """Runs the re-sync rule after every round (and before the first) and adopts what it picks."""

    def __init__(
        self,
        *,
        state: RoundState,
        schedule: SyncSchedule,
        history: SyncHistory,
        vouching: Vouching,
        swarm: RoundSwarm,
        transport: RoundTransport,
        inner: InnerLoop,
        config: TrainerConfig,
        reporter: Reporter,
        stop_event: threading.Event,
        publish: Callable[[], None],
        loss_of: PhiLoss | None = None,
        initial_loss: Callable[[], float] | None = None,
    ):
        """``loss_of``: the validation loss of a φ (:func:`phi_loss` on an evaluation copy of the model
        and this peer's validation windows); None on a pipelined peer, which holds one stage and cannot
        evaluate (it adopts without the loss check). ``initial_loss``: the validation loss of the run's
        initial φ (the reference of a client-mode peer stepping back, :meth:`check_loss`); None: its
        own φ's is used then too."""
        self.state, self.schedule, self.history, self.vouching = state, schedule, history, vouching
        self.swarm, self.transport, self.inner, self.cfg = swarm, transport, inner, config
        self.reporter, self.stop_event, self.publish, self.loss_of = reporter, stop_event, publish, loss_of
        self.initial_loss = initial_loss
        self.claims: dict[tuple[int, str], tuple[float, list[str]]] | None = None
        """(round, digest) → (claimed loss, counted members) of the classes the last
        :meth:`resync_target` read, when it ran the joiner's rule (no voucher live); None otherwise:
        a peer with history is not held to the records' claims."""
        self.verify: ClaimCheck | None = None
        """The class whose claim outclaimed the last state refused: :meth:`resync_target`'s next
        pick, to check that claim."""
        self.failed_downloads = 0
        """State downloads that failed in a row: the first for want of donors is a ``status`` line, the
        next ones (and any other failure) a ``warning``."""
        self._measured: list[tuple[list[weakref.ref[torch.Tensor]], float]] = []
        """The φs the last loss checks measured (weak references to their tensors) and their losses:
        :meth:`known_loss`."""

    def known_loss(self, phi: Sequence[torch.Tensor]) -> float | None:
        """The validation loss (nats/token) a loss check of this catch-up measured for these very
        tensors, or None. φ's tensors are never written in place (peer/round/state.py), so the same
        tensors hold the same values: the round's initial evaluation of an adopted φ (or of this
        peer's own φ, measured against a refused state) reuses it instead of evaluating it again."""
        for refs, loss in self._measured:
            if len(refs) == len(phi) and all(r() is t for r, t in zip(refs, phi)):
                return loss
        return None

    def remember(self, phi: Sequence[torch.Tensor], loss: float) -> None:
        """Keep ``loss`` (nats/token) as ``phi``'s for :meth:`known_loss` (the last two φs measured: own
        and theirs; a restored checkpoint's φ with the loss it recorded)."""
        kept = [(refs, v) for refs, v in self._measured[-1:] if all(r() is not None for r in refs)]
        self._measured = [*kept, ([weakref.ref(t) for t in phi], loss)]

    def catch_up(self, attempts: int = 3) -> None:
        """Adopt the swarm's state while this peer is behind or diverged, again while the swarm moved
        on during a download.

        A fresh peer (round 0, no step trained) that finds no state to adopt while live peers are
        ahead reads the records again twice a second, up to :data:`JOINER_WAIT_S`, before it trains
        from its own initial φ: the joiner's rule counts only states the records attest, and right
        after a round a groupmate's record can still be the last round's, so the first read may
        attest nothing. That wait is said in one ``status`` line when it starts."""
        s, started = self.state, time.monotonic()
        try:
            self.wait_for_peers_finishing()
            deadline, adopted, said = time.monotonic() + JOINER_WAIT_S, 0, False
            while adopted < attempts and not self.stop_event.is_set():
                if self.catch_up_once():
                    adopted += 1
                    continue
                fresh = s.pos.round == 0 and s.pos.step == 0
                ahead = sum(1 for r in self.swarm.others() if r.record.round > 0) if fresh else 0
                if not ahead or time.monotonic() >= deadline:
                    return
                if not said:
                    said = True
                    self.reporter.emit(
                        "status",
                        message=f"no state to adopt yet from the {ahead} peer(s) ahead: reading their records "
                        f"again for up to {max(0.0, deadline - time.monotonic()):.0f} s, then training from the "
                        "initial φ if none attests one",
                    )
                self.stop_event.wait(0.5)
        finally:
            s.waited["resync"] += time.monotonic() - started

    def wait_for_peers_finishing(self) -> None:
        """Wait until most peers whose last record is in the last quarter of the previous round
        published the round this peer is now in, at most :data:`FINISHING_RECORD_WAIT_S`; a stop
        ends the wait. Without it the re-sync rule sees them one round behind (which it ignores),
        and a peer that differs from its group by one mean keeps syncing with it every round but
        never notices that it diverged.

        Not waited for: the groupmates that completed this peer's last landed sync from its own
        state (they hold this peer's state); with overlap also not the other peers in the last
        quarter unless this peer's last sync failed. Always waited for, wherever they are in that
        round: the groupmates of the last landed sync who had started it from another state."""
        s, h = self.state, self.history
        round_, closing = s.pos.round - 1, s.H - max(1, s.H // 4)
        blocking = self.schedule.synced_blocking(round_)  # how the round just ended synced
        outsiders = blocking or h.last_failed
        reuse_s = 0.0 if blocking else RECORDS_REUSE_S
        finishing = {
            r.peer_id
            for r in self.swarm.others(max_age_s=reuse_s)
            if r.record.round == round_
            and (
                (outsiders and r.peer_id not in h.completed_with and r.record.inner_step - round_ * s.H >= closing)
                or r.peer_id in h.disagreed
            )
        }
        deadline = time.monotonic() + FINISHING_RECORD_WAIT_S
        while finishing and not self.stop_event.is_set() and time.monotonic() < deadline:
            still = sum(1 for r in self.swarm.others() if r.peer_id in finishing and r.record.round == round_)
            if 2 * still < len(finishing):
                return
            self.stop_event.wait(0.1)

    def catch_up_once(self) -> bool:
        """Download φ, outer state and round from every peer publishing the target digest at once
        (peer/state/download.py), checked against the digest, and start at the swarm's current inner
        step. A failed or refused download is reported and leaves this peer's state unchanged (the first
        download in a row that fails for want of donors as a ``status`` line, :attr:`failed_downloads`)."""
        s = self.state
        target = self.resync_target()
        if target is not None and self.about_to_sync(target[0], target[2]):
            # Its donors are in the last quarter of their round: a state downloaded now would reach
            # the sync after their group formed. Wait for the state they publish after the sync;
            # the loss of the φ the state will be held against is measured first, inside that wait.
            if self.loss_of is not None:
                try:
                    self.reference_loss(target[0])
                except Exception:  # measured again by the check, which refuses the state on it
                    pass
            self.wait_until_past(target[0], target[2])
            if not isinstance(target, ClaimCheck):
                target = self.resync_target()
        if target is None:
            return False
        round_, digest, donors = target
        start = time.monotonic()
        # the transfer draws its own progress (peer/state/sharing.py); this line says what it is for
        self.reporter.emit(
            "status",
            message=f"downloading the state of round {round_} ({digest[:16]}…) from {len(donors)} peer(s); "
            f"this peer is at round {s.pos.round}",
        )
        try:
            download = self.transport.download_state(donors, digest, self.cfg.state_download_timeout_s)
        except HelperDied:
            raise
        except Exception as exc:  # whatever a hostile donor's state makes the download raise: this peer goes on
            kind = "" if isinstance(exc, (BadPayload, SyncError)) else f"{type(exc).__name__}: "
            self.failed_downloads += 1
            # donors that left or stopped answering (a restarted peer's stale record, most often) are
            # the swarm's ordinary churn: a warning only when it happens again in a row
            churn = isinstance(exc, StateDownloadFailed) and self.failed_downloads == 1
            if isinstance(target, ClaimCheck):  # a claim its own class cannot show: believed no more
                self.vouching.unback(digest)
            self.reporter.emit(
                "status" if churn else "warning",
                message=f"state download of round {round_} failed"
                + (f" {self.failed_downloads} times in a row" if self.failed_downloads > 1 else "")
                + f", continuing from round {s.pos.round}: {kind}{exc}",
            )
            return False
        self.failed_downloads = 0
        state = download.state
        try:
            check_agrees(state, round_=round_, inner_steps=s.H)  # the round its records advertise (#51)
            with s.lock:
                check_sanity(state, s.phi)
            theirs = self.check_loss(state, tie=getattr(target, "tie", False))
            if theirs is not None:
                self.check_claim(round_, digest, theirs)
        except HelperDied:
            raise
        except Exception as exc:  # BadPayload, or whatever a hostile state makes a check raise
            self.vouching.refuse(digest, outclaimed_by=exc.by if isinstance(exc, Outclaimed) else None)
            kind = "" if isinstance(exc, BadPayload) else f"{type(exc).__name__}: "
            self.reporter.emit(
                "warning",
                message=f"refused the state of round {round_} ({digest}) from "
                f"{', '.join(donors)}, continuing from round {s.pos.round}: {kind}{exc}",
            )
            return False
        reason = "behind" if state.round > s.pos.round else "diverged" if state.round == s.pos.round else "raced ahead"
        try:
            self.adopt(state)
            if theirs is not None:  # φ is now the checked state's (its tensors, or copies of them)
                with s.lock:
                    self.remember(list(s.phi), theirs)
        except HelperDied:
            raise
        except Exception as exc:  # adopt() put this peer's own state back
            self.vouching.refuse(digest)
            self.reporter.emit(
                "warning",
                message=f"could not adopt the state of round {round_} ({digest}), continuing from round "
                f"{s.pos.round}: {type(exc).__name__}: {exc}",
            )
            return False
        # Start where the swarm is inside this round (read again: it went on during the download), so
        # this peer reaches the sync with the others; the all-reduce weights its shorter round by the
        # tokens it actually processed.
        s.pos.step = self.swarm.step_now(
            s.pos.round, inner_steps=s.H, batch_size_tokens=s.m.inner_optimizer.batch_size_tokens
        )
        self.reporter.emit(
            "adopted_state",
            round=s.pos.round,
            inner_step=s.inner_step,
            seconds=time.monotonic() - start,
            reason=reason,
            state_digest=s.digest,
            donors=download.chunks_by_donor,
            failed_donors=download.failed,
            bytes=download.bytes_received,
        )
        self.publish()
        return True

    def check_loss(self, state: DownloadedState, *, tie: bool) -> float | None:
        """Refuse ``state`` if its φ's validation loss is clearly worse than this peer's own φ's
        (:func:`loss_refusal`; with ``tie``, if it is not lower). A client-mode peer (it serves no
        state) taking a state of an earlier round than its own (it raced ahead alone; the re-sync
        rule's ``defers``) holds it against the run's initial φ instead (``initial_loss``), as a
        joiner does. Nothing is checked without ``loss_of`` (a pipelined peer). Changes nothing.

        Returns:
            The state's validation loss (nats/token), or None without ``loss_of``.

        Raises:
            BadPayload: refused; the message gives both losses.
        """
        if self.loss_of is None:
            return None
        with Waiting(f"comparing the validation loss of the downloaded state of round {state.round} with this peer's"):
            own, whose = self.reference_loss(state.round)
            theirs = self.loss_of(state.phi)
        self.remember(state.phi, theirs)
        problem = loss_refusal(theirs, own, tie=tie and whose == "this peer's")
        if problem is not None:
            raise BadPayload(problem.replace("this peer's", whose))
        return theirs

    def reference_loss(self, round_: int) -> tuple[float, str]:
        """The validation loss (nats/token) a state of ``round_`` is held against (:meth:`check_loss`)
        and whose φ it is: this peer's own φ's (measured once per φ, :meth:`known_loss`), or the run's
        initial φ's for a client-mode peer stepping back (``initial_loss``, remembered by its
        caller). Requires ``loss_of``.

        Raises:
            ValueError: no ``loss_of`` (a pipelined peer); what ``loss_of`` raises.
        """
        if self.loss_of is None:
            raise ValueError("a pipelined peer checks no loss")
        s = self.state
        if not self.cfg.serves_state and round_ < s.pos.round and self.initial_loss is not None:
            return self.initial_loss(), "the run's initial φ's"
        with s.lock:  # φ's tensors are never written in place (peer/round/state.py): no copy
            own_phi = list(s.phi)
        own = self.known_loss(own_phi)
        if own is None:
            own = self.loss_of(own_phi)
            self.remember(own_phi, own)
        return own, "this peer's"

    def check_claim(self, round_: int, digest: str, theirs: float) -> None:
        """Refuse the state ``digest`` of ``round_``, of validation loss ``theirs`` (nats/token), if it
        is more than :data:`CLAIM_MARGIN` above the best claim of :attr:`claims` (under the joiner's
        rule only: nothing is checked without claims). When the best claim is another class's, that
        class becomes :attr:`verify` (its state is downloaded next). Changes nothing else.

        Raises:
            Outclaimed: refused; ``by`` is the claiming class's digest, or None when the state is
                also above its own class's claim (that claim falls with it, ``Vouching.refuse``).
        """
        if not self.claims:
            return
        own = self.claims.get((round_, digest))
        (best_round, best), (claim, members) = min(self.claims.items(), key=lambda kv: (kv[1][0], kv[0]))
        if theirs <= claim * (1.0 + CLAIM_MARGIN):
            return
        lied = own is not None and theirs > own[0] * (1.0 + CLAIM_MARGIN)
        if best != digest:
            self.verify = ClaimCheck(best_round, best, list(members))
        raise Outclaimed(
            f"its validation loss {theirs:.4f} is more than {CLAIM_MARGIN:.0%} above the loss {claim:.4f} "
            f"the records of {len(members)} peer(s) holding {best[:16]}… claim",
            by=None if lied or best == digest else best,
        )

    def resync_target(self) -> tuple[int, str, list[str]] | None:
        """The outer algorithm's re-sync rule over the records that may vouch, counting only the
        peers this peer completed a sync with in an earlier round, or, without history, what the
        records' signed ``groupmates`` attest (``Vouching.screen``).

        With a sync in flight (``SyncSchedule.holds_leaders_back``), records one round ahead are
        left out, as records one round behind are, except a groupmate that averaged with this peer
        from another state in its last sync.

        Under the joiner's rule it also sets :attr:`claims`, and the class whose claim refused the
        last state (:attr:`verify`, a :class:`ClaimCheck`) is picked first, once."""
        s, h = self.state, self.history
        # the read just made at the round's end, with overlap (a blocking sync came after it)
        reuse_s = 0.0 if self.schedule.synced_blocking(s.pos.round - 1) else RECORDS_REUSE_S
        others, vouchers = self.vouching.screen(self.swarm.others(max_age_s=reuse_s), round_=s.pos.round)
        if self.schedule.holds_leaders_back():
            others = [r for r in others if not (r.record.round == s.pos.round + 1 and r.peer_id not in h.disagreed)]
        self.claims = None
        if vouchers is None:  # the joiner's rule: held to the claims, and a claim to check comes first
            self.claims = self.claimed(others)
            verify, self.verify = self.verify, None
            if verify is not None and verify[1] not in self.vouching.refused:
                return verify
        return s.outer.resync_target(
            [(r.peer_id, r.record.round, r.record.state_digest) for r in others],
            round_=s.pos.round,
            digest=s.digest,
            completed_with=h.completed_with,
            fresh=s.pos.round == 0 and s.pos.step == 0,
            vouchers=vouchers,
            groupmates={r.peer_id: r.record.groupmates for r in others},
            defers=not self.cfg.serves_state,
        )  # client mode: its state cannot be adopted, so it follows

    def claimed(self, others: Sequence[PeerProgress]) -> dict[tuple[int, str], tuple[float, list[str]]]:
        """The claims a state is held to under the joiner's rule: (round, digest) → (claimed loss,
        counted members) of each class ahead of this peer's round whose counted members are as many
        as the rule requires of a class (``MIN_HOLDERS``, or the biggest class's count if smaller:
        NoLoCo's one-member classes) and whose claim still stands (not :attr:`Vouching.unbacked`).
        Records of refused digests are already screened out."""
        s = self.state
        classes = counted(
            [(r.peer_id, r.record.round, r.record.state_digest) for r in others],
            vouchers=None,
            groupmates={r.peer_id: r.record.groupmates for r in others},
            own=(s.pos.round, s.digest),
        )
        required = min(MIN_HOLDERS, max((len(m) for m in classes.values()), default=1))
        eligible = {
            c: members
            for c, members in classes.items()
            if c[0] > s.pos.round and len(members) >= required and c[1] not in self.vouching.unbacked
        }
        return {c: (loss, eligible[c]) for c, loss in class_claims(others, eligible).items()}

    def about_to_sync(self, round_: int, donors: list[str]) -> bool:
        """Whether a donor of ``round_``'s state published a step in the last quarter of that round
        (records come four times a round, so this is the last one before its sync)."""
        closing = self.state.H - max(1, self.state.H // 4)
        return any(
            r.peer_id in donors and r.record.round == round_ and r.record.inner_step - round_ * self.state.H >= closing
            for r in self.swarm.others()
        )

    def wait_until_past(self, round_: int, donors: list[str]) -> None:
        """Wait until most donors left ``round_`` (a hung one must not hold this peer), at most one
        sync's bound, polling the DHT twice a second; a stop ends the wait. A wait over 5 s says what
        it waits for (:class:`~peer.progress.Waiting`)."""
        deadline = time.monotonic() + self.swarm.max_sync_s
        what = (
            f"waiting for {len(donors)} peer(s) to finish the sync of round {round_} "
            f"(up to {self.swarm.max_sync_s:.0f} s), to download the state they hold after it"
        )
        with Waiting(what):
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                still = sum(1 for r in self.swarm.others() if r.peer_id in donors and r.record.round == round_)
                if 2 * still < len(donors):
                    return
                self.stop_event.wait(0.5)

    def adopt(self, state: DownloadedState) -> None:
        """Take a downloaded state: φ, the outer state and the round; θ ← φ, a fresh AdamW (a joiner
        takes φ and the outer momentum and starts a fresh inner optimizer), no error-feedback
        residuals. A sync in flight is kept or dropped by the schedule (``before_adopt``). The
        downloaded tensors become the live state (``RoundState.install``: the download's private
        copies, not copied again; one that is not a contiguous fp32 host tensor is copied first).

        Raises:
            BadPayload: the state's tensors are not this peer's in number, shape or dtype; nothing
                changed.
            Whatever copying raises; nothing changed.
        """
        s = self.state
        live, new = s.live_tensors(), [*state.phi, *state.outer_state]
        if len(live) != len(new) or any(a.shape != b.shape or b.dtype != torch.float32 for a, b in zip(live, new)):
            raise BadPayload(
                f"the state holds {len(new)} tensors {[(tuple(t.shape), t.dtype) for t in new][:4]}…, this "
                f"peer {len(live)} fp32 {[tuple(t.shape) for t in live][:4]}…"
            )
        plain = all(t.device.type == "cpu" and t.is_contiguous() for t in new)
        if not plain:
            new = [t.detach().to("cpu", torch.float32).contiguous().clone() for t in new]
        self.schedule.before_adopt(state.round)
        with s.lock:
            s.install_all(new)
            s.pos.start_round(state.round)
        s.set_theta_to_phi()
        self.schedule.after_adopt()
        self.inner.reset_optimizer()
        self.transport.reset_error_feedback()  # residuals of a φ this peer no longer holds
        self.history.forget()
        if state.chunk_hashes is not None and plain:  # its download hashed every chunk of these tensors
            s.take_snapshot(verified=(new, state.chunk_hashes))
        else:
            s.take_snapshot()
