"""The group mean of a simulated round as the networked all-reduce computes it (lab/simulation.py).

Tensor i of a group's payload stands for a piece owned by member ``group[i mod n]`` (whole tensors
stand in for the all-reduce's row pieces). Its owner screens the contributions as
peer/sync/screening.py does (repeat offenders ignored, non-finite contributions excluded, claimed
weights capped at the run's tokens per round, norms clipped to the median rule) and averages them in
fp32 (:meth:`GroupMeans._group_mean`); with a lossy ``[compression]`` codec each contribution and
the mean go through the network's codec code first (:mod:`protocol.codecs`,
:mod:`peer.sync.adaptive`, error feedback from :mod:`peer.sync.error_feedback`;
:meth:`GroupMeans._compressed_mean`). A malicious owner (lab/adversary.py) forges the mean it sends
(:meth:`GroupMeans._owners_send`), and every honest receiver checks each mean against its own
contribution with ``owner_mean_problem`` (:meth:`GroupMeans._receive`).

:class:`GroupMeans` is a mixin of :class:`lab.simulation.Simulation`: it keeps the screening state
(:meth:`GroupMeans._setup_screening`) and the codecs and residuals
(:meth:`GroupMeans._setup_codecs`), and reads the run's manifest ``m``, ``peers``, ``round_``,
``uplink_mbps`` and the outer objects ``outers`` that the Simulation sets.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lab.adversary import Adversary
from lab.sim_results import ScreeningCounts
from peer.sync.adaptive import plan
from peer.sync.error_feedback import RESIDUAL_DTYPES, ErrorFeedback
from peer.sync.pairs import is_pair, keeps_own, partner_problem, receiver_problem
from peer.sync.screening import Strikes, cap_weight, clip_to_median, reference_rms, round_token_cap
from peer.train.outer import OuterAlgorithm
from protocol.codecs import Codec, make_codec
from protocol.groups import codec_seed
from protocol.manifest import RunManifest

logger = logging.getLogger("lab.simulation")  # the simulation's one logger, as before the split


class GroupMeans:
    """The owners' screened (and with a codec, compressed) group means of a :class:`lab.simulation.Simulation`."""

    m: RunManifest
    peers: int
    round_: int
    uplink_mbps: float
    outers: list[OuterAlgorithm]

    def _setup_screening(
        self, manifest: RunManifest, *, peers: int, seed: int, screening: bool, adversary: Adversary | None
    ) -> None:
        """The owners' and receivers' state: the defenses' switch and token cap, each peer's strikes,
        the counts, the honest peers and the adversary's forging generator (seeded from ``seed``)."""
        self.screening, self.adversary = screening, adversary
        self.max_weight = round_token_cap(manifest) if screening else None
        self.strikes = [Strikes() for _ in range(peers)]
        """Per peer, as an owner: the groupmates it ignores (peer/sync/averager.py keeps one per peer)."""
        self.counts = ScreeningCounts()
        self.honest = [i for i in range(peers) if adversary is None or i not in adversary.peers]
        self._forge_rng = torch.Generator().manual_seed(1_000_003 * seed + 17)
        self._excluded_any = False
        self._included: list[list[int]] = []
        """Per tensor of the last :meth:`_group_mean`: the members whose contributions its owner included."""
        self._decoded: list[list[torch.Tensor]] = []
        self._honest_final: list[torch.Tensor] = []
        """With a codec, of the last :meth:`_compressed_mean`: the decoded contributions and honest means."""

    def _setup_codecs(self, shapes: Sequence[torch.Size]) -> None:
        """Per payload tensor its codec (None: adaptive, planned each round), per peer its residuals."""
        spec = self.m.compression
        phi_in_payload = self.outers[0].phi_from(len(shapes)) is not None  # NoLoCo: Δ then φ
        self.compressed = spec.codec != "none" or (phi_in_payload and spec.phi_codec != "none")
        self.shapes = list(shapes)
        self.codecs: list[Codec | None] = [None if spec.codec == "adaptive" else make_codec(spec, s) for s in shapes]
        if phi_in_payload:
            self.codecs += [make_codec(spec, s, role="phi") for s in shapes]
        lossy = spec.codec != "none"  # 'adaptive' included: its plan may pick lossy codecs
        dtype = RESIDUAL_DTYPES[spec.residual_dtype]
        self.feedback = (
            [ErrorFeedback(shapes, dtype) for _ in range(self.peers)] if lossy and spec.error_feedback else None
        )

    def _contributions(
        self,
        payloads: list[list[torch.Tensor]],
        round_tokens: Sequence[int],
    ) -> tuple[list[list[torch.Tensor]], list[float]]:
        """What each peer sends into its group's mean and the token weight it claims: the honest
        payload and tokens, or the adversary's forgery and claim for a malicious peer."""
        claimed = [float(max(1, t)) for t in round_tokens]
        if self.adversary is None or not self.adversary.forges_payload:
            return payloads, claimed
        sent = list(payloads)
        for j in self.adversary.peers:
            sent[j] = self.adversary.forge(payloads[j], self._forge_rng)
            claimed[j] = self.adversary.claimed_weight(j, claimed[j])
        return sent, claimed

    def _group_mean(
        self, group: Sequence[int], contributions: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]
    ) -> list[torch.Tensor] | None:
        """The group mean as the owners of its pieces compute it in the networked all-reduce.

        Tensor i stands for a piece owned by member ``group[i mod n]`` (as in
        :meth:`_compressed_mean`). Its owner, as peer/sync/allreduce.py does: leaves out the members
        its :class:`~peer.sync.screening.Strikes` ignore this round (never itself) and, for the rest
        of the round, every member whose contribution is not finite or (NoLoCo, with ``screening``)
        whose φ fails peer/sync/pairs.py ``partner_problem``, and in a NoLoCo pair, for this tensor
        only, a partner's Δ that fails it; caps each claimed weight at
        the run's tokens per round (:func:`~peer.sync.screening.round_token_cap`); clips the norms
        to the median rule (:func:`~peer.sync.screening.clip_to_median`); sums in fp32 in member
        order, each weighted by its share of the included weight (``GroupAllreduce._mean_of``).
        After the round every owner counts a strike against each member it clipped or dropped
        (peer/sync/averager.py ``_strike``). With ``screening`` off only the non-finite rule
        applies.

        Returns:
            One fp32 tensor per contribution tensor, or None when a mean is not finite (the
            all-reduce fails for the whole group; each member falls back to its own payload).
        """
        n, members = len(group), set(group)
        self._excluded_any = False
        excluded: dict[int, set[int]] = {owner: set() for owner in group}
        offenders: dict[int, set[int]] = {owner: set() for owner in group}
        if self.screening:
            for owner in group:
                ignored = (self.strikes[owner].ignored(self.round_) & members) - {owner}
                excluded[owner] |= ignored
                for s in ignored:
                    self.counts.ignored[s] = self.counts.ignored.get(s, 0) + 1
        mean: list[torch.Tensor] = []
        failed = False
        self._included = []
        phi_from = self.outers[0].phi_from(len(contributions[0]) // 2)
        split = len(contributions[0]) if phi_from is None else phi_from
        partners = self.screening and phi_from is not None  # NoLoCo: owners judge their partners (pairs.py)
        rms = {  # per member, its own payload's RMS per value, Δ (True) and φ (False) apart
            j: {True: reference_rms(c[:split]), False: reference_rms(c[split:])}
            for j, c in zip(group, contributions)
            if partners
        }
        for i in range(len(contributions[0])):
            owner = group[i % n]
            parts, senders = [], []
            delta = phi_from is None or i < phi_from
            for j, contribution, weight in zip(group, contributions, weights):
                if j in excluded[owner]:
                    continue
                x = contribution[i].detach().float()
                if not torch.isfinite(x).all():
                    excluded[owner].add(j)
                    if j != owner:  # a sender's BadPayload is a strike; the owner's own is not
                        offenders[owner].add(j)
                        self.counts.dropped[j] = self.counts.dropped.get(j, 0) + 1
                    continue
                own = contributions[group.index(owner)][i].detach().float() if partners and j != owner else None
                if own is not None and bool(torch.isfinite(own).all()):
                    # NoLoCo (peer/sync/pairs.py): a φ far off is left out for the round, a pair's Δ for this piece
                    scale = cap_weight(weights[group.index(owner)], self.max_weight) / cap_weight(
                        weight, self.max_weight
                    )
                    found = partner_problem(
                        x, own, phi=not delta, pair=is_pair(phi_from, n), scale=scale, reference_rms=rms[owner][delta]
                    )
                    if found is not None:
                        if not delta:
                            excluded[owner].add(j)
                        if found[1]:
                            offenders[owner].add(j)
                            self.counts.dropped[j] = self.counts.dropped.get(j, 0) + 1
                        continue
                parts.append((cap_weight(weight, self.max_weight), x))
                senders.append(j)
            if self.screening and parts:
                parts, clipped = clip_to_median(parts)
                for position in clipped:
                    offenders[owner].add(senders[position])
                    self.counts.clipped[senders[position]] = self.counts.clipped.get(senders[position], 0) + 1
            total = sum(w for w, _ in parts)
            acc = torch.zeros(contributions[0][i].shape, dtype=torch.float32)
            for w, x in parts:
                acc.add_(x, alpha=w / total)
            failed = failed or not parts or not bool(torch.isfinite(acc).all())
            mean.append(acc)
            self._included.append(senders)
        if self.screening:
            for owner in group:
                self.strikes[owner].record(self.round_, sorted(offenders[owner]))
        self._excluded_any = any(excluded.values())
        if failed:
            self.counts.failed_groups += 1
            return None
        return mean

    def _owners_send(self, group: Sequence[int], mean: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The mean of each piece as its owner sends it: the computed ``mean`` from an honest owner,
        the adversary's forgery (:meth:`~lab.adversary.Adversary.forge_mean`) from a malicious one
        under an owner attack. None (the all-reduce fails, counted in ``failed_groups``) when a sent
        mean is not finite, as a receiver's decode check fails the round in peer/sync/allreduce.py."""
        adversary, n = self.adversary, len(group)
        if adversary is None or not adversary.lies_as_owner or not set(group) & set(adversary.peers):
            return list(mean)
        out = [
            adversary.forge_mean(t, self._forge_rng) if group[i % n] in adversary.peers else t
            for i, t in enumerate(mean)
        ]
        if not all(bool(torch.isfinite(t).all()) for t in out):
            self.counts.failed_groups += 1
            return None
        return out

    def _receive(
        self,
        group: Sequence[int],
        honest: Sequence[torch.Tensor],
        sent: Sequence[torch.Tensor],
        contributions: Sequence[Sequence[torch.Tensor]],
        weights: Sequence[float],
        own: Sequence[Sequence[torch.Tensor]],
    ) -> list[list[torch.Tensor]]:
        """What each member applies: per member (group order) one tensor per piece (the whole
        payload's or a streaming fragment's).

        Every honest member j checks the mean ``sent[i]`` of each piece it does not own against its
        own contribution ``contributions[j][i]`` (as the owner decoded it) with
        peer/sync/pairs.py ``receiver_problem`` (its claimed weight, the count of
        contributions the owner included and whether its own was among them, the run's cap; φ
        pieces of NoLoCo get the norm and direction checks instead of the share check; in a NoLoCo
        pair the owner's contribution the mean implies is checked too, and a refused piece is
        applied as the member's own), as peer/sync/allreduce.py does. A refused Δ mean is a vote: an owner refused by more than half of the
        group has its Δ pieces applied as zeros by every member (the receipts' verdict,
        peer/sync/receipts.py), any other's means as sent; a refused φ mean is applied as the
        member's own payload ``own[j][i]``; each refusal is counted against the owner, and one by a check that
        counts a strike (``MeanRefusal.strike``) is recorded in the member's :class:`Strikes`, as
        the networked averager does, so repeated ones make it ignore that peer's contributions.
        Refusals are per receiver: under a gradient attack strong enough that an honest owner's
        mean fails some receivers' share check, the honest φ differ after the round (the re-sync
        rule then reunites them, as in the swarm). Only with ``screening``:
        off, every finite mean is applied. Malicious members apply the ``honest`` means (they know
        what their owners computed).
        """
        n = len(group)
        # k parameters' payload: k Δ tensors, then (NoLoCo) k φ tensors; phi_from(k) is k or None
        phi_from = self.outers[0].phi_from(len(sent) // 2)
        out = []
        refusers: dict[int, set[int]] = {}  # per owner: the members that refused one of its Δ means
        for member, j in enumerate(group):
            if j not in self.honest:
                out.append(list(honest))
                continue
            if not self.screening:
                out.append(list(sent))
                continue
            mine, caught = [], set()
            split = len(sent) if phi_from is None else phi_from
            # the floor of the norm bound: this member's own payload's RMS per value, Δ and φ apart
            rms = {
                True: reference_rms(c.detach().float() for c in contributions[member][:split]),
                False: reference_rms(c.detach().float() for c in contributions[member][split:]),
            }
            for i, m in enumerate(sent):
                owner = group[i % n]
                holds_delta = phi_from is None or i < phi_from
                reason = (
                    None
                    if owner == j
                    else receiver_problem(
                        m,
                        contributions[member][i].detach().float(),
                        weight=weights[member],
                        included=len(self._included[i]),
                        max_weight=self.max_weight,
                        phi=not holds_delta,
                        included_self=j in self._included[i],
                        reference_rms=rms[holds_delta],
                        pair=is_pair(phi_from, n),
                    )
                )
                if reason is None:
                    mine.append(m)
                    continue
                self.counts.refused[owner] = self.counts.refused.get(owner, 0) + 1
                if reason.strike:  # as peer/sync/averager.py's _strike: toward ignoring the owner's contributions
                    for ignored in self.strikes[j].record(self.round_, [owner]):
                        logger.debug("round %d: peer %d ignores peer %d (refused means)", self.round_, j, ignored)
                logger.debug(
                    "round %d: peer %d refused the mean of tensor %d from owner %d: %s",
                    self.round_,
                    j,
                    i,
                    owner,
                    reason,
                )
                if not keeps_own(not holds_delta, is_pair(phi_from, n)):  # a vote: the majority decides below
                    refusers.setdefault(owner, set()).add(j)
                    mine.append(m)
                else:
                    mine.append(own[member][i].detach().float().clone())
                    caught.add(owner)  # a pair's owner refused on one piece is trusted on none
            if is_pair(phi_from, n):  # an owner refused on one piece is trusted on none (receipts.py _judge_receipts)
                mine = [
                    own[member][i].detach().float().clone() if group[i % n] in caught else t for i, t in enumerate(mine)
                ]
            out.append(mine)
        # the receipts' verdict: an owner whose Δ means most of the group's reports refuse (its own an
        # acceptance) has its Δ pieces applied as zeros by every member
        for i in range(len(sent) if phi_from is None else phi_from):
            owner = group[i % n]
            if 2 * len(refusers.get(owner, ())) > n:
                for member, j in enumerate(group):
                    if j in self.honest:  # malicious members apply the honest means, as above
                        out[member][i] = torch.zeros(sent[i].shape, dtype=torch.float32)
        return out

    def _compressed_mean(
        self,
        group: Sequence[int],
        payloads: Sequence[Sequence[torch.Tensor]],
        weights: Sequence[float],
        *,
        tensors: Sequence[int] | None = None,
    ) -> tuple[list[torch.Tensor] | None, float]:
        """The group mean as the network's all-reduce computes it with a codec, and the bytes sent.

        Tensor i is owned by member ``i mod n`` (whole tensors stand in for the all-reduce's row
        pieces). Every other member sends decode(encode(Δ + e)) and stages e ← (Δ + e) − that.
        The owner's own contribution stays local: exact (its residual spent) for elementwise
        codecs, through the codec for topk and lowrank, whose mean is exact under
        ``for_mean(n)`` only when every contribution is a decoded encoding
        (:attr:`~protocol.codecs.Codec.structured`). The owner screens and averages the decoded
        contributions in fp32 (:meth:`_group_mean`) and sends the mean (forged by a lying owner:
        :meth:`_owners_send`) with ``codec.for_mean(n)``; every member, the owner included, gets that
        identical decoded tensor, to check against its own decoded contribution (:meth:`_receive`,
        which the caller runs with ``_decoded``, the decoded contributions, and ``_honest_final``,
        the decoded honest means).

        ``tensors``: the whole payload's indices of the tensors ``payloads`` hold (a streaming
        fragment's: its Δ tensors, then NoLoCo's φ tensors), whose codecs, codec seeds and
        residuals they use; None: the whole payload.

        Returns:
            The decoded means as the owners sent them (None: a mean was not finite, the all-reduce
            failed and every member's residuals roll back), and the bytes one member sends on
            average: per tensor, the
            encoded contributions of the n − 1 non-owners plus n − 1 copies of the encoded mean, over n.
        """
        n, n_params = len(group), len(self.shapes)
        index = list(range(len(payloads[0]))) if tensors is None else list(tensors)
        deltas = sum(1 for g in index if g < n_params)  # the payload's Δ tensors come first
        seeds = [codec_seed(self.round_, g) for g in index]
        decoded, codecs, total = [], [], 0
        for member, (j, payload) in enumerate(zip(group, payloads)):
            ef = self.feedback[j] if self.feedback is not None else None
            inputs = [
                ef.compensate(g, t) if ef is not None and i < deltas else t
                for i, (g, t) in enumerate(zip(index, payload))
            ]
            mine = [self.codecs[g] for g in index]
            if self.m.compression.codec == "adaptive":
                mine[:deltas] = plan(
                    inputs[:deltas], self.m.compression, group_size=n, uplink_bytes_per_s=self.uplink_mbps * 1e6 / 8
                )
            out = []
            for i, (x, codec) in enumerate(zip(inputs, mine)):
                own = i % n == member  # the owner's own rows never cross the network
                if own and not codec.structured:
                    y = x
                else:
                    data, y = codec.roundtrip(x, seed=seeds[i])
                    total += 0 if own else len(data)
                if ef is not None and i < deltas:
                    ef.stage(index[i], x, y)
                out.append(y)
            decoded.append(out)
            codecs.append(mine)
        mean = self._group_mean(group, decoded, weights)
        forged = None if mean is None else self._owners_send(group, mean)
        if forged is None:
            for j in group:
                if self.feedback is not None:
                    self.feedback[j].rollback()
            return None, total / n
        final, honest = [], []
        for i, (t, f) in enumerate(zip(mean, forged)):
            codec = codecs[i % n][i].for_mean(n)
            data, value = codec.roundtrip(f, seed=seeds[i])
            final.append(value)
            honest.append(value if f is t else codec.roundtrip(t, seed=seeds[i])[1])
            total += (n - 1) * len(data)
        for j in group:
            if self.feedback is not None:
                self.feedback[j].commit()
        self._decoded, self._honest_final = decoded, honest
        return final, total / n
