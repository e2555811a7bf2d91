"""Screening of the contributions an owner of pieces sums (peer/sync/allreduce.py).

A groupmate may lie about its weight and send any finite values. Before an owner sums a piece's
contributions it applies, in this order, two deterministic rules:

1. **Token weight cap.** A contribution's weight is the tokens its sender claims in its HELLO.
   No honest peer claims more than ``H × batch_size_tokens`` tokens for a round (the run
   manifest's ``sync.inner_steps × inner_optimizer.batch_size_tokens``; with overlap a peer may
   train more steps while its sync in flight waits, and claims the cap for them), so a larger
   claim is cut to that cap (logged and counted). Without the cap, one groupmate claiming 1e30 tokens makes
   the weighted mean equal its own payload.
2. **Norm clip to the round's median** (Templar: clip each contribution to a multiple of the
   median norm of the round). Each contribution whose L2 norm exceeds
   :data:`CLIP_MEDIAN_FACTOR` × the median of that piece's *reference norms* is scaled down to
   that norm; one over :data:`STRIKE_MEDIAN_FACTOR` × that median is also a strike (:class:`Strikes`). A contribution's reference norm is its norm scaled up to the largest weight of the
   piece (norm × w_max / w): a peer that joined mid-round trained fewer tokens and has a shorter
   Δ, which must not drag the threshold down and clip its full-round groupmates (Δ grows at most
   linearly in the steps taken, so the scaled norm over-estimates, i.e. errs toward not
   clipping). The median is the *lower* median: with two contributions, the smaller reference,
   since nothing tells which of two is honest and the smaller one bounds the damage.

Only the owner computes a piece's mean, and every groupmate receives the owner's bytes, so the
groupmates that complete a round still hold bit-identical φ. A contribution below the threshold
is summed exactly as before: a round in which nothing is clipped gives the same bits as without
screening.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CLIP_MEDIAN_FACTOR = 1.5
"""Contributions are clipped to this multiple of the piece's median contribution norm.

