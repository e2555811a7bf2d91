"""What the swarm monitor keeps per run and per peer between polls (bootstrap/monitor.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from peer.net.traffic import describe_caps
from protocol.records import ProgressRecord


@dataclass
class PeerHistory:
    peer_id: str
    first_seen: float
    last_seen: float
    """Wall time (s since the epoch) of the last poll that found this peer's record."""
    last_change: float
    record: ProgressRecord
    live: bool = True
    """Whether the peer's latest record is fresh (protocol/liveness.py), or, before the run's
    manifest was read, still in the DHT."""
    published_at: float | None = None
    """When the peer stored its latest record, s since the epoch (None until the manifest was read)."""
    stale_after_s: float | None = None
    """How old that record may grow before the peer counts as gone."""
    group_by_round: dict[int, int] = field(default_factory=dict)
    """Round → largest group size this peer reported for the sync that brought it to that round
    (only rounds whose post-sync record the monitor saw: a poll can miss a short round)."""
    first_round: int | None = None
    """The round of the first record the monitor saw of this peer (rounds before it it could not see)."""
    evals: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Round → (wall time first seen, validation loss of φ at that round)."""
    samples: deque = field(default_factory=deque)
    last_sync: dict[str, int] | None = None
    """Round, group size and bytes of the latest sync the monitor saw a record of."""
    device: str | None = None
    """What the peer trains on, as its signed device record says (peer/net/devices.py), or None."""

    def update(self, record: ProgressRecord, now: float, max_samples: int, inner_steps: int | None) -> None:
        changed = record != self.record or not self.samples
        self.last_seen, self.live, self.record = now, True, record
        if self.first_round is None:
            self.first_round = record.round
        # A record written right after a sync (inner_step at a round boundary) carries that sync's
        # group size; mid-round records may carry a placeholder 1, so they count only when larger.
        at_boundary = inner_steps is None or record.inner_step == record.round * inner_steps
        if record.round > 0 and (at_boundary or record.group_size > 1):
            self.group_by_round[record.round] = max(self.group_by_round.get(record.round, 0), record.group_size)
            if self.last_sync is None or record.round >= self.last_sync["round"]:
                self.last_sync = {
                    "round": record.round,
                    "group_size": record.group_size,
                    "bytes_sent": record.bytes_sent,
                    "bytes_received": record.bytes_received,
                }
        if record.eval_loss is not None and record.round not in self.evals:
            self.evals[record.round] = (now, float(record.eval_loss))
        if changed:
            self.last_change = now
            self.samples.append(
                {
                    "t": now,
                    "round": record.round,
                    "inner_step": record.inner_step,
                    "train_loss": record.train_loss,
                    "tokens_per_s": record.tokens_per_s,
                    "group_size": record.group_size,
                    "bytes_sent": record.bytes_sent,
                    "bytes_received": record.bytes_received,
                }
            )
            while len(self.samples) > max_samples:
                self.samples.popleft()

    @property
    def rounds_unseen(self) -> int:
        """Rounds since the first one the monitor saw this peer at whose group size it does not
        know: it polls every second or so and reads each peer's latest record only, so the rounds a
        peer finished between two polls, or skipped by adopting the swarm's state, are not in
        ``group_by_round``. Shown beside the counts so they are not read as the peer's whole history."""
        if self.first_round is None:
            return 0
        seen = sum(1 for r in self.group_by_round if r > self.first_round)
        return max(0, self.record.round - self.first_round - seen)

    def to_json(self, *, with_samples: bool) -> dict[str, Any]:
        r = self.record
        out = {
            "peer_id": self.peer_id,
            "live": self.live,
            "device": self.device,
            "caps": describe_caps(r.caps) or None,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "last_change": self.last_change,
            "published_at": self.published_at,
            "stale_after_s": self.stale_after_s,
            "round": r.round,
            "inner_step": r.inner_step,
            "train_loss": r.train_loss,
            "tokens_per_s": r.tokens_per_s,
            "group_size": r.group_size,
            "bytes_sent": r.bytes_sent,
            "bytes_received": r.bytes_received,
            "eval_loss": self.evals[max(self.evals)][1] if self.evals else None,
            "eval_round": max(self.evals) if self.evals else None,
            "last_sync": dict(self.last_sync) if self.last_sync else None,
            "rounds_by_group_size": _count_by_size(self.group_by_round),
            "first_round": self.first_round,
            "rounds_unseen": self.rounds_unseen,
            "group_by_round": {str(k): v for k, v in sorted(self.group_by_round.items())},
            "eval_history": [{"round": k, "t": t, "loss": loss} for k, (t, loss) in sorted(self.evals.items())],
        }
        if with_samples:
            out["history"] = list(self.samples)
        return out


def _count_by_size(group_by_round: dict[int, int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for size in group_by_round.values():
        counts[str(size)] = counts.get(str(size), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


@dataclass
class RunHistory:
    run_id: str
    name: str
    inner_steps: int | None = None
    """H from the run's manifest (None until it was fetched)."""
    peers: dict[str, PeerHistory] = field(default_factory=dict)
