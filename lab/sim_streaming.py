"""Streaming DiLoCo in the simulation (arXiv 2501.18512; peer/train/streaming.py, as the round loop
runs it): the model's fragments sync one at a time at staggered inner steps, each mean landing
``sync.fragment_delay_steps`` steps after its sync started.

:class:`StreamingRounds` is a mixin of :class:`lab.simulation.Simulation` (``sync.overlap =
"streaming"``): it keeps the fragments, their outer states and the means in flight
(:meth:`StreamingRounds._setup_streaming`), and computes each fragment's group mean with the owners'
screening and codecs of :class:`lab.sim_mean.GroupMeans`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lab.sim_mean import GroupMeans
from lab.sim_results import butterfly_bytes, sync_groups
from peer.train.inner import InnerLoop
from peer.train.outer import make_outer
from peer.train.overlap import round_progress
from peer.train.streaming import land, landing_at, partition, payload_indices, syncing_at


class StreamingRounds(GroupMeans):
    """Streaming DiLoCo's rounds and fragment syncs of a :class:`lab.simulation.Simulation`."""

    inners: list[InnerLoop]
    models: list[torch.nn.Module]
    phis: list[list[torch.Tensor]]
    shapes: list[torch.Size]
    groups_run_id: str
    inner_step: int
    tokens: int
    bytes_sent: list[float]
    _theta: Callable[..., list[torch.Tensor]]

    def _setup_streaming(self, names: Sequence[str]) -> None:
        """Streaming DiLoCo's state: the fragments (:func:`~peer.train.streaming.partition` of the
        parameter ``names``), per peer one outer algorithm per fragment (its own slice of the outer
        state), the means in flight and the tokens each peer trained since each fragment's last sync.

        Raises:
            ValueError: an adversary (the fragment syncs run the honest screened mean only, so
                far); or more fragments than blocks.
        """
        if self.adversary is not None:
            raise ValueError(
                "sync.overlap = 'streaming' with an adversary: the simulation streams honest peers only so far"
            )
        self.fragments = partition(names, self.m.sync.fragments)
        self.fragment_outers = [
            [make_outer(self.m, [self.shapes[k] for k in index]) for index in self.fragments] for _ in range(self.peers)
        ]
        self.in_flight: dict[int, list[list[torch.Tensor]]] = {}
        """Fragment → each peer's group mean of its sync in flight (applied at its landing step)."""
        self.at_sync: dict[int, list[list[torch.Tensor]]] = {}
        """Fragment → each peer's θ_p when its sync in flight started (``fragment_merge = "shift"`` only)."""
        self.fragment_tokens = [[0] * self.peers for _ in self.fragments]
        self.last_sync = [0] * len(self.fragments)
        """Per fragment, the inner step (cumulative steps done) at which its last sync started."""

    def _streaming_round(self) -> None:
        """H inner steps per peer, one step at a time, with Streaming DiLoCo's fragment syncs between
        them (arXiv 2501.18512; peer/train/streaming.py): once ``s`` steps are done, the fragments of
        :func:`~peer.train.streaming.syncing_at` start their sync (:meth:`_fragment_sync`) and those
        of :func:`~peer.train.streaming.landing_at` (started τ steps earlier) land
        (:meth:`_fragment_land`); with τ = 0 a sync lands at once. Peers step in turn; each owns its
        model, AdamW state and data, so the order changes nothing."""
        sync = self.m.sync
        H, P, tau = sync.inner_steps, sync.fragments, sync.fragment_delay_steps
        for k in range(H):
            for i, inner in enumerate(self.inners):
                tokens = inner.step(self.inner_step + k).tokens
                self.tokens += tokens
                for counts in self.fragment_tokens:
                    counts[i] += tokens
            done = self.inner_step + k + 1
            for p in syncing_at(done, inner_steps=H, fragments=P):
                self._fragment_sync(p, done)
            for p in landing_at(done, inner_steps=H, fragments=P, delay_steps=tau):
                self._fragment_land(p)
        self.inner_step += H
        self.round_ += 1

    def _fragment_sync(self, p: int, step: int) -> None:
        """Start fragment p's sync on every peer: Δ_p = φ_p − θ_p, each group's token-weighted mean
        as the owners screen it and the receivers check it (:meth:`_group_mean`, :meth:`_receive`,
        as in :meth:`_outer_step`; a failed group applies each member's own Δ_p), held in
        ``in_flight`` until it lands. Bytes: a butterfly all-reduce of the fragment alone."""
        index = self.fragments[p]
        payloads = []
        for i, (outer, phi) in enumerate(zip(self.fragment_outers, self.phis)):
            phi_p = [phi[k] for k in index]
            payloads.append(outer[p].payload(phi_p, round_progress(phi_p, self._theta(i, index))))
        claimed = [float(max(1, t)) for t in self.fragment_tokens[p]]
        self.fragment_tokens[p] = [0] * self.peers
        means: list[list[torch.Tensor]] = [[] for _ in range(self.peers)]
        tensors = payload_indices(index, phi_from=self.outers[0].phi_from(len(self.shapes)))
        for group in sync_groups(self.m, self.peers, self.round_, run_id=self.groups_run_id):
            received: list[list[torch.Tensor]] | None
            if len(group) == 1:
                received, sent = [payloads[group[0]]], 0.0
            else:
                weights = [claimed[j] for j in group]
                contributions = [payloads[j] for j in group]
                if self.compressed:  # the fragment's tensors with their codecs, seeds and residuals
                    final, sent = self._compressed_mean(group, contributions, weights, tensors=tensors)
                    received = (
                        None
                        if final is None
                        else self._receive(group, self._honest_final, final, self._decoded, weights, contributions)
                    )
                else:
                    mean = self._group_mean(group, contributions, weights)
                    received = (
                        None
                        if mean is None
                        else self._receive(group, mean, list(mean), contributions, weights, contributions)
                    )
                    sent = butterfly_bytes(sum(t.numel() for t in payloads[group[0]]), len(group))
            for member, j in enumerate(group):
                means[j] = payloads[j] if received is None else received[member]
                self.bytes_sent[j] += sent
        self.in_flight[p] = means
        self.last_sync[p] = step
        if self.m.sync.fragment_merge == "shift":
            self.at_sync[p] = [[t.clone() for t in self._theta(i, index)] for i in range(self.peers)]

    def _fragment_land(self, p: int) -> None:
        """Fragment p's means arrive: φ_p ← OuterOpt_p(φ_p, mean) on every peer (its fragment's
        outer state only), then θ_p by ``sync.fragment_merge`` (:func:`~peer.train.streaming.land`):
        θ_p ← α·θ_p + (1 − α)·φ_p, or with 'shift' θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync)."""
        index = self.fragments[p]
        at_sync = self.at_sync.pop(p, None) or [None] * self.peers
        for outer, phi, model, mean, start in zip(
            self.fragment_outers, self.phis, self.models, self.in_flight.pop(p), at_sync, strict=True
        ):
            phi_p = [phi[k] for k in index]
            outer[p].apply(phi_p, mean)  # in place on the peer's own φ tensors
            theta = list(model.parameters())
            land(
                [theta[k] for k in index],
                phi_p,
                alpha=self.m.sync.fragment_alpha,
                rule=self.m.sync.fragment_merge,
                at_sync=start,
            )

    def _finish_streaming(self) -> None:
        """The end of a streaming run: the syncs in flight land, then every fragment with inner steps
        since its last sync (all but fragment 0 at a round's end) syncs once more and lands at once,
        so the final φ holds every step, as φ does without overlap; then θ ← φ."""
        for p in sorted(self.in_flight):
            self._fragment_land(p)
        for p, last in enumerate(self.last_sync):
            if last < self.inner_step:
                self._fragment_sync(p, self.inner_step)
                self._fragment_land(p)
        with torch.no_grad():
            for model, phi in zip(self.models, self.phis):
                for t, p in zip(model.parameters(), phi):
                    t.copy_(p)