Why 1.5: peers of one run train the same model with the same optimizer for the same number of
steps on shards of one corpus, so their pseudo-gradients differ in direction far more than in
norm (an honest Δ's reference norm is within a few percent of the median; a clean 8-peer run
clips nothing). The factor bounds what a colluder inside every other check can add: one
groupmate moves a mean of n contributions by at most ``1.5 × median × (its weight share)``. At 3×
two "A Little Is Enough" colluders (arXiv 1902.06156) cost a DiLoCo group more than never averaging
at 20 rounds; at 1.5× under a fifth of it (docs/benchmarks.md, the Byzantine table). A clip is not
a strike: an honest outlier between 1.5× and :data:`STRIKE_MEDIAN_FACTOR` × (unlike shards, a
joiner's first round) is shortened, never ignored."""

STRIKE_MEDIAN_FACTOR = 3.0
"""A contribution over this multiple of the piece's median reference norm is a strike against its
sender (clipped as every one over :data:`CLIP_MEDIAN_FACTOR`): no honest spread reaches it."""


def round_token_cap(manifest) -> int:
    """The most tokens an honest peer claims for one round of ``manifest``'s run:
    ``sync.inner_steps × inner_optimizer.batch_size_tokens`` (peer/round/ caps its own claim
    there when it trained extra steps while waiting for a sync)."""
    return manifest.sync.inner_steps * manifest.inner_optimizer.batch_size_tokens


def cap_weight(weight: float, max_weight: float | None) -> float:
    """``weight`` cut to ``max_weight`` (None: no cap)."""
    return weight if max_weight is None or weight <= max_weight else float(max_weight)


def norm(x: torch.Tensor) -> float:
    """L2 norm of ``x``, computed in float64: fp32 values up to 3.4e38 square without overflow."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the angle between ``a`` and ``b`` (float64; 0 when either is zero, NaN if not finite)."""
    a, b = a.flatten().double(), b.flatten().double()
    denominator = float(a.norm() * b.norm())
    return float(torch.dot(a, b)) / denominator if denominator > 0 else 0.0


def median_norm(norms: Sequence[float]) -> float:
    """The lower median of ``norms`` (non-empty): the smaller one of two."""
    ordered = sorted(norms)
    return ordered[(len(ordered) - 1) // 2]


def clip_to_median(parts: Sequence[tuple[float, torch.Tensor]]) -> tuple[list[tuple[float, torch.Tensor]], list[int]]:
    """Clip each contribution's norm to :data:`CLIP_MEDIAN_FACTOR` × the lower median of the reference norms of
    ``parts`` (each norm scaled by the heaviest weight over its own: see the module docstring).

    Args:
        parts: ``(weight, fp32 tensor)`` per contribution, all finite, all the same shape.

    Returns:
        ``(parts, struck)``: the parts with every contribution above the threshold replaced by a
        scaled copy (the others are the same tensor objects, untouched), and the positions over
        :data:`STRIKE_MEDIAN_FACTOR` × the median (each clipped too). A median of 0 (most contributions are
        exactly zero) gives no scale: nothing is clipped then.
    """
    norms = [norm(x) for _, x in parts]
    heaviest = max((w for w, _ in parts), default=0.0)
    references = [n * (heaviest / w) if w > 0 else n for (w, _), n in zip(parts, norms)]
    median = median_norm(references) if parts else 0.0
    threshold = CLIP_MEDIAN_FACTOR * median
    if not threshold > 0 or not math.isfinite(threshold):
        return list(parts), []
    out, struck = [], []
    for i, ((w, x), n) in enumerate(zip(parts, norms)):
        if n > threshold:
            x = x * (threshold / n)  # scale < 1: no overflow
            if n > STRIKE_MEDIAN_FACTOR * median:
                struck.append(i)
        out.append((w, x))
    return out, struck


STRIKES_TO_IGNORE = 3
"""Rounds (within :data:`STRIKE_WINDOW_ROUNDS`) in which this peer, as an owner of pieces, clipped or
dropped a groupmate's contribution before it ignores that groupmate."""
STRIKE_WINDOW_ROUNDS = 10
"""How many recent rounds the strikes are counted over."""
IGNORE_ROUNDS = 20
"""How many rounds an ignored groupmate stays ignored: its contributions are left out of the means
this peer computes (it still receives them, like every groupmate)."""
EQUIVOCATOR_IGNORE_ROUNDS = 1_000_000
"""How many rounds a groupmate caught equivocating (peer/sync/receipts.py) is ignored, its means
applied as refused: for the rest of the run, restarts included (peer/sync/suspicion_store.py). Honest
owners send every receiver the same bytes; no honest fault produces two means of one piece."""


class Strikes:
    """Groupmates this peer ignores for a while because their contributions were clipped or dropped
    (non-finite or malformed) repeatedly (issue 17, item 4; BTARD bans peers caught lying).

    An honest peer's Δ is never struck (STRIKE_MEDIAN_FACTOR is far over honest spread), so
    :data:`STRIKES_TO_IGNORE` strikes within :data:`STRIKE_WINDOW_ROUNDS` rounds mark a groupmate
    whose contributions would be clipped anyway: ignoring it for :data:`IGNORE_ROUNDS` rounds costs
    little and stops it from pulling the mean every round. Rounds, not seconds: the same rule on
    every peer whatever its speed. Not thread-safe: one averager process owns it.

    Args:
        strikes, window_rounds, ignore_rounds: the rule's three numbers (defaults above).
    """

    def __init__(
        self,
        *,
        strikes: int = STRIKES_TO_IGNORE,
        window_rounds: int = STRIKE_WINDOW_ROUNDS,
        ignore_rounds: int = IGNORE_ROUNDS,
    ):
        if not 1 <= strikes <= window_rounds:
            raise ValueError(f"strikes = {strikes}: expected 1 <= strikes <= window_rounds = {window_rounds}")
        if ignore_rounds < 1:
            raise ValueError(f"ignore_rounds = {ignore_rounds}: expected >= 1")
        self.strikes, self.window_rounds, self.ignore_rounds = strikes, window_rounds, ignore_rounds
        self._struck: dict[object, set[int]] = {}
        self._until: dict[object, int] = {}

    def record(self, round_: int, offenders) -> list:
        """Note that the contributions of ``offenders`` (peer ids) were clipped or dropped at ``round_``.

        Returns:
            The offenders ignored from now on (their strikes reached the limit), for a log line.
        """
        newly = []
        for peer in offenders:
            rounds = {r for r in self._struck.get(peer, set()) if r > round_ - self.window_rounds}
            rounds.add(round_)
            self._struck[peer] = rounds
            if len(rounds) >= self.strikes and not self.is_ignored(peer, round_):
                self._until[peer] = round_ + 1 + self.ignore_rounds  # the next ignore_rounds rounds
                self._struck[peer] = set()
                newly.append(peer)
        return newly

    def ignore(self, peer, round_: int, rounds: int | None = None) -> None:
        """Ignore ``peer`` from the round after ``round_`` for ``rounds`` rounds (None: this rule's
        ``ignore_rounds``), at once, without strikes (a groupmate caught equivocating, issue #51)."""
        until = round_ + 1 + (self.ignore_rounds if rounds is None else rounds)
        self._until[peer] = max(until, self._until.get(peer, until))

    def is_ignored(self, peer, round_: int) -> bool:
        """Whether ``peer``'s contributions are left out at ``round_``."""
        return round_ < self._until.get(peer, round_)

    def ignored(self, round_: int) -> set:
        """Every peer ignored at ``round_``; forgets those whose time is up."""
        for peer in [p for p, until in self._until.items() if until <= round_]:
            del self._until[peer]
        return set(self._until)

    def ignored_until(self) -> dict:
        """Each peer ignored now or later → the first round it is no longer ignored (a copy, kept
        across restarts by peer/sync/suspicion_store.py)."""
        return dict(self._until)


OWNER_NORM_FACTOR = STRIKE_MEDIAN_FACTOR
"""A receiver refuses an owner's mean of a piece whose norm exceeds this multiple of its own
contribution's reference norm (see :func:`owner_mean_problem`)."""
OWNER_CHECK_MIN_ELEMENTS = 256
"""Pieces smaller than this get only the looser norm bound of :func:`owner_mean_problem` (factor
:data:`OWNER_SMALL_NORM_FACTOR`, and the floor), not the tight one nor the share and φ direction
checks: over a few dozen values the honest ratios vary too much to tell (a scalar's mean may be 10x
its own contribution). Every piece, whatever its size, gets a norm bound (issue #51: an owner of the
RMSNorm gains sending means of 1e30 left every honest φ at 1e30, then NaN)."""
OWNER_SMALL_NORM_FACTOR = 10 * OWNER_NORM_FACTOR
"""A receiver refuses an owner's mean of a piece under :data:`OWNER_CHECK_MIN_ELEMENTS` values whose
norm exceeds this multiple of its own contribution's reference norm: 10x the large pieces' factor,
the spread the comment above measured for a scalar's mean, so honest small pieces pass."""
OWNER_FLOOR_SPREAD = 1.0
"""The floor of the norm bound, for a piece where this receiver's own contribution is near zero (an
embedding row its shard never saw, a gain its steps did not move): :data:`OWNER_NORM_FACTOR` ×
this × the receiver's own payload's RMS per value (:func:`reference_rms`) × sqrt(the piece's
values), scaled to a full round like the bound itself, i.e. the bound of a piece whose own values
are of this peer's typical size. 1: the honest mean of such a piece is a weighted average that
holds this peer's near-zero values and the others' (of typical size, each clipped by the owner to
3x the piece's median), so it stays under 3x the typical size; a larger spread would loosen the
bound of every piece of typical size (the floor then exceeds 3x its own norm). A mean of 1e30, or
anything not finite, is far above it."""
OWNER_SHARE_FACTOR = 0.25
"""A receiver refuses an owner's mean of a Δ piece whose projection on its own contribution is below
this fraction of what its own share alone puts there (see :func:`owner_mean_problem`)."""
OWNER_SHARE_CHECK = False
"""Whether receivers run check 2 of :func:`owner_mean_problem` (the mean holds their share). Off:
in the chaos test (real peers, kills, joiners with a fresh AdamW) honest owners' means had a
negative projection on some receivers' own Δ, so receivers refused honest pieces, their φ split
and they kept downloading state; honest pseudo-gradients of a churning swarm are not reliably
positively correlated. With it off, a lying owner is caught only by the norm bound (a flipped,
zeroed or noisy mean of honest size gets through). Tests turn it on to test the check itself."""
DELTA_MIN_COSINE = 0.0
"""A receiver refuses an owner's mean m of a Δ piece (of at least :data:`OWNER_CHECK_MIN_ELEMENTS`
values, one the owner says it included this receiver in) whose cosine with its own contribution x
is not above this (check 4 of :func:`owner_mean_problem`): a flipped, zeroed or replaced mean
points away from (or across) every honest x, an honest one holds x with its share. A single receiver's refusal decides nothing:
it goes into its RECEIPT, and an owner's pieces are skipped only when at least half of the group's
reports refuse them (peer/sync/receipts.py), so one honest receiver whose Δ an honest mean points
away from (a churning swarm's) costs nobody a piece, and the honest peers keep one φ."""
DIRECTION_MIN_SIZE = 0.5
"""Check 4 of :func:`owner_mean_problem` judges a piece only where this receiver's own Δ is of at least
this fraction of its typical size (its payload's RMS per value × sqrt(the piece's values)): where
its own Δ is near zero (embedding rows its shard never saw), the others' Δ decide the mean's
direction and an honest mean may point anywhere relative to it."""
PHI_MIN_COSINE = 0.2
"""An owner leaves out a partner's φ contribution (NoLoCo) whose cosine with its own φ is below this:
φ = 0, another model and a flipped φ have about 0 or below. Honest replicas share their start and
keep averaging, so their cosine stays well above this and their norms close, even for pairs that
have not met for a few rounds and whose φ lie several rounds' steps apart: a bound on the distance
between φ, which this check replaced, left honest partners out."""
PHI_MAX_NORM_RATIO = 2.0
"""An owner leaves out a partner's φ contribution whose norm is over this multiple, or under its
inverse, of its own φ's (a scaled φ; with the cosine floor it bounds the pull of any accepted φ)."""
PHI_MEAN_MIN_RATIO = 0.7
"""A receiver refuses an owner's mean m of a φ piece whose cosine with, or norm relative to, its own
φ x is below this: a pair's mean of φ with cosine ≥ :data:`PHI_MIN_COSINE` and equal norms has
both at least sqrt((1 + 0.2) / 2) = 0.77; a partner's φ = 0 pulled in halves the norm (0.5)."""


def share_floor(weight: float, included: int, max_weight: float | None) -> float | None:
    """The smallest share of a mean that a contribution of ``weight`` tokens can have when the owner
    includes ``included`` contributions (this one among them) and caps every weight at
    ``max_weight``: ``w / (w + (included - 1) × max_weight)``; None without a cap (no floor known)."""
    if max_weight is None or not weight > 0 or included < 1:
        return None
    weight = min(weight, max_weight)
    return weight / (weight + (included - 1) * max_weight)


class MeanRefusal(str):
    """Why a receiver refuses an owner's mean (the one-line reason, a ``str``), and whether the
    refusal counts a strike against the owner (:class:`Strikes`).

    ``strike`` is True for the norm and φ checks, which an honest owner's mean fails only
    when this receiver's own contribution is far off the group's, and False for the share check
    (the mean does not hold this receiver's contribution): an honest owner fails that one when
    other senders' contributions, clipped but kept, pull against this receiver's (bench/byzantine.py,
    2 sign-flip attackers of 8: honest owners' means refused in the rounds before the attackers
    were ignored). The piece is refused either way; only a strike leads to ignoring the owner.
    """

    strike: bool

    def __new__(cls, reason: str, *, strike: bool) -> MeanRefusal:
        refusal = super().__new__(cls, reason)
        refusal.strike = strike
        return refusal

    def __getnewargs_ex__(self) -> tuple[tuple[str], dict[str, bool]]:
        """Copy and pickle with ``strike`` (process pipes carry all-reduce stats)."""
        return (str(self),), {"strike": self.strike}


def reference_rms(tensors) -> float:
    """The RMS per value of ``tensors`` (this peer's own contributions of one kind, Δ or φ, to a sync),
    in float64: the unit of :func:`owner_mean_problem`'s floor (``reference_rms``). 0 when empty."""
    tensors = list(tensors)
    count = sum(t.numel() for t in tensors)
    if not count:
        return 0.0
    total = sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2 for t in tensors)
    return math.sqrt(total / count)


def owner_mean_problem(
    mean: torch.Tensor,
    contribution: torch.Tensor,
    *,
    weight: float,
    included: int,
    max_weight: float | None,
    phi: bool = False,
    included_self: bool = True,
    reference_rms: float | None = None,
    direction: bool = True,
    small: bool | None = None,
) -> MeanRefusal | None:
    """Why a receiver refuses the mean of one piece that its owner sent, or None to accept it.

    Only the owner of a piece sees every contribution to it, so a lying owner could send any finite
    mean. An honest owner's mean is a weighted average of contributions clipped to
    :data:`CLIP_MEDIAN_FACTOR` × their median reference norm, and it includes this receiver's own
    contribution with at least the share :func:`share_floor` gives. So the receiver checks, against
    its own contribution x (as the owner decoded it) and the mean m (both fp32, same shape):

    1. ``‖m‖ ≤`` :data:`OWNER_NORM_FACTOR` ``× ‖x‖ × max_weight / w`` (x's norm scaled up to a
       full round, as the owner's clip does): catches huge or scaled-up means. Every piece gets
       it, whatever its size: under :data:`OWNER_CHECK_MIN_ELEMENTS` values with the factor
       :data:`OWNER_SMALL_NORM_FACTOR`; and the bound is never below its floor
       (:data:`OWNER_FLOOR_SPREAD`, from ``reference_rms``: 3x a piece of this peer's typical
       values), so an honest mean of a piece where x is near zero passes while a mean that is not
       finite or of 1e30 never does;
    2. for Δ pieces, ``m·x ≥`` :data:`OWNER_SHARE_FACTOR` ``× share_floor × ‖x‖²``: the mean holds
       this receiver's own contribution (an honest mean gives m·x ≥ share × ‖x‖² plus the other
       peers' projections, which are positive for pseudo-gradients of one model); catches
       sign-flipped, zeroed, random and replaced means (only when the owner says it included this
       receiver);
    3. for φ pieces (NoLoCo, which averages φ itself), ``‖m‖ / ‖x‖`` and ``cos(m, x)`` at least
       :data:`PHI_MEAN_MIN_RATIO`: an honest pair's mean lies between two φ that point the same
       way, a mean pulled toward 0, a flipped φ or another model does not; also on pieces under
       :data:`OWNER_CHECK_MIN_ELEMENTS` values where x is of at least :data:`DIRECTION_MIN_SIZE`
       of its typical size (RMSNorm gains, whose φ start at 1 in every replica);
    4. for Δ pieces that the owner says include this receiver, where x is of at least
       :data:`DIRECTION_MIN_SIZE` of its typical size, ``cos(m, x) >`` :data:`DELTA_MIN_COSINE`:
       a flipped or replaced mean (issue #51's owner attacks) points away from x (the group's
       receipts then decide by majority, peer/sync/receipts.py). Not with ``direction`` False
       (a NoLoCo pair, where one honest partner's Δ of a piece can outweigh x and point across
       it: peer/sync/pairs.py judges the partner's contribution the mean implies instead).

    Honest means stay below check 1's bound with room to spare.

    Args:
        mean, contribution: fp32 tensors of one piece's shape.
        weight: this receiver's token weight (the HELLO's).
        included: contributions the owner says it included, this one among them.
        max_weight: the run's cap on a weight (``H × batch_size_tokens``); None: check 1 uses
            ``w_max / w = 1`` and check 2 is skipped (no share floor is known).
        phi: the piece is of φ (NoLoCo): checks 1 and 3.
        included_self: the owner's MEAN frame names this receiver among the included senders
            (else check 2 is skipped: the mean need not hold its contribution).
        reference_rms: this receiver's own payload's RMS per value, of the kind of this piece (Δ or
            φ: :func:`reference_rms`), for the floor of check 1; None: no floor (a zero ``x`` then
            leaves only the finiteness of the mean to check, as before the floor).
        small: judge it as a piece under :data:`OWNER_CHECK_MIN_ELEMENTS` values (the loose norm
            bound only); None: by its size. False for several small pieces judged together
            (:class:`SmallPieces`).

    Returns:
        None, or a :class:`MeanRefusal`: a one-line reason naming the measured and allowed values,
        with ``strike`` True for checks 1 and 3, False for checks 2 and 4. Checks 2 to 4 need a
        non-zero contribution and (but check 3 of a typical one) a piece of at least
        :data:`OWNER_CHECK_MIN_ELEMENTS` values.
    """
    if small is None:
        small = small_piece(contribution)
    x_norm, m_norm = norm(contribution), norm(mean)
    if not math.isfinite(m_norm):
        return MeanRefusal(f"its norm is {m_norm} (not finite)", strike=True)
    if not math.isfinite(x_norm):
        return None  # this peer's own contribution is broken: nothing to compare with
    scale = max_weight / min(weight, max_weight) if max_weight is not None and weight > 0 else 1.0
    factor = OWNER_SMALL_NORM_FACTOR if small else OWNER_NORM_FACTOR
    allowed = factor * x_norm * scale
    floor = 0.0
    if reference_rms is not None and math.isfinite(reference_rms):
        floor = OWNER_NORM_FACTOR * OWNER_FLOOR_SPREAD * reference_rms * math.sqrt(contribution.numel()) * scale
    if floor > allowed:
        allowed = floor
    if allowed > 0 and not m_norm <= allowed:  # allowed 0: a zero x and no floor, nothing to compare with
        basis = (
            f"{factor:g}x this peer's reference norm"
            if allowed > floor
            else f"the floor from this peer's payload RMS {reference_rms:.3g}"
        )
        return MeanRefusal(
            f"its norm {m_norm:.4g} exceeds {allowed:.4g} ({basis}; a piece of {contribution.numel()} values)",
            strike=True,
        )
    if not x_norm > 0:
        return None
    typical = reference_rms is None or x_norm >= DIRECTION_MIN_SIZE * reference_rms * math.sqrt(contribution.numel())
    if small and not (phi and reference_rms is not None and typical):  # a small φ piece of typical size: check 3
        return None
    if phi:
        ratio, cosine = norm(mean) / x_norm, _cosine(mean, contribution)
        if not (ratio >= PHI_MEAN_MIN_RATIO and cosine >= PHI_MEAN_MIN_RATIO):
            return MeanRefusal(
                f"its norm is {ratio:.3g}x this peer's φ's and its cosine with it {cosine:.3g}, "
                f"below {PHI_MEAN_MIN_RATIO:g}",
                strike=True,
            )
        return None
    share = share_floor(weight, included, max_weight) if included_self and OWNER_SHARE_CHECK else None
    if share is not None:
        projection = float(torch.dot(mean.flatten().double(), contribution.flatten().double()))
        needed = OWNER_SHARE_FACTOR * share * x_norm**2
        if not projection >= needed:
            return MeanRefusal(
                f"it does not hold this peer's contribution: projection {projection:.4g} < "
                f"{needed:.4g} ({OWNER_SHARE_FACTOR:g} x its share floor {share:.3g} x |x|^2)",
                strike=False,
            )
    if direction and included_self and typical and not (cosine := _cosine(mean, contribution)) > DELTA_MIN_COSINE:
        return MeanRefusal(
            f"it points away from this peer's Δ (cosine {cosine:.3g}, not above {DELTA_MIN_COSINE:g})", strike=False
        )
    return None


def small_piece(x: torch.Tensor) -> bool:
    """Whether ``x`` is a piece under :data:`OWNER_CHECK_MIN_ELEMENTS` values (the loose bound alone)."""
    return x.numel() < OWNER_CHECK_MIN_ELEMENTS


class SmallPieces:
    """One receiver's Δ pieces under :data:`OWNER_CHECK_MIN_ELEMENTS` values from one owner, judged
    together once the owner's last mean is in (issue #65, item 2).

    A single small piece's mean gets only the loose norm bound of :func:`owner_mean_problem`: over a
    few dozen values the honest ratios vary too much. Over all of one owner's small pieces they do
    not (the round engine, 8 peers, bench/byzantine.py's config, clean blocking DiLoCo: cosine with
    the receiver's own Δ 0.78 to 0.995, norm ratio 0.76 to 1.08, over a median of 160 values), so
    their concatenation is judged as a large piece is, with the tight norm bound and the direction
    check, whatever its size and in every sync schedule: an owner sending −20 × its honest means of
    the RMSNorm gains, the same to every receiver, passes every single piece's check and not this.

    Not for φ pieces (those of typical size get check 3 one by one) nor in a NoLoCo pair (its whole
    Δ is judged by peer/sync/pairs.py ``PairTally``).
    """

    def __init__(self) -> None:
        self._means: list[torch.Tensor] = []
        self._owns: list[torch.Tensor] = []
        self._included: int | None = None
        self._included_self = True

    def add(self, mean: torch.Tensor, own: torch.Tensor, *, included: int, included_self: bool) -> None:
        """Fold in one small Δ piece: the owner's decoded ``mean`` and this receiver's ``own``
        contribution as the owner decoded it (same shape, any float dtype; kept as fp32 copies)."""
        self._means.append(mean.detach().flatten().float().clone())
        self._owns.append(own.detach().flatten().float().clone())
        self._included = included if self._included is None else min(self._included, included)
        self._included_self = self._included_self and included_self

    @property
    def pieces(self) -> int:
        return len(self._means)

    def problem(self, *, weight: float, max_weight: float | None, reference_rms: float | None) -> MeanRefusal | None:
        """Why this receiver refuses the owner's small pieces together, or None: the norm bound of
        :data:`OWNER_NORM_FACTOR` (with its floor) and the direction check of
        :func:`owner_mean_problem` on the concatenation (arguments as there). A norm refusal
        counts a strike, a direction refusal does not."""
        if not self._means:
            return None
        mean, own = torch.cat(self._means), torch.cat(self._owns)
        found = owner_mean_problem(
            mean,
            own,
            weight=weight,
            included=self._included or 1,
            max_weight=max_weight,
            included_self=self._included_self,
            reference_rms=reference_rms,
            small=False,
        )
        if found is None:
            return None
        return MeanRefusal(f"its means of {self.pieces} small pieces, judged together: {found}", strike=found.strike)


def phi_contribution_problem(
    contribution: torch.Tensor, own: torch.Tensor, *, reference_rms: float | None = None
) -> str | None:
    """Why an owner leaves a groupmate's φ contribution (NoLoCo) out of its mean, or None.

    NoLoCo averages φ itself, so a partner that sends φ = 0 (or another model) pulls the owner's mean
    halfway there, inside every norm bound. A contribution whose cosine with the owner's own φ
    (fp32, same shape) is below :data:`PHI_MIN_COSINE`, or whose norm is over
    :data:`PHI_MAX_NORM_RATIO` times (or under its inverse) the own φ's, is left out. A zero own φ
    is not judged, nor a piece under :data:`OWNER_CHECK_MIN_ELEMENTS` values unless the own φ there
    is of at least :data:`DIRECTION_MIN_SIZE` of its typical size (``reference_rms``: the own φ
    payload's RMS per value; None: not judged): RMSNorm gains start at 1 in every replica, so their
    φ stay at cosine near 1, where a flipped or zeroed gain breaks the model.
    """
    own_norm = norm(own)
    if not own_norm > 0 or not math.isfinite(own_norm):
        return None
    if own.numel() < OWNER_CHECK_MIN_ELEMENTS and (
        reference_rms is None or own_norm < DIRECTION_MIN_SIZE * reference_rms * math.sqrt(own.numel())
    ):
        return None
    cosine, ratio = _cosine(contribution, own), norm(contribution) / own_norm
    if not cosine >= PHI_MIN_COSINE:
        return f"its φ's cosine with this owner's is {cosine:.3g}, below {PHI_MIN_COSINE:g}"
    if not 1 / PHI_MAX_NORM_RATIO <= ratio <= PHI_MAX_NORM_RATIO:
        return (
            f"its φ's norm is {ratio:.3g}x this owner's, outside [{1 / PHI_MAX_NORM_RATIO:g}, {PHI_MAX_NORM_RATIO:g}]"
        )
    return None
