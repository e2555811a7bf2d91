"""Screening inside a pair: NoLoCo's groups of two (arXiv 2506.10911; issue #51, item 4).

NoLoCo averages with a small random group, usually two peers. A pair has no majority: CenteredClip
(peer/sync/robust.py) needs four contributions, the median-norm clip of two bounds a contribution
by the smaller one only, and a receiver's check of a mean against its own contribution
(peer/sync/screening.py ``owner_mean_problem``) is loose, since its own contribution is half of
that mean. But a pair's receiver knows all but one term of its owner's mean: its own contribution
``x`` and weight, so it can take the owner's contribution out of the mean it receives,
:func:`partner_contribution`::

    c = (W·m − w_x·x) / w_c        (W = w_x + w_c)

and judge ``c`` as an owner judges a partner's contribution (:func:`partner_problem`):

* φ pieces (NoLoCo averages φ itself): ``phi_contribution_problem``, also on pieces under
  ``OWNER_CHECK_MIN_ELEMENTS`` values where this peer's own φ is of typical size (RMSNorm gains:
  an owner that flips or zeroes them broke every model it paired with);
* Δ pieces where this peer's own Δ is of typical size (``DIRECTION_MIN_SIZE``, as the receivers'
  direction check): norm within :data:`PAIR_DELTA_NORM_FACTOR` of its own, both ways
  (:func:`ratio_problem`);
* the owner's whole Δ, once every mean is in (:class:`PairTally`, blocking syncs only: an
  overlapped sync's Δ holds what the last landing's merge left): cosine with this peer's whole Δ
  above :data:`PAIR_WHOLE_MIN_COSINE` and norm within :data:`PAIR_WHOLE_NORM_FACTOR`, with the
  partner's claimed weight from its HELLO. One piece's Δ of two honest replicas is a noisy
  direction; their whole Δ is not.

An honest owner of a pair judges its partner's contribution before it averages (sign-flipped,
zeroed, shrunk, noise), one piece at a time: norm as above and cosine above
:data:`PAIR_DELTA_MIN_COSINE` (a piece it leaves out splits nothing: both peers apply its mean). A
refused piece in a pair (:func:`keeps_own`) is applied as this peer's own values, Δ and φ: for that
piece the round is a step alone, as NoLoCo takes when no partner is found; not a vote, since a
pair's receipts hold one other report, the owner's (and a partner's REFUSED report skips nothing).
An owner refused on one piece is trusted on none that round (peer/sync/receipts.py
``_judge_receipts``): pieces under ``OWNER_CHECK_MIN_ELEMENTS`` values get no Δ check, and an owner
of only Δ pieces that flipped them would otherwise still flip the RMSNorm gains' Δ (tiny preset: one
honest loss above φ_0's). Honest replicas of one run differ (NoLoCo keeps no common φ) but share
their start and keep averaging: their φ stay close and their Δ of the same steps point the same way,
so honest pairs pass (tests/security/test_pair_screening.py; bench/byzantine.py).

Judging one piece as it arrives, the receiver may not have the partner's claimed weight yet (its
HELLO as a sender to this peer's pieces): it assumes the cap (``max_weight``, what a partner that
trained a full round claims). A partner that trained less makes that ``c`` a convex mix of its true
contribution and ``x``, closer to ``x`` in norm and direction: an honest mean is never refused for
the assumption. The whole Δ is judged with the claimed weight (:class:`PairTally` keeps the sums
that make ``c`` exact for any weight). A lying owner can make
any ``c`` that passes appear, so what it can still send is ``m = s·x + (1 − s)·c`` with ``c``
within the checks: at least this peer's own share of its Δ, moved by a partner of its size
pointing its way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.sync.screening import (
    DIRECTION_MIN_SIZE,
    OWNER_CHECK_MIN_ELEMENTS,
    MeanRefusal,
    _cosine,
    norm,
    owner_mean_problem,
    phi_contribution_problem,
)

logger = logging.getLogger(__name__)

PAIR_DELTA_MIN_COSINE = -0.8
"""An owner leaves its pair partner's Δ out of a piece when its cosine with the owner's own Δ there
is not above this, where that own Δ is of typical size: a Δ pointing nearly opposite. Only that:
one piece's Δ of two honest replicas is a noisy direction (a receiver judges the whole Δ instead,
:class:`PairTally`, since its refusal, unlike an owner's, splits the pair's φ). In bench/compare.toml's NoLoCo runs on the round engine (8 peers, H = 10) honest
partners' cosines were 0.10 to 0.99, but between two real peers streaming fragments of a 2-block
model (tests/integration/test_overlap_swarm.py, H = 20) they were -0.52 to 1.0 (69 pieces), so a
threshold of 0 refused honest partners and split their φ. A flipped Δ of an honest partner is caught
here only where the honest cosine was above 0.8; the φ checks and the receivers' check of the mean
itself (``owner_mean_problem``) do the rest (bench/byzantine.py)."""
PAIR_DELTA_NORM_FACTOR = 10.0
"""A pair's Δ contribution whose norm is over this multiple, or under its inverse, of this peer's
own, raw and by tokens both (:func:`ratio_problem`), is refused: a zeroed or nearly zeroed Δ (which
would halve this peer's step) or one an order of magnitude too large. Honest partners' per-piece
norms were 0.31 to 3.2 times each other's in the streaming run above (so the owners' 3x median clip
is no bound for a pair); the mean itself stays within the receivers' 3x bound."""
RECONSTRUCTION_SLACK = 1.05
"""How much further than :data:`PAIR_DELTA_NORM_FACTOR` a receiver's reconstructed Δ may lie: the
mean's fp32 sum and a lossy mean codec add their error twice to ``2m − x``."""

