"""When is a peer live? One rule, from a progress record and the run manifest.

A progress record (protocol/records.py) carries no timestamp: a peer stores it with
``expiration = publish time + ttl``, and every peer of a run uses the same ttl,
:func:`record_ttl_s` of the manifest. So any reader that knows the manifest knows when a record
was published: ``expiration − ttl`` (:func:`published_at`). The trainer (peer/node.py builds its
SwarmView with this ttl), ``peer status`` and the swarm monitor all derive it this way.

A live peer republishes its record every H/4 inner steps and right after every round's sync
(peer/round/), so the longest silence of a live peer is about one quarter round of compute
plus one sync, which is bounded by the manifest's sync deadlines. ``peer status`` and the monitor
call a peer live while its latest record is younger than :func:`stale_after_s`::

    refresh  = max(MIN_REFRESH_S, max(1, H // 4) · batch_size_tokens / tokens_per_s)
               (UNKNOWN_REFRESH_S while the record reports no throughput yet)
    stale    = worst_case_sync_s + 2 · refresh + CLOCK_GRACE_S

``refresh`` is the peer's own refresh interval as its published throughput implies; it counts
twice to cover the evaluation and checkpoint between a round's record and the next one, and
rounds slower than the last. ``CLOCK_GRACE_S`` covers DHT propagation and modest clock skew
(hivemind's DHT times are wall clocks). A peer killed at any moment is shown dead at most
``stale`` seconds after its last record; a peer downloading the swarm's state for longer than
that is shown dead until its next record.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.manifest import RunManifest
from protocol.records import ProgressRecord
from protocol.specs import SyncSpec

SYNC_ATTEMPTS = 2
"""A round's sync runs at most this many attempts (the first and one retry; peer/sync/transport.py)."""

MIN_RECORD_TTL_S = 60.0
"""A progress record lives at least this long in the DHT."""

MIN_REFRESH_S = 5.0
"""The refresh interval a reader assumes is never shorter than this, s."""

UNKNOWN_REFRESH_S = 30.0
"""Refresh interval assumed for a record that reports no throughput yet (before the peer's first
inner steps: model build, initial evaluation), s."""

CLOCK_GRACE_S = 5.0
"""Slack for DHT propagation and clock skew between the publisher and the reader, s."""


def worst_case_sync_s(sync: SyncSpec) -> float:
    """The longest one round's sync can take, s: every attempt at the deadlines' upper bounds.

    One attempt is at most 3 × ``matchmaking_time_s`` (the matchmaking deadline) +
    ``allreduce_timeout_s`` + 5 s for the averager process to hand results over
    (peer/sync/deadlines.py ``Deadlines.total_s``); a round runs :data:`SYNC_ATTEMPTS` attempts at most.
    """
    return SYNC_ATTEMPTS * (3.0 * sync.matchmaking_time_s + sync.allreduce_timeout_s + 5.0)


def record_ttl_s(manifest: RunManifest) -> float:
    """Lifetime of a progress record in the DHT, s: three worst-case syncs, at least a minute.

    Every peer of a run stores its records with this ttl, which is what lets any reader tell when
    a record was published (:func:`published_at`); it must stay the same for all peers of a run.
    """
    return max(MIN_RECORD_TTL_S, 3.0 * worst_case_sync_s(manifest.sync))


def published_at(expiration: float, manifest: RunManifest) -> float:
    """DHT time (s since the epoch, publisher's clock) at which a record expiring at ``expiration`` was stored."""
    return expiration - record_ttl_s(manifest)


def refresh_interval_s(record: ProgressRecord, *, inner_steps: int, batch_size_tokens: int) -> float:
    """Seconds between two mid-round records of the peer that published ``record``.

    A peer republishes every ``max(1, H // 4)`` inner steps of ``batch_size_tokens`` tokens each; its
    record's ``tokens_per_s`` (inner-loop throughput) says how long those take on that peer.
    """
    if not record.tokens_per_s > 0:
        return UNKNOWN_REFRESH_S
    steps = max(1, inner_steps // 4)
    return max(MIN_REFRESH_S, steps * batch_size_tokens / record.tokens_per_s)


def stale_after_s(record: ProgressRecord, manifest: RunManifest) -> float:
    """A record older than this many seconds belongs to a peer that is gone, hung or cut off.

    Args:
        record: the peer's latest record (its throughput sets the refresh interval).
        manifest: the run's manifest (sync deadlines, H, tokens per inner step).
    """
    refresh = refresh_interval_s(
        record, inner_steps=manifest.sync.inner_steps, batch_size_tokens=manifest.inner_optimizer.batch_size_tokens
    )
    return worst_case_sync_s(manifest.sync) + 2.0 * refresh + CLOCK_GRACE_S


@dataclass(frozen=True)
class Liveness:
    live: bool
    age_s: float
    """Seconds since the record was published (0 for a record stamped by a clock ahead of ours)."""
    stale_after_s: float
    """The bound ``age_s`` was held against (:func:`stale_after_s`)."""


def judge(record: ProgressRecord, expiration: float, now: float, manifest: RunManifest) -> Liveness:
    """Whether the peer that stored ``record`` (expiring at DHT time ``expiration``) is live at DHT time ``now``:
    live iff its record was published at most :func:`stale_after_s` seconds ago."""
    age = max(0.0, now - published_at(expiration, manifest))
    bound = stale_after_s(record, manifest)
    return Liveness(live=age <= bound, age_s=age, stale_after_s=bound)
