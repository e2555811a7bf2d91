"""Catch-up: adopting the swarm's state while this peer is behind or diverged (the outer
algorithm's re-sync rule, peer/state/resync.py, over the records that may vouch,
peer/state/vouching.py), and a joiner's first adoption."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from peer.config import TrainerConfig
from peer.reporting import Reporter
from peer.round.records import RECORDS_REUSE_S
from peer.round.schedule import SyncSchedule
from peer.round.state import RoundState
from peer.round.syncing import SyncHistory
from peer.state.download import DownloadedState, check_agrees, check_sanity
from peer.state.vouching import Vouching
from peer.sync.membership import RoundSwarm
from peer.sync.transport import RoundTransport
from peer.train.inner import InnerLoop
from protocol.errors import BadPayload, HelperDied, SyncError

FINISHING_RECORD_WAIT_S = 5.0
"""How long a peer waits, after a round, for the records of peers finishing the same round before it
runs the re-sync rule (s)."""

JOINER_WAIT_S = 10.0
"""How long a fresh peer keeps reading the records for a state to adopt while peers ahead of it are
live, before it trains from its own initial φ (s)."""


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
    ):
        self.state, self.schedule, self.history, self.vouching = state, schedule, history, vouching
        self.swarm, self.transport, self.inner, self.cfg = swarm, transport, inner, config
        self.reporter, self.stop_event, self.publish = reporter, stop_event, publish

    def catch_up(self, attempts: int = 3) -> None:
        """Adopt the swarm's state while this peer is behind or diverged, again while the swarm moved
        on during a download.

        A fresh peer (round 0, no step trained) that finds no state to adopt while live peers are
        ahead reads the records again twice a second, up to :data:`JOINER_WAIT_S`, before it trains
        from its own initial φ: the joiner's rule counts only states the records attest, and right
        after a round a groupmate's record can still be the last round's, so the first read may
        attest nothing."""
        s, started = self.state, time.monotonic()
        try:
            self.wait_for_peers_finishing()
            deadline, adopted = time.monotonic() + JOINER_WAIT_S, 0
            while adopted < attempts and not self.stop_event.is_set():
                if self.catch_up_once():
                    adopted += 1
                    continue
                fresh = s.pos.round == 0 and s.pos.step == 0
                if not (fresh and any(r.record.round > 0 for r in self.swarm.others())) or time.monotonic() >= deadline:
                    return
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
        step. A failed or refused download is reported and leaves this peer's state unchanged."""
        s = self.state
        target = self.resync_target()
        if target is not None and self.about_to_sync(target[0], target[2]):
            # Its donors are in the last quarter of their round: a state downloaded now would reach
            # the sync after their group formed. Wait for the state they publish after the sync.
            self.wait_until_past(target[0], target[2])
            target = self.resync_target()
        if target is None:
            return False
        round_, digest, donors = target
        start = time.monotonic()
        try:
            download = self.transport.download_state(donors, digest, self.cfg.state_download_timeout_s)
        except HelperDied:
            raise
        except Exception as exc:  # whatever a hostile donor's state makes the download raise: this peer goes on
            kind = "" if isinstance(exc, (BadPayload, SyncError)) else f"{type(exc).__name__}: "
            self.reporter.emit(
                "warning",
                message=f"state download of round {round_} failed, continuing from round {s.pos.round}: {kind}{exc}",
            )
            return False
        state = download.state
        try:
            check_agrees(state, round_=round_, inner_steps=s.H)  # the round its records advertise (#51)
            with s.lock:
                check_sanity(state, s.phi)
        except BadPayload as exc:
            self.vouching.refused.add(digest)
            self.reporter.emit(
                "warning",
                message=f"refused the state of round {round_} ({digest}) from "
                f"{', '.join(donors)}, continuing from round {s.pos.round}: {exc}",
            )
            return False
        reason = "behind" if state.round > s.pos.round else "diverged" if state.round == s.pos.round else "raced ahead"
        self.adopt(state)
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

    def resync_target(self) -> tuple[int, str, list[str]] | None:
        """The outer algorithm's re-sync rule over the records that may vouch, counting only the
        peers this peer completed a sync with in an earlier round, or, without history, what the
        records' signed ``groupmates`` attest (``Vouching.screen``).

        With a sync in flight (``SyncSchedule.holds_leaders_back``), records one round ahead are
        left out, as records one round behind are, except a groupmate that averaged with this peer
        from another state in its last sync."""
        s, h = self.state, self.history
        # the read just made at the round's end, with overlap (a blocking sync came after it)
        reuse_s = 0.0 if self.schedule.synced_blocking(s.pos.round - 1) else RECORDS_REUSE_S
        others, vouchers = self.vouching.screen(self.swarm.others(max_age_s=reuse_s), round_=s.pos.round)
        if self.schedule.holds_leaders_back():
            others = [r for r in others if not (r.record.round == s.pos.round + 1 and r.peer_id not in h.disagreed)]
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
        sync's bound, polling the DHT twice a second; a stop ends the wait."""
        deadline = time.monotonic() + self.swarm.max_sync_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            still = sum(1 for r in self.swarm.others() if r.peer_id in donors and r.record.round == round_)
            if 2 * still < len(donors):
                return
            self.stop_event.wait(0.5)

    def adopt(self, state: DownloadedState) -> None:
        """Take a downloaded state: φ, the outer state and the round; θ ← φ, a fresh AdamW (a joiner
        copies φ and the outer momentum and starts a fresh inner optimizer), no error-feedback
        residuals. A sync in flight is kept or dropped by the schedule (``before_adopt``)."""
        s = self.state
        self.schedule.before_adopt(state.round)
        with s.lock:
            for dst, src in zip(s.live_tensors(), [*state.phi, *state.outer_state]):
                dst.copy_(src)
            s.pos.start_round(state.round)
        s.set_theta_to_phi()
        self.schedule.after_adopt()
        self.inner.reset_optimizer()
        self.transport.reset_error_feedback()  # residuals of a φ this peer no longer holds
        self.history.forget()
        s.take_snapshot()