PAIR_WHOLE_MIN_COSINE = 0.2
"""A pair's Δ is refused whole when its cosine with this peer's own whole Δ is not above this: by
a receiver, every Δ piece of its owner (the owner's contribution its means imply, :class:`PairTally`);
by an owner, its partner's contribution to every Δ piece (:func:`whole_partner_problem`). Between
two real peers in blocking NoLoCo (tests/integration/test_noloco_swarm.py) the honest whole-Δ
cosines were 0.56 to 0.93, on the round engine 0.85 to 0.95; a sign flip under the clip
(bench/byzantine.py ``subclip-flip``) gave -0.93 to -0.44 and noise (``noise``) about 0. Both sides
use one threshold: an owner that left this peer's Δ out sends its own Δ alone as the mean, which
the receiver must then judge as strictly (with a lower receiver threshold, a noise attacker that
left its partner out got its noise applied whole). A receiver's refusal splits the pair's φ (each
steps alone, as NoLoCo does without a partner); an owner's does not."""
PAIR_WHOLE_NORM_FACTOR = 2.0
"""... and when that whole contribution's norm is over this multiple of this peer's own there, or
under its inverse (:func:`ratio_problem`). Honest ratios: 0.65 to 1.12 between real blocking
peers, 0.98 to 1.04 on the engine; ``subclip-flip``'s owner implied about 2.8."""

PAIR_DIRECTION_MIN_SHARE = 0.125
"""A pair's Δ direction is judged only where each peer's weight is at least this share of the
other's: a peer that trained (almost) nothing since its last sync holds no direction of its own
(its Δ is then what a merge left of the last mean), and its contribution weighs little."""


def judges_direction(scale: float) -> bool:
    """Whether a pair's Δ direction is judged at the weights' ratio ``scale``
    (:data:`PAIR_DIRECTION_MIN_SHARE`)."""
    return PAIR_DIRECTION_MIN_SHARE <= scale <= 1 / PAIR_DIRECTION_MIN_SHARE


