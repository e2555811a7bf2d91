"""The blocking sync schedule: the whole model synced at the round's end and its mean applied
before the next round starts (DiLoCo, arXiv 2311.08105, Algorithm 1, lines 8-12)."""

from __future__ import annotations

import dataclasses

from peer.progress import SyncReport
from peer.round.schedule import RoundEnd, ScheduleBase
from peer.train.outer import check_finite, pseudo_gradient
from protocol.errors import BadPayload


class BlockingSchedule(ScheduleBase):
    """Δ = φ − θ, the group's mean payload, the outer step, θ ← φ."""

    def end_round(self) -> RoundEnd:
        """Sync this round's payload with the group, apply the mean's outer step, start the next round
        from φ. A non-finite Δ discards the round (φ unchanged); a failed sync applies this peer's
        own payload (peer/round/syncing.py)."""
        s = self.state
        live, choice = self._choose()
        start_digest = s.digest
        try:
            delta = pseudo_gradient(s.phi, s.theta_on_host())
            check_finite(delta, "this peer's pseudo-gradient")
            payload = s.outer.payload(s.phi, delta)
        except BadPayload as exc:
            mean, report = None, SyncReport(note=f"{exc}: round discarded, φ unchanged")
        else:
            mean, report = self.sync.sync(payload, choice, start_digest, round_=s.pos.round,
                                          weight=float(max(s.pos.tokens, 1)),
                                          expected_wait_s=self.sync.groupmates_due_s(live, s.pos.round, choice))
            s.waited["sync"] += report.sync_s  # a blocking sync: the inner loop waited all of it
        done = dataclasses.replace(s.pos)  # the finished round's figures, before the position moves on
        with s.lock:
            if mean is not None:
                s.outer.apply(s.phi, mean)
            s.pos.start_round(s.pos.round + 1)
        s.set_theta_to_phi()
        self.history.note_group(done.round, report)
        s.take_snapshot()
        return RoundEnd(done=done, live=live, start_digest=start_digest, choice=choice, report=report)
