"""Malicious peers for the round engine (lab/engine_sim.py); issues 17, 51 and 65, bench/byzantine.py.

An :class:`Adversary` names which simulated peers lie and how. On the engine its
:meth:`Adversary.hooks` (:class:`EngineAdversary`, lab/inprocess_means.py ``GroupHooks``) act
inside the in-process hub, which deals and screens the group's pieces as the network does: what a
malicious peer contributes, the mean it sends each receiver of a piece it owns, the progress records
it publishes and the states it serves. Gradient attacks replace what a malicious peer sends into
its group's mean, and the token weight it claims for it:

* ``sign-flip``: −100 × its honest payload (an honest-looking direction, reversed and amplified);
* ``huge``: ±3e38 in every entry (finite fp32, next to the largest value), random signs;
* ``noise``: Gaussian noise scaled to its honest payload's norm, tensor by tensor (norm screening
  cannot tell it from an honest contribution);
* ``zeros``: all zeros (nothing to clip: it only dilutes the mean).

Two more are written after papers, as the strongest contribution that passes the owners' clip
(peer/sync/screening.py ``CLIP_MEDIAN_FACTOR``: 1.5 × the piece's median norm; over 3 × a strike,
the groupmate ignored after 3): the colluders pool their own honest payloads of the same sync (the
engine's hook waits up to :data:`COLLUDE_WAIT_S` for each other's; :meth:`Adversary.forge` alone sees
one payload, the 1-colluder case), and each sends the same forged vector:

* ``alie`` ("A Little Is Enough", arXiv 1902.06156): μ − z·σ per coordinate, μ and σ the mean and
  the standard deviation (population) over the colluders' payloads. With one colluder there is no
  spread to measure, so σ is its own payload's magnitude |μ| per coordinate (the honest peers' Δ
  differ per coordinate by about their own size: their cosines are well under 1). z is the larger of
  the paper's z_max = Φ⁻¹((n − s) / n), s = ⌊n/2 + 1⌋ − m (n = :data:`ALIE_GROUP` = 8: 0 for m = 1,
  0.32 for m = 2; chosen against coordinate-wise median and trimmed mean) and the z that puts the
  vector's norm at :data:`COLLUDE_NORM_FACTOR` × the colluders' mean own norm, tensor by tensor: the
  code's screening judges norms, not coordinates, so the paper's z leaves most of the room unused;
* ``ipm`` (Inner Product Manipulation, arXiv 1903.03936): −ε × the mean of the colluders' own honest
  payloads, ε = :data:`IPM_EPSILON` (0.5: the paper's scale, far under the clip; subclip-flip's
  contribution is the same vector at ε = 1.45 with one colluder).

Against a DiLoCo group each colluder then sends its own copy, the shared vector's deviation from the
colluders' mean turned to a random direction at cosine √0.4 with it (:func:`decorrelated`): the
owners weigh down contributions whose deviations point the same way (peer/sync/robust.py
``similarity_weighted``, κ = 1/3), and one vector sent twice would be left out.

NoLoCo: both forge the Δ part only (φ honest: NoLoCo's owners leave out a φ under cosine 0.2 or off
by 2× in norm).

* ``stale-phi``: a Δ of zeros and, NoLoCo, the φ it sent in its first sync (the run's initial φ,
  where every peer starts) in every sync after: a volunteer that stopped training, or replays an old
  state, and keeps exchanging. Such a φ passes NoLoCo's φ checks (a trained φ's cosine with the
  initial one stays near 1 and its norm within 2×), and a partner that averages it goes halfway
  back towards the start. DiLoCo: ``zeros``.

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
  contribution's reference norm: it measures what gets through);
* ``owner-huge-small``: means of 1e30 for the pieces under 256 values it owns (RMSNorm gains),
  the others honest (issue #51: from round 4 every honest φ held 1e30, then NaN);
* ``owner-small-flip``: −20 × the honest mean for the pieces under 256 values it owns, the others
  honest: the same mean to every receiver, inside their 30× norm bound for single small pieces and
  against the honest direction, which no check of one small piece sees (issue #65: delayed DiLoCo
  +14.4 %, 0 refused);
* ``owner-equivocate``: each receiver gets the honest mean with one value (a different one per
  receiver) moved by 1e-5: every mean passes the receivers' checks but no two honest peers hold
  the same φ afterwards.

Attacks that act on both sides:

* ``subclip-flip``: contributes −1.45 × its honest payload (under the owners' 1.5× median clip)
  and, as an owner, sends −2.5 × the honest mean (inside the receivers' 3× bound);
* ``subclip-sideways``: the strongest contribution the owners' direction screen lets through
  (peer/sync/robust.py ``direction_screened``: a contribution at negative cosine with the group's
  median is left out): 1.45 × its honest payload's norm, at cosine :data:`SIDEWAYS_COSINE` with it,
  tensor by tensor; as an owner, ``subclip-flip``'s means;
* ``cosine``: contributes, tensor by tensor, a vector of its honest one's norm at cosine 0.3 with
  it, and as an owner sends means at cosine 0.72 with the honest ones (just above NoLoCo's
  ``PHI_MIN_COSINE`` 0.2 and ``PHI_MEAN_MIN_RATIO`` 0.7); NoLoCo: its φ tensors only (issue #51's
  attack), DiLoCo: its Δ;
* ``tie-break``: ``owner-equivocate``'s means, which split the honest peers into classes of one,
  and records of its current round naming a state it serves: −φ of its own state, ground (one
  value of the outer state or φ nudged) until its digest has :data:`GRIND_BITS` leading zero
  bits, so the re-sync rule's tie-break (equal count, smaller digest) prefers it; every malicious
  identity publishes the same one.

The lying owner and the other malicious peers apply the honest mean themselves (they keep an honest
model, so their next contributions stay honest-looking); the honest receivers check each forged
mean with peer/sync/screening.py's ``owner_mean_problem`` (lab/inprocess_means.py).

``fake-progress`` leaves the payload honest and lies in the progress records instead: every round
each malicious peer, and ``fresh_identities`` more identities that never joined a group, publish a
record claiming the next round and the digest of an all-zero state, which they serve (the
honest round loops decide with their own re-sync rule and checks whether to adopt it).

The malicious peers train like honest ones (they need an honest Δ to forge from). Under a
gradient attack or fake progress they compute their pieces' means honestly as owners; only the
owner attacks lie as owners.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.state.snapshot import make_snapshot
from peer.sync.robust import SIMILARITY_MIN_ELEMENTS
from protocol.records import ProgressRecord
from protocol.wire.pieces import Piece

logger = logging.getLogger(__name__)

COLLUDING = ("alie", "ipm")
"""Gradient attacks whose malicious peers pool their honest payloads before forging."""
GRADIENT_ATTACKS = ("sign-flip", "huge", "noise", "zeros", *COLLUDING, "stale-phi")
OWNER_ATTACKS = (
    "owner-flip",
    "owner-flip-x100",
    "owner-zeros",
    "owner-noise",
    "owner-scale",
    "owner-huge-small",
    "owner-small-flip",
    "owner-equivocate",
)
BOTH_SIDES = ("subclip-flip", "subclip-sideways", "cosine")
"""Attacks that forge both the contribution and, as an owner, the means."""
RECORD_ATTACKS = ("fake-progress", "tie-break")
ATTACKS = (*GRADIENT_ATTACKS, *OWNER_ATTACKS, *BOTH_SIDES, *RECORD_ATTACKS)
SUBCLIP_FACTOR = -1.45
"""``subclip-flip``'s contribution: under the owners' clip (1.5 × the median norm; a longer one is cut
to it, so none pulls harder)."""
SUBCLIP_MEAN_FACTOR = -2.5
"""``subclip-flip`` and ``subclip-sideways`` as owners: the means they send, inside the receivers'
norm bound (peer/sync/screening.py ``OWNER_NORM_FACTOR``, 3 × their own contribution)."""
SIDEWAYS_COSINE = 0.1
"""``subclip-sideways``: its contribution's cosine with its honest one; the group's median is at about
0.75 with an honest contribution, so the forged one meets it at about 0.07, over the owners'
direction screen (peer/sync/robust.py ``DIRECTION_MIN_COSINE``, 0)."""
CONTRIBUTION_COSINE = 0.3
"""``cosine``: a contribution's cosine with the honest one (NoLoCo's owners leave out φ under 0.2)."""
MEAN_COSINE = 0.72
"""``cosine``: a forged mean's cosine with the honest mean (receivers refuse φ means under 0.7)."""
EQUIVOCATION_STEP = 1e-5
"""``owner-equivocate``: how far the one value a receiver's mean differs in moves."""
HUGE_MEAN = 1e30
OWNER_SMALL_FLIP_FACTOR = -20.0
"""``owner-small-flip``: an honest mean is at most about its receivers' own Δ in norm, so 20× it stays
inside the receivers' 30× bound for a piece under 256 values."""
SMALL_PIECE = 256
"""``owner-huge-small``: pieces under this many values (peer/sync/screening.py ``OWNER_CHECK_MIN_ELEMENTS``)."""
GRIND_BITS = 8
"""``tie-break``: leading zero bits of the forged state's digest (issue #51 used 12; 8 beats an honest
digest with probability 255/256 at 1/16 of the grinding)."""
ALIE_GROUP = 8
"""``alie``: the n of the paper's z_max (bench/byzantine.py's 8 peers, one group)."""
COLLUDE_NORM_FACTOR = 1.45
"""``alie``: the forged tensor's norm, as a multiple of the colluders' mean own norm of it: just under
the owners' clip at 1.5 × the median norm (an honest median is about a colluder's own norm; a
longer vector is cut to the clip, so none pulls harder)."""
COLLUDE_COSINE = 0.4
"""DiLoCo: the cosine between two colluders' deviations from their own mean (:func:`decorrelated`).
The owners measure deviations from the median of every contribution, which the honest ones' spread
moves off the colluders' mean: 0.3 here met there at 0.25, 0.4 at 0.35, about κ = 1/3, where the share
two colluders pull in common is largest."""
IPM_EPSILON = 0.5
"""``ipm``: the ε of −ε × the colluders' mean."""
COLLUDE_WAIT_S = 10.0
"""Engine: how long a colluder waits for the others' payloads of the same sync before forging from
those it has."""
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
        return self.attack in GRADIENT_ATTACKS or self.attack in BOTH_SIDES

    @property
    def lies_as_owner(self) -> bool:
        return self.attack in OWNER_ATTACKS or self.attack in BOTH_SIDES or self.attack == "tie-break"

    def hooks(self, *, run_id: str, inner_steps: int, noloco: bool) -> EngineAdversary:
        """This adversary's hooks for an in-process hub of the round engine (lab/engine_sim.py)."""
        return EngineAdversary(self, run_id=run_id, inner_steps=inner_steps, noloco=noloco)

    def forge(self, payload: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """What a malicious peer sends instead of ``payload`` (its honest fp32 tensors, unchanged).

        Returns:
            New fp32 tensors shaped like ``payload``; ``payload`` itself for ``fake-progress``.

        Raises:
            ValueError: ``stale-phi``, an attack of the engine's hook only (it needs each peer's first φ).
        """
        if self.attack == "stale-phi":
            raise ValueError(
                "stale-phi runs on the round engine only (lab/engine_sim.py): it needs each peer's first φ"
            )
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
        if self.attack == "subclip-flip":
            return [SUBCLIP_FACTOR * t.float() for t in payload]
        if self.attack == "subclip-sideways":
            return [abs(SUBCLIP_FACTOR) * at_cosine(t.float(), SIDEWAYS_COSINE, generator) for t in payload]
        if self.attack == "cosine":
            return [at_cosine(t.float(), CONTRIBUTION_COSINE, generator) for t in payload]
        if self.attack in COLLUDING:
            return self.collude([payload], malicious=len(self.peers))
        return list(payload)

    def collude(self, payloads: Sequence[Sequence[torch.Tensor]], *, malicious: int) -> list[torch.Tensor]:
        """``alie`` or ``ipm``'s vector from the colluders' honest ``payloads`` (one list of tensors
        each, alike in shapes), for ``malicious`` colluders in a group of :data:`ALIE_GROUP`."""
        if self.attack == "alie":
            return alie(payloads, z_min=alie_z(ALIE_GROUP, malicious))
        return ipm(payloads)

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
        if self.attack == "owner-huge-small":
            return torch.full(mean.shape, HUGE_MEAN) if mean.numel() < SMALL_PIECE else mean
        if self.attack == "owner-small-flip":
            return OWNER_SMALL_FLIP_FACTOR * mean if mean.numel() < SMALL_PIECE else mean
        if self.attack in ("subclip-flip", "subclip-sideways"):
            return SUBCLIP_MEAN_FACTOR * mean
        if self.attack == "cosine":
            return at_cosine(mean, MEAN_COSINE, generator)
        return mean

    def fake_identities(self) -> list[str]:
        """Peer ids that publish the fake progress record: the malicious peers and the fresh ones."""
        return [f"sim-peer-{i}" for i in self.peers] + [f"sim-sybil-{k}" for k in range(self.fresh_identities)]


def at_cosine(x: torch.Tensor, cosine: float, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``x``'s shape and L2 norm whose cosine with ``x`` is ``cosine`` (a random direction
    orthogonal to ``x`` mixed in; fp32); ``x`` itself when it is zero or has one value."""
    flat = x.flatten().double()
    size = float(flat.norm())
    if not size > 0 or flat.numel() < 2:
        return x.clone()
    unit = flat / size
    r = torch.randn(flat.shape, generator=generator, dtype=torch.float64)
    r -= torch.dot(r, unit) * unit
    r *= size / max(float(r.norm()), 1e-300)
    return (cosine * flat + math.sqrt(1 - cosine**2) * r).to(torch.float32).reshape(x.shape)


def decorrelated(
    forged: Sequence[torch.Tensor], payloads: Sequence[Sequence[torch.Tensor]], generator: torch.Generator
) -> list[torch.Tensor]:
    """One colluder's copy of the shared ``forged`` vector against a DiLoCo group's owners, tensor by
    tensor: its deviation ``d`` from the colluders' mean μ of ``payloads`` is replaced by one of the
    same length at cosine ``√COLLUDE_COSINE`` with ``d`` (a random direction of its own mixed in), so
    two colluders' deviations meet at cosine :data:`COLLUDE_COSINE`, just under the owners'
    similarity weighting (peer/sync/robust.py ``SIMILARITY_COSINE``), where the share they pull in
    common is largest. Pieces the weighting does not judge keep the shared vector. fp32."""
    out = []
    for f, tensors in zip(forged, zip(*payloads, strict=True), strict=True):
        if f.numel() < SIMILARITY_MIN_ELEMENTS:
            out.append(f)
            continue
        mu = torch.stack([t.float() for t in tensors]).mean(0)
        out.append(mu + at_cosine(f.float() - mu, math.sqrt(COLLUDE_COSINE), generator))
    return out


def alie_z(n: int, m: int) -> float:
    """The paper's z_max (arXiv 1902.06156, section 3): s = ⌊n/2 + 1⌋ − m honest peers the colluders
    need "on their side", z = Φ⁻¹((n − s) / n); s is held at ≥ 1 (more colluders than that need no
    subtlety)."""
    s = max(1, n // 2 + 1 - m)
    return statistics.NormalDist().inv_cdf((n - s) / n)


def z_for_norm(mu: torch.Tensor, sigma: torch.Tensor, target: float) -> float:
    """The z ≥ 0 at which ‖μ − z·σ‖ = ``target`` (0 where ‖μ‖ is already at least that or σ = 0)."""
    mu64, sigma64 = mu.double().flatten(), sigma.double().flatten()
    a = float(sigma64 @ sigma64)
    b = float(mu64 @ sigma64)
    c = float(mu64 @ mu64) - target**2
    if not a > 0 or c >= 0:
        return 0.0
    return (b + math.sqrt(b * b - a * c)) / a


def alie(
    payloads: Sequence[Sequence[torch.Tensor]], *, z_min: float, norm_factor: float = COLLUDE_NORM_FACTOR
) -> list[torch.Tensor]:
    """ALIE's μ − z·σ, tensor by tensor (see the module docstring): μ, σ the mean and population
    standard deviation over ``payloads`` (σ = |μ| for one), z = max(``z_min``, the z at which the
    norm is ``norm_factor`` × the payloads' mean norm of that tensor). fp32, the payloads' shapes."""
    out = []
    for tensors in zip(*payloads, strict=True):
        x = torch.stack([t.float() for t in tensors])
        mu = x.mean(0)
        sigma = x.std(0, correction=0) if len(tensors) > 1 else mu.abs()
        target = norm_factor * statistics.fmean(float(torch.linalg.vector_norm(t.double())) for t in x)
        z = max(z_min, z_for_norm(mu, sigma, target))
        out.append((mu - z * sigma).float())
    return out


def ipm(payloads: Sequence[Sequence[torch.Tensor]], *, epsilon: float = IPM_EPSILON) -> list[torch.Tensor]:
    """IPM's −ε × the mean over ``payloads``, tensor by tensor (fp32, the payloads' shapes)."""
    return [-epsilon * torch.stack([t.float() for t in tensors]).mean(0) for tensors in zip(*payloads, strict=True)]


def _seeded(*parts: object) -> torch.Generator:
    """A generator seeded from ``parts`` (stable across processes and thread orders)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


class EngineAdversary:
    """An :class:`Adversary` acting inside an in-process hub (lab/inprocess_means.py
    ``GroupHooks``; lab/engine_sim.py passes it to the hub). Thread-safe: contributions come from
    every peer's sync thread, records from every round loop.

    Random draws (noise, directions) are seeded by the peer, its count of syncs and the piece, so a
    run does not depend on the order its threads come in.

    Args:
        adversary: who lies and how.
        run_id: the run's id (the forged states' meta).
        inner_steps: the run's H (a forged state's inner step is round × H).
        noloco: the payload is Δ then φ (``cosine`` forges the φ part only).
    """

    def __init__(self, adversary: Adversary, *, run_id: str, inner_steps: int, noloco: bool = False):
        self.adversary, self.run_id, self.H, self.noloco = adversary, run_id, inner_steps, noloco
        self.malicious = {f"sim-peer-{i}" for i in adversary.peers}
        self.identities = set(adversary.fake_identities())
        self.forged_digests: set[str] = set()
        """Digests of every state the adversary published (``fake-progress``, ``tie-break``)."""
        self.forged_means = 0
        """Means forged so far (owner attacks), for the bench's detail."""
        self._lock = threading.Lock()
        self._pooled = threading.Condition(self._lock)
        self._pool: dict[int, dict[str, list[torch.Tensor]]] = {}  # sync count -> colluder -> honest payload
        self._syncs: dict[str, int] = {}
        self._states: dict[int, Any] = {}  # round -> the forged snapshot published for it
        self._first_phi: dict[str, list[torch.Tensor]] = {}  # stale-phi: the φ of each one's first sync

    # ---- the group -----------------------------------------------------------------------
    def contribution(
        self, peer_id: str, payload: list[torch.Tensor], weight: float, phi_from: int | None
    ) -> tuple[list[torch.Tensor], float]:
        a = self.adversary
        if peer_id not in self.malicious or not a.forges_payload:
            return payload, weight
        with self._lock:
            count = self._syncs[peer_id] = self._syncs.get(peer_id, 0) + 1
        generator = _seeded(peer_id, count)
        if a.attack == "stale-phi":
            cut = len(payload) if phi_from is None else phi_from
            with self._lock:
                first = self._first_phi.setdefault(peer_id, [t.detach().clone() for t in payload[cut:]])
            return [torch.zeros_like(t) for t in payload[:cut]] + [t.clone() for t in first], a.claimed_tokens
        if a.attack in COLLUDING:
            cut = len(payload) if phi_from is None else phi_from  # NoLoCo: its Δ only
            return self._collude(peer_id, count, payload[:cut]) + payload[cut:], a.claimed_tokens
        if a.attack == "cosine" and phi_from is not None:  # NoLoCo: only its φ is sent off
            forged = payload[:phi_from] + a.forge(payload[phi_from:], generator)
        else:
            forged = a.forge(payload, generator)
        return forged, a.claimed_tokens

    def _collude(self, peer_id: str, count: int, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        """The colluders' forged vector for their ``count``-th sync: waits (up to
        :data:`COLLUDE_WAIT_S`) for every colluder's honest payload of that sync, then forges from
        those of ``payload``'s shapes that came."""
        deadline = time.monotonic() + COLLUDE_WAIT_S
        with self._pooled:
            pool = self._pool.setdefault(count, {})
            pool[peer_id] = payload
            self._pooled.notify_all()
            while len(pool) < len(self.malicious) and time.monotonic() < deadline:
                self._pooled.wait(max(0.0, deadline - time.monotonic()))
            shapes = [t.shape for t in payload]
            mine = [p for _, p in sorted(pool.items()) if [t.shape for t in p] == shapes]
            for old in [k for k in self._pool if k < count - 2]:
                del self._pool[old]
        forged = self.adversary.collude(mine, malicious=len(self.malicious))
        if self.noloco or len(mine) < 2:
            return forged
        return decorrelated(forged, mine, _seeded(peer_id, count, "decorrelate"))

    def owner_mean(self, owner: str, receiver: str, piece: Piece, mean: torch.Tensor, phi: bool) -> torch.Tensor:
        a = self.adversary
        if owner not in self.malicious or receiver in self.malicious or not a.lies_as_owner:
            return mean  # the other malicious peers keep an honest model: their next forgeries look honest
        if a.attack == "cosine" and self.noloco and not phi:
            return mean
        with self._lock:
            self.forged_means += 1
            count = self.forged_means
        if a.attack in ("owner-equivocate", "tie-break"):
            forged = mean.clone()
            flat = forged.view(-1)
            flat[zlib.crc32(receiver.encode()) % flat.numel()] += EQUIVOCATION_STEP
            return forged
        return a.forge_mean(mean, _seeded(owner, receiver, piece.index, count))

    # ---- records and served states ----------------------------------------------------------
    def records(self, peer_id: str, record: ProgressRecord, hub: Any) -> list[tuple[str, ProgressRecord]]:
        a = self.adversary
        if peer_id not in self.malicious or a.attack not in RECORD_ATTACKS:
            return [(peer_id, record)]
        with hub.lock:
            provider = hub.providers.get(peer_id)
        own = list(provider()) if provider is not None else []
        if not own:
            return [(peer_id, record)]
        if a.attack == "fake-progress":
            round_ = record.round + 1
            snapshot = self._forged(round_, own[-1], zeros=True)
            inner_step = round_ * self.H
            names = sorted(self.identities)
        else:  # tie-break: a state of its current round, published under its own ids only
            latest = own[-1]
            if latest.meta.get("round") != record.round:
                return [(peer_id, record)]
            round_, inner_step = record.round, record.inner_step
            snapshot = self._forged(round_, latest, zeros=False)
            names = sorted(self.malicious)
        fake = dataclasses.replace(record, round=round_, inner_step=inner_step, state_digest=snapshot.digest.hex())
        return [(name, fake) for name in names]

    def served(self, peer_id: str, snapshots: list[Any]) -> list[Any]:
        if peer_id not in self.identities and peer_id not in self.malicious:
            return snapshots
        with self._lock:
            forged = list(self._states.values())[-4:]
        return [*snapshots, *forged]

    def _forged(self, round_: int, own: Any, *, zeros: bool) -> Any:
        """The state published for ``round_`` (made once; every identity publishes the same):
        all zeros, or −φ of ``own`` (a snapshot) ground to :data:`GRIND_BITS` leading zero bits."""
        with self._lock:
            made = self._states.get(round_)
            if made is not None:
                return made
            meta = {"run_id": self.run_id, "round": round_, "inner_step": round_ * self.H}
            tensors = [t.detach().float().clone() for t in own.tensors]
            if zeros:
                snapshot = make_snapshot(meta, [torch.zeros_like(t) for t in tensors], owned=True)
            else:
                half = len(tensors) // 2
                tensors[:half] = [-t for t in tensors[:half]]
                nudged = next(t for t in reversed(tensors) if t.numel())
                base = float(nudged.view(-1)[0])
                for k in range(64 << GRIND_BITS):
                    nudged.view(-1)[0] = base + k * 1e-7
                    snapshot = make_snapshot(meta, tensors)
                    if int.from_bytes(snapshot.digest, "big") >> (8 * len(snapshot.digest) - GRIND_BITS) == 0:
                        break
            self._states[round_] = snapshot
            self.forged_digests.add(snapshot.digest.hex())
            return snapshot
