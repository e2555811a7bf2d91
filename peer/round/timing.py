"""When a round's sync runs and where its mean lands, as a value: ``sync.overlap`` read once.

A :class:`Timing` is what the round engine (peer/round/engine.py) builds its schedule from; a peer
takes :meth:`Timing.of` its run's ``[sync]``, and the lab (lab/engine_sim.py) passes
``Timing.of(sync, pinned=True)`` so that where a mean lands follows the lockstep of a simulation, not
the threads' timing: the update rules are the same, only when they run is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.manifest import SyncSpec
from protocol.specs import OVERLAP_MODES, delta_is_round_progress


@dataclass(frozen=True)
class Timing:
    overlap: str = "none"
    """``sync.overlap``: 'none' (blocking), 'delayed', 'eager' or 'streaming' (docs/algorithms.md)."""
    extra_steps_fraction: float = 1.0
    """With 'delayed', 'eager' or 'streaming', a round past its H inner steps whose sync in flight has
    not landed yet takes more inner steps instead of waiting, up to this fraction of H: a peer faster
    than its groupmates otherwise idles at every landing until the slowest one's contribution is
    there. 1.0: at most 2·H steps a round; 0: it waits at H."""
    land_at_delay: bool = False
    """Streaming: a fragment's mean lands exactly τ = ``sync.fragment_delay_steps`` inner steps after
    its sync started, the landing waiting for the sync there; False: at the first step ≥ τ at which
    the sync is done (a slow sync costs staleness, not compute)."""

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap = {self.overlap!r}: expected one of {', '.join(OVERLAP_MODES)}")
        if not 0.0 <= self.extra_steps_fraction <= 1.0:
            raise ValueError(f"extra_steps_fraction = {self.extra_steps_fraction!r}: expected a number in [0, 1]")

    @property
    def whole_delta(self) -> bool:
        """Whether a sync's Δ is one round's training alone (protocol/specs.py
        ``delta_is_round_progress``: every overlap but streaming, whose landings merge φ into θ
        inside a round): what the receipts' alignments and a NoLoCo pair's whole-Δ check need."""
        return delta_is_round_progress(self.overlap)

    @property
    def carries_skipped(self) -> bool:
        """Whether a Δ piece the receipts skipped (applied as zeros) is carried into the next
        contribution (peer/sync/error_feedback.py). Not in a blocking or delayed sync: its landing
        keeps θ's own progress on those rows (``SyncReport.kept_rows``; blocking: θ ← φ elsewhere,
        peer/train/streaming.py ``land``; delayed: θ ← ψ elsewhere, peer/train/overlap.py
        ``keep_skipped_progress``), so the next Δ holds it; an eager or streaming landing keeps θ's
        progress everywhere, and the group's φ gets that piece's Δ only from the carry."""
        return self.overlap not in ("none", "delayed")

    @classmethod
    def of(cls, sync: SyncSpec, *, pinned: bool = False) -> Timing:
        """The timing of a run's ``[sync]``; ``pinned``: no extra steps past H and streaming's
        landings at exactly τ (a lockstep: where a mean lands depends on no thread's timing)."""
        return cls(overlap=sync.overlap, extra_steps_fraction=0.0 if pinned else 1.0, land_at_delay=pinned)