@dataclass
class PairTally:
    """A pair receiver's running sums (fp64) over one owner's Δ pieces: the owner's means ``m``
    against this peer's own contributions ``x``, from which :meth:`problem` takes the owner's whole
    contribution ``c = (W·m − w_x·x) / w_c`` (:func:`partner_contribution`) once every mean is in and
    the partner's claimed weight is known (peer/sync/receipts.py ``_judge_receipts``): one piece's Δ
    of two honest replicas is a noisy direction, their whole Δ is not."""

    mm: float = 0.0
    mx: float = 0.0
    xx: float = 0.0
    direct: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``(‖m‖², ⟨m, x⟩, ‖x‖²)`` over pieces whose mean is the owner's contribution itself (it
    averaged one contribution: :func:`partner_contribution` returns ``m``); the fields above cover
    the others."""
    pieces: int = 0
    partner_weight: float | None = None
    """The owner's claimed tokens (capped), from its HELLO as a sender to this peer; None: unseen."""

    def add(self, mean: torch.Tensor, own: torch.Tensor, *, implied: bool) -> None:
        """Fold one piece in: ``mean`` and ``own`` fp32 of one shape; ``implied``: the mean holds
        this peer's contribution (the owner included it and averaged two)."""
        m, x = mean.double(), own.double()
        sums = (float((m * m).sum()), float((m * x).sum()), float((x * x).sum()))
        held = (self.mm, self.mx, self.xx) if implied else self.direct
        total = (held[0] + sums[0], held[1] + sums[1], held[2] + sums[2])
        if implied:
            self.mm, self.mx, self.xx = total
        else:
            self.direct = total
        self.pieces += 1

    def measure(self, weight: float, partner_weight: float) -> tuple[float, float] | None:
        """``(cosine, norm ratio)`` of the owner's whole contribution against this peer's own Δ, both
        weights capped claims in tokens (> 0); ``(0, 0)`` for a zero contribution. None when nothing
        was folded in or this peer's own Δ is zero."""
        if not (weight > 0 and partner_weight > 0):
            return None
        a, b = (weight + partner_weight) / partner_weight, weight / partner_weight
        cc = a * a * self.mm - 2 * a * b * self.mx + b * b * self.xx + self.direct[0]
        cx = a * self.mx - b * self.xx + self.direct[1]
        xx = self.xx + self.direct[2]
        if not (xx > 0 and math.isfinite(cc * xx)):
            return None
        if not cc > 0:  # no Δ at all (cancellation may leave a tiny negative)
            return 0.0, 0.0
        return cx / math.sqrt(cc * xx), math.sqrt(cc / xx)

    def problem(self, weight: float, partner_weight: float) -> tuple[str, bool] | None:
        """Why the owner's whole Δ is refused (cosine not above :data:`PAIR_WHOLE_MIN_COSINE`, norm
        off by over :data:`PAIR_WHOLE_NORM_FACTOR`), or None; (one-line reason, whether it counts a
        strike: over the norm bound)."""
        if (found := self.measure(weight, partner_weight)) is None:
            return None
        cosine, ratio = found
        scale = weight / partner_weight
        if (problem := ratio_problem(ratio, scale, PAIR_WHOLE_NORM_FACTOR, "its whole Δ's")) is not None:
            return problem
        if judges_direction(scale) and not cosine > PAIR_WHOLE_MIN_COSINE:
            return f"its whole Δ's cosine with this peer's is {cosine:.3g}, not above {PAIR_WHOLE_MIN_COSINE:g}", False
        return None


def whole_partner_problem(
    theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor], *, weight: float, partner_weight: float
) -> tuple[str, bool] | None:
    """Why the owner of a pair's Δ pieces leaves its partner's contribution out of every one of them,
    or None: the partner's whole Δ (``theirs``, fp32, one tensor per piece, as decoded) against the
    owner's own (``ours``, same shapes), judged as :class:`PairTally` judges a receiver's; weights
    are capped claims in tokens. A blocking sync's owner judges this before it reduces any piece
    (peer/sync/allreduce.py ``_reduce_my_pieces``); nothing splits, both peers apply its means."""
    tally = PairTally()
    for c, x in zip(theirs, ours):
        tally.add(c, x, implied=False)
    return tally.problem(weight, partner_weight)


def is_pair(phi_from: int | None, group_size: int) -> bool:
    """Whether a group is a NoLoCo pair (``phi_from`` set, two members): the checks of this module
    apply, and a refused piece is applied as this peer's own values (:func:`keeps_own`)."""
    return phi_from is not None and group_size == 2


def keeps_own(phi: bool, pair: bool) -> bool:
    """Whether a refused mean is replaced by this receiver's own values at once, not voted on in the
    receipts (peer/sync/receipts.py): φ pieces (NoLoCo's replicas differ) and every piece of a pair,
    whose vote of two would skip the owner's pieces as zeros for both (a lost round for the honest
    peer too)."""
    return phi or pair


def partner_contribution(
    mean: torch.Tensor,
    own: torch.Tensor,
    *,
    weight: float,
    included: int,
    included_self: bool,
    max_weight: float | None,
) -> torch.Tensor:
    """The owner's contribution to a pair's ``mean`` of one piece, as this receiver can take it out.

    Args:
        mean, own: the owner's decoded mean and this receiver's contribution (as the owner decoded
            it), fp32, one shape.
        weight: this receiver's claimed tokens; capped at ``max_weight`` as the owner caps it.
        included, included_self: what the owner's MEAN frame says it averaged.
        max_weight: the run's cap, assumed to be the partner's weight; None: the same as this
            receiver's.

    Returns:
        fp32 ``(W·m − w_x·x) / w_c``, or ``mean`` itself when the owner says it averaged one
        contribution (its own, or this receiver's, which an honest ``mean`` then equals).
    """
    if not included_self or included < 2:
        return mean
    w_x = weight if max_weight is None else min(weight, max_weight)
    w_c = w_x if max_weight is None else max_weight
    if not (w_x > 0 and w_c > 0):
        return mean
    return ((mean.double() * (w_x + w_c) - own.double() * w_x) / w_c).float()


