"""Malicious peers for the in-process simulation (lab/simulation.py; issue 17, bench/byzantine.py).

An :class:`Adversary` names which simulated peers lie and how. Gradient attacks replace what a
malicious peer sends into its group's mean, and the token weight it claims for it:

* ``sign-flip``: −100 × its honest payload (an honest-looking direction, reversed and amplified);
* ``huge``: ±3e38 in every entry (finite fp32, next to the largest value), random signs;
* ``noise``: Gaussian noise scaled to its honest payload's norm, tensor by tensor (norm screening
  cannot tell it from an honest contribution);
* ``zeros``: all zeros (nothing to clip: it only dilutes the mean).

Each of them claims ``claimed_tokens`` (1e30 by default) as its weight: without the owner's token
cap, that alone makes the weighted mean equal the attacker's payload.

Owner attacks leave the contributions honest (true tokens, honest payload) and lie as an *owner*:
for every piece a malicious peer owns (tensor i of a group, owned by member ``group[i mod n]``) it
sends its groupmates a forged mean instead of the one it computed (:meth:`Adversary.forge_mean`):

* ``owner-flip``: −1 × the honest mean;
* ``owner-flip-x100``: −100 × the honest mean;
* ``owner-zeros``: all zeros;
* ``owner-noise``: Gaussian noise scaled to the honest mean's norm;
* ``owner-scale``: 2.5 × the honest mean (inside the receivers' norm bound of 3 × their own
  contribution's reference norm: it measures what gets through).

The lying owner and the other malicious peers apply the honest mean themselves (they keep an honest
model, so their next contributions stay honest-looking); the honest receivers check each forged
mean with peer/sync/screening.py's ``owner_mean_problem`` (lab/simulation.py).

``fake-progress`` leaves the payload honest and lies in the progress records instead: every round
each malicious peer, and ``fresh_identities`` more identities that never joined a group, publish a
record claiming the next round and the digest of an all-zero state (lab/simulation.py decides
with the round loop's own re-sync rule whether honest peers adopt it).

The malicious peers train like honest ones (they need an honest Δ to forge from). Under a
gradient attack or fake progress they compute their pieces' means honestly as owners; only the
owner attacks lie as owners.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peer.state.download import DownloadedState, check_sanity
from peer.state.snapshot import make_snapshot
from protocol.errors import BadPayload

logger = logging.getLogger(__name__)

GRADIENT_ATTACKS = ("sign-flip", "huge", "noise", "zeros")
OWNER_ATTACKS = ("owner-flip", "owner-flip-x100", "owner-zeros", "owner-noise", "owner-scale")
ATTACKS = (*GRADIENT_ATTACKS, *OWNER_ATTACKS, "fake-progress")
HUGE_VALUE = 3e38
"""Just under fp32's largest finite value (3.4028e38)."""
SIGN_FLIP_FACTOR = -100.0
OWNER_FLIP_X100_FACTOR = -100.0
OWNER_SCALE_FACTOR = 2.5
"""``owner-scale``: under the receivers' norm bound (OWNER_NORM_FACTOR = 3 × their scaled reference norm)."""


