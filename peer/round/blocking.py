"""The blocking sync schedule (``sync.overlap = "none"``): the whole model synced at the round's end
and its mean applied before the next round starts (DiLoCo, arXiv 2311.08105, Algorithm 1, lines
8-12: Δ = φ − θ, the group's mean, the outer step, θ ← φ).

It is the fragment schedule (peer/round/streamed.py) with one fragment and no delay: the sync runs
on the training thread when its mean is needed, at once; a failed sync applies this peer's own
payload (DiLoCo paper Fig. 8); a non-finite Δ discards the round (φ unchanged, θ ← φ).
"""

from __future__ import annotations

from peer.round.streamed import FragmentSchedule


class BlockingSchedule(FragmentSchedule):
    """Streaming with one fragment (every parameter, under the run's own sync key) and no delay."""

    whole_model = True