def delta_partner_problem(
    contribution: torch.Tensor,
    own: torch.Tensor,
    *,
    scale: float = 1.0,
    reference_rms: float | None = None,
    slack: float = 1.0,
    direction: bool = True,
) -> tuple[str, bool] | None:
    """Why a pair's Δ ``contribution`` is refused against this peer's own Δ ``own``, or None.

    Judged only on pieces of at least ``OWNER_CHECK_MIN_ELEMENTS`` values where ``own`` is of at
    least ``DIRECTION_MIN_SIZE`` of its typical size (``reference_rms`` per value; None: always).

    Args:
        contribution, own: fp32, one shape.
        scale: the contribution's reference norm over its norm divided by the own's (the weights'
            ratio ``w_own / w_contribution`` for :func:`partner_contribution` s or claimed weights).
        slack: the norm factor's allowance (:data:`RECONSTRUCTION_SLACK` for a reconstructed one).
        direction: whether the piece's cosine is judged too (an owner's check; a receiver judges
            the direction of the owner's whole Δ instead, :class:`PairTally`).

    Returns:
        None, or (one-line reason, whether it counts a strike: a contribution over the norm bound,
        which the median clip would have struck).
    """
    if own.numel() < OWNER_CHECK_MIN_ELEMENTS:
        return None
    x_norm = norm(own)
    if not (x_norm > 0 and math.isfinite(x_norm)):
        return None
    if reference_rms is not None and x_norm < DIRECTION_MIN_SIZE * reference_rms * math.sqrt(own.numel()):
        return None  # its own Δ near zero here: the partner's decides the direction
    found = ratio_problem(norm(contribution) / x_norm, scale, PAIR_DELTA_NORM_FACTOR * slack, "its Δ's")
    if found is not None or not direction or not judges_direction(scale):
        return found
    if not (cosine := _cosine(contribution, own)) > PAIR_DELTA_MIN_COSINE:
        return f"its Δ's cosine with this peer's is {cosine:.3g}, not above {PAIR_DELTA_MIN_COSINE:g}", False
    return None


def ratio_problem(ratio: float, scale: float, factor: float, what: str) -> tuple[str, bool] | None:
    """Why a pair's Δ contribution whose norm is ``ratio`` times this peer's own is refused, or None:
    over ``factor`` when both that ratio and its reference ratio (``ratio × scale``, ``scale`` the
    weights' ratio ``w_own / w_contribution``) are over it (a strike), under ``1 / factor`` when
    both are under it. Either alone misjudges honest partners: a Δ does not grow with the tokens
    behind it where a merge (``sync.fragment_merge = "mix"``) left part of the last mean in it, and
    a joiner's does where it trained a quarter of the round."""
    low, high = sorted((ratio, ratio * scale)) if math.isfinite(ratio * scale) else (math.inf, math.inf)
    if not low <= factor:
        return f"{what} norm is {ratio:.3g}x this peer's ({ratio * scale:.3g}x by tokens), over {factor:.3g}", True
    if not high * factor >= 1:
        return f"{what} norm is {ratio:.3g}x this peer's ({ratio * scale:.3g}x by tokens), under 1/{factor:.3g}", False
    return None


def partner_problem(
    contribution: torch.Tensor,
    own: torch.Tensor,
    *,
    phi: bool,
    pair: bool,
    scale: float = 1.0,
    reference_rms: float | None = None,
) -> tuple[str, bool] | None:
    """Why an owner of a NoLoCo piece leaves a groupmate's contribution out of its mean, or None.

    φ pieces (any NoLoCo group): ``phi_contribution_problem``, small pieces of typical size
    included; Δ pieces of a pair: :func:`delta_partner_problem`. ``scale``: the owner's weight over
    the groupmate's (capped claims); ``reference_rms``: the owner's own payload's RMS per value, of
    the piece's kind.

    Returns:
        None, or (one-line reason, whether the groupmate is struck and left out for the rest of the
        round: φ far off; a Δ is left out of this piece only, struck when over the norm bound).
    """
    if phi:
        problem = phi_contribution_problem(contribution, own, reference_rms=reference_rms)
        return None if problem is None else (problem, True)
    if not pair:
        return None
    return delta_partner_problem(contribution, own, scale=scale, reference_rms=reference_rms)