@dataclass(frozen=True, kw_only=True)
class Adversary:
    """Which simulated peers are malicious and what they do.

    Args:
        attack: one of :data:`ATTACKS`.
        peers: indices of the malicious simulated peers (``sim-peer-{i}``).
        claimed_tokens: the weight a gradient attacker claims for its contribution, in tokens.
        fresh_identities: ``fake-progress`` only: identities beyond ``peers`` that publish the fake
            record without ever taking part in a group (fresh keys cost an attacker nothing).
    """

    attack: str
    peers: tuple[int, ...]
    claimed_tokens: float = 1e30
    fresh_identities: int = 0

    def __post_init__(self):
        if self.attack not in ATTACKS:
            raise ValueError(f"attack = {self.attack!r}: expected one of {ATTACKS}")
        if not self.peers or len(set(self.peers)) != len(self.peers) or min(self.peers) < 0:
            raise ValueError(f"peers = {self.peers!r}: expected distinct non-negative peer indices")
        if not self.claimed_tokens > 0:
            raise ValueError(f"claimed_tokens = {self.claimed_tokens!r}: expected > 0")
        if self.fresh_identities < 0:
            raise ValueError(f"fresh_identities = {self.fresh_identities}: expected >= 0")

    @property
    def forges_payload(self) -> bool:
        return self.attack in GRADIENT_ATTACKS

    @property
    def lies_as_owner(self) -> bool:
        return self.attack in OWNER_ATTACKS

    def claimed_weight(self, peer: int, honest_tokens: float) -> float:
        """The token weight ``peer`` claims for its contribution."""
        return self.claimed_tokens if peer in self.peers and self.forges_payload else honest_tokens

    def forge(self, payload: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """What a malicious peer sends instead of ``payload`` (its honest fp32 tensors, unchanged).

        Returns:
            New fp32 tensors shaped like ``payload``; ``payload`` itself for ``fake-progress``.
        """
        if self.attack == "sign-flip":
            return [SIGN_FLIP_FACTOR * t.float() for t in payload]
        if self.attack == "huge":
            return [
                HUGE_VALUE * torch.randint(0, 2, t.shape, generator=generator).float().mul_(2).sub_(1) for t in payload
            ]
        if self.attack == "noise":
            out = []
            for t in payload:
                noise = torch.randn(t.shape, generator=generator)
                scale = float(torch.linalg.vector_norm(t.float())) / max(float(torch.linalg.vector_norm(noise)), 1e-30)
                out.append(noise * scale)
            return out
        if self.attack == "zeros":
            return [torch.zeros(t.shape, dtype=torch.float32) for t in payload]
        return list(payload)

    def forge_mean(self, mean: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The mean a malicious owner sends its groupmates for one piece instead of ``mean`` (the
        fp32 mean it computed honestly); ``mean`` itself unless :attr:`lies_as_owner`."""
        mean = mean.float()
        if self.attack == "owner-flip":
            return -mean
        if self.attack == "owner-flip-x100":
            return OWNER_FLIP_X100_FACTOR * mean
        if self.attack == "owner-zeros":
            return torch.zeros(mean.shape, dtype=torch.float32)
        if self.attack == "owner-noise":
            noise = torch.randn(mean.shape, generator=generator)
            scale = float(torch.linalg.vector_norm(mean)) / max(float(torch.linalg.vector_norm(noise)), 1e-30)
            return noise * scale
        if self.attack == "owner-scale":
            return OWNER_SCALE_FACTOR * mean
        return mean

    def fake_identities(self) -> list[str]:
        """Peer ids that publish the fake progress record: the malicious peers and the fresh ones."""
        return [f"sim-peer-{i}" for i in self.peers] + [f"sim-sybil-{k}" for k in range(self.fresh_identities)]


def _state_digest(sim, phi: Sequence[torch.Tensor], outer_state: Sequence[torch.Tensor], round_: int) -> str:
    """The digest a peer publishes for this state (peer/state/snapshot.py, as the round loop makes it)."""
    meta = {"run_id": sim.m.run_id, "round": round_, "inner_step": round_ * sim.m.sync.inner_steps}
    return make_snapshot(meta, [*phi, *outer_state]).digest.hex()


def resync_after_round(sim) -> None:
    """After a round of ``sim`` (a :class:`lab.simulation.Simulation` with a ``fake-progress``
    adversary): every honest peer reads the progress records and decides, with the outer
    algorithm's own re-sync rule (``resync_target``, peer/train/resync.py), which state to
    adopt, as the round loop's ``_resync_target`` and ``_catch_up_once`` do.

    Records: each honest peer publishes (its round, the digest of its φ and outer state); each
    of the adversary's identities publishes (the next round, the digest of an all-zero state).
    ``completed_with`` is the honest members of the peer's last group (malicious members
    gather another digest, so they do not agree). Vouchers: the peer's ``Ledger`` (None
    while empty or when no voucher is among the records). A picked state is "downloaded" and
    checked with :func:`~peer.state.download.check_sanity` against the peer's own φ; a refused
    one changes nothing. Adopting the fake state sets φ and the outer state to zeros, θ ← φ and
    a fresh AdamW, and is counted in ``sim.taken_over``; adopting another honest class copies
    that peer's state. Not simulated: the round clock (peer/state/vouching.py ``RoundClock``:
    a claim of the next round is within its slack anyway) and the records' ``groupmates``
    statements (read only by a peer without vouchers, which no honest peer here is after
    round 0). ``screening`` off: every record counts and no sanity check.
    """
    names = [f"sim-peer-{i}" for i in range(sim.peers)]
    digests = {i: _state_digest(sim, sim.phis[i], sim.outers[i].state_tensors(), sim.round_) for i in sim.honest}
    fake_round = sim.round_ + 1
    zero_phi = [torch.zeros_like(p) for p in sim.phis[0]]
    zero_state = [torch.zeros_like(t) for t in sim.outers[0].state_tensors()]
    fake = _state_digest(sim, zero_phi, zero_state, fake_round)
    records = [(names[i], sim.round_, digests[i]) for i in sim.honest]
    records += [(peer_id, fake_round, fake) for peer_id in sim.adversary.fake_identities()]
    decisions = {}
    for i in sim.honest:
        others = [r for r in records if r[0] != names[i]]
        completed = [names[j] for j in sim.completed_with[i] if j in digests]
        if sim.screening:
            vouchers = sim.ledgers[i].vouchers(sim.round_) if len(sim.ledgers[i]) else None
            if vouchers is not None and not vouchers & {r[0] for r in others}:
                vouchers = None
        else:
            vouchers = {r[0] for r in others}  # before issue 17: every record counts
        decisions[i] = sim.outers[i].resync_target(
            others, round_=sim.round_, digest=digests[i], completed_with=completed, fresh=False, vouchers=vouchers
        )
    by_digest = {d: i for i, d in digests.items()}
    for i, target in decisions.items():
        if target is None:
            continue
        round_, digest, _ = target
        if digest == fake:
            sim.counts.rule_chose_fake += 1
            source_phi, source_state = zero_phi, zero_state
        elif digest in by_digest:
            source_phi, source_state = sim.phis[by_digest[digest]], sim.outers[by_digest[digest]].state_tensors()
        else:
            continue
        if sim.screening:
            try:
                check_sanity(
                    DownloadedState(
                        round=round_,
                        inner_step=round_ * sim.m.sync.inner_steps,
                        phi=list(source_phi),
                        outer_state=list(source_state),
                    ),
                    sim.phis[i],
                )
            except BadPayload:
                sim.counts.refused_states += 1
                continue
        if digest == fake:
            sim.taken_over.setdefault(i, []).append(sim.round_)
            logger.info("round %d: honest peer %d adopted the attacker's all-zero state", sim.round_, i)
        with torch.no_grad():
            for dst, src in zip([*sim.phis[i], *sim.outers[i].state_tensors()], [*source_phi, *source_state]):
                dst.copy_(src)
            for t, p in zip(sim.models[i].parameters(), sim.phis[i]):
                t.copy_(p)
        sim.anchors[i] = [p.clone() for p in sim.phis[i]]
        sim.inners[i].reset_optimizer()  # a peer that adopts a state starts a fresh AdamW