def receiver_problem(
    mean: torch.Tensor,
    own: torch.Tensor,
    *,
    weight: float,
    included: int,
    max_weight: float | None,
    phi: bool,
    included_self: bool,
    reference_rms: float | None,
    pair: bool,
    tally: PairTally | None = None,
) -> MeanRefusal | None:
    """Why a receiver refuses an owner's mean of one piece, or None: ``owner_mean_problem``, then in
    a pair (:func:`is_pair`) the owner's contribution it implies (:func:`partner_contribution`)
    judged as an owner judges a partner's (:func:`partner_problem`). Arguments as
    ``owner_mean_problem``'s (``reference_rms`` of the piece's kind); ``tally``: a pair's Δ piece
    that passes is folded into it, its direction judged there, not here.

    Returns:
        None or a :class:`~peer.sync.screening.MeanRefusal`; a pair's refusal counts a strike for φ
        and for a Δ over the norm bound.
    """
    problem = owner_mean_problem(
        mean,
        own,
        weight=weight,
        included=included,
        max_weight=max_weight,
        phi=phi,
        included_self=included_self,
        reference_rms=reference_rms,
        direction=not pair,  # a pair: the implied contribution's direction below, not the mean's
    )
    if problem is not None or not pair:
        return problem
    c = partner_contribution(
        mean, own, weight=weight, included=included, included_self=included_self, max_weight=max_weight
    )
    if not bool(torch.isfinite(c).all()):
        return MeanRefusal("the partner's contribution it implies is not finite", strike=True)
    if phi:
        found = partner_problem(c, own, phi=True, pair=True, reference_rms=reference_rms)
    else:
        # c's weight is assumed the cap: its reference norm is its norm; this peer's is scaled up
        scale = min(weight, max_weight) / max_weight if max_weight is not None and weight > 0 else 1.0
        found = delta_partner_problem(
            c, own, scale=scale, reference_rms=reference_rms, slack=RECONSTRUCTION_SLACK, direction=tally is None
        )
        if found is None and tally is not None:
            tally.add(mean, own, implied=included_self and included >= 2)
    if found is None:
        return None
    return MeanRefusal(f"the partner's contribution it implies fails: {found[0]}", strike=found[1])


class PairOwner:
    """The owner's whole-Δ judgement of :class:`peer.sync.allreduce.GroupAllreduce` in a pair (its
    state: ``_contrib``, ``_excluded``, ``my_pieces``, ``plan``, ``stats``, ``pair``, ``whole_delta``,
    ``phi_from``)."""

    _contrib: dict[int, list[tuple[float, torch.Tensor] | None]]
    _excluded: set[int]
    my_pieces: list[Any]
    plan: Any
    stats: Any
    pair: bool
    whole_delta: bool
    phi_from: int | None

    def _whole(self, pieces: list[Any]) -> bool:
        """Whether a pair's owner of ``pieces`` judges its partner's whole Δ before it reduces any."""
        return self.pair and self.whole_delta and any(p.tensor < (self.phi_from or 0) for p in pieces)

    def _partners_away(self) -> set[int]:
        """Owner of a pair's pieces, every contribution in: the partners whose whole Δ fails
        :func:`whole_partner_problem` (left out of every Δ piece; struck over the norm bound)."""
        me, away = self.plan.my_index, set()
        delta = [p.index for p in self.my_pieces if self.phi_from is not None and p.tensor < self.phi_from]
        for s in sorted(set(range(len(self.plan.peer_ids))) - {me} - self._excluded):
            got = [(c, x) for i in delta if (c := self._contrib[i][s]) is not None and (x := self._contrib[i][me])]
            if got and len(got) == len(delta):
                theirs, ours = [c[1] for c, _ in got], [x[1] for _, x in got]
                if found := whole_partner_problem(theirs, ours, weight=got[0][1][0], partner_weight=got[0][0][0]):
                    away.add(s)
                    self.stats.dropped.update({s} if found[1] else ())
                    logger.warning("all-reduce: left groupmate %d's Δ out of every piece: %s", s, found[0])
        return away
