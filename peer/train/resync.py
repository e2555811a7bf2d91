"""Which state a peer adopts from the swarm: the re-sync rule of locoswarm's DiLoCo and NoLoCo.

Peers publish, in their progress records, the digest of the state (φ, outer optimizer state,
round; peer/state/snapshot.py) they hold at the start of their round. A *class* is the set of peers
publishing the same (round, digest). After every round a peer compares its own class with the
others and adopts the state of another class by the rule of :func:`resync_target`; the state is
then downloaded from the counted members of that class at once.

A member of another class *counts* only when it is vouched for (issue #17, item 3;
peer/state/vouching.py): a peer with history counts its vouchers (peers it completed an
all-reduce with in an earlier round); a joiner (``vouchers=None``) counts the peers that the
signed records of their groupmates attest (mutual statements, rounds at most one apart), or every
member when the others form one class only (a swarm that never grouped, e.g. a lone peer, can be
joined).
Classes without a counted member are ignored.

No adoption without agreement (issue #51, item 2): under DiLoCo a class is adopted only when at
least :data:`MIN_HOLDERS` counted peers hold it (fewer only when fewer counted peers are live at
all: a swarm of two), so one identity, however many digests it grinds, never makes a class of its
own that others follow ahead of or behind it; a tie between equal classes at the peer's round (in
a split swarm, where no class has that many, a tie between single holders too) is a
:class:`Target` with ``tie`` set, which the catch-up (peer/round/catchup.py) adopts only when the
state's validation loss is lower than the peer's own: a digest ground to be small wins nothing. Every adoption is also refused when the state's loss is clearly worse (the
catch-up's loss check), which is all NoLoCo has: its replicas differ by design, so its classes have
one member each.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

Others = Iterable[tuple[str, int, str]]
Groupmates = Mapping[str, Collection[str]]

MIN_HOLDERS = 2
"""Counted peers that must hold a state (same round and digest) for a DiLoCo peer to adopt it, when
at least that many counted peers are live (issue #51, item 2)."""


class Target(tuple[int, str, list[str]]):
    """(round, digest, donors) of the state a rule picked, a plain 3-tuple to compare and unpack.

    Attributes:
        tie: the class is no bigger than this peer's own and at its round (DiLoCo's tie-break):
            adopt it only if its validation loss is lower than this peer's own.
    """

    tie: bool

    def __new__(cls, round_: int, digest: str, donors: list[str], *, tie: bool = False) -> Target:
        self = super().__new__(cls, (round_, digest, donors))
        self.tie = tie
        return self


def attested(statements: Mapping[str, tuple[int, Collection[str]]]) -> frozenset[str]:
    """Peers vouched for by a peer that completed a round with them: ``p`` counts when some other
    peer ``q`` names ``p`` as a groupmate, ``p`` names ``q`` back, and their rounds differ by at
    most one (groupmates publish the round after their sync one after the other, and with
    ``sync.overlap`` a statement is about the sync that landed, a round late).

    Args:
        statements: peer id → (round, groupmates) as its signed progress record says: the round
            it is at and the peers that completed its last sync with it.

    Returns:
        The attested peer ids.

    A single identity cannot attest itself, and one honest peer never names a stranger it did not
    sync with; but identities of one owner can name each other: for a peer without history (a
    joiner) this is the only evidence there is.
    """
    out: set[str] = set()
    for p, (round_, mates) in statements.items():
        for q in mates:
            if q == p or q not in statements:
                continue
            q_round, q_mates = statements[q]
            if abs(q_round - round_) <= 1 and p in q_mates:
                out.add(p)
                break
    return frozenset(out)


def resync_target(
    others: Others,
    *,
    round_: int,
    digest: str,
    completed_with: Sequence[str],
    vouchers: Collection[str] | None,
    algorithm: str = "diloco",
    fresh: bool = False,
    groupmates: Groupmates | None = None,
    defers: bool = False,
) -> Target | None:
    """(round, digest, donors) of the state to adopt under ``algorithm``'s rule, or None.

    The outer algorithms (peer/train/outer.py) call the rule of their own algorithm directly:
    :func:`diloco_resync_target` or :func:`noloco_resync_target`.
    """
    if algorithm == "noloco":
        return noloco_resync_target(
            others, round_=round_, fresh=fresh, vouchers=vouchers, groupmates=groupmates, defers=defers
        )
    return diloco_resync_target(
        others,
        round_=round_,
        digest=digest,
        completed_with=completed_with,
        vouchers=vouchers,
        groupmates=groupmates,
        defers=defers,
    )


def _classes(others: Others) -> dict[tuple[int, str], list[str]]:
    classes: dict[tuple[int, str], list[str]] = {}
    for peer_id, r, d in others:
        if d:
            classes.setdefault((r, d), []).append(peer_id)
    return classes


def counted(
    others: Others,
    *,
    vouchers: Collection[str] | None,
    groupmates: Groupmates | None = None,
    own: tuple[int, str] | None = None,
) -> dict[tuple[int, str], list[str]]:
    """The classes of ``others`` with only their members that count, sorted; classes left empty dropped.

    Args:
        others: (peer id, round, state digest hex) of the other live peers ('' digest: none yet).
        vouchers: peers this peer completed an all-reduce with in an earlier round
            (:meth:`peer.state.vouching.Ledger.vouchers`); None: this peer has no history.
        groupmates: peer id → the groupmates its signed record names (only read when
            ``vouchers`` is None).
        own: this peer's (round, digest): not a class to adopt, so it does not make a second
            class for the joiner's one-class exception.

    With ``vouchers``, a member counts if it is one. Without (a joiner), a member counts if
    :func:`peer.state.vouching.attested` (it and a peer at most a round apart name each other), or
    if the others form a single class apart from ``own``.
    """
    others = list(others)
    classes = _classes(others)
    if vouchers is not None:
        allowed = set(vouchers)
    elif len([c for c in classes if c != own]) <= 1:
        allowed = {p for p, _, _ in others}
    else:
        mates = groupmates or {}
        allowed = set(attested({p: (r, tuple(mates.get(p, ()))) for p, r, _ in others}))
    kept = {c: sorted(p for p in members if p in allowed) for c, members in classes.items()}
    return {c: members for c, members in kept.items() if members}


def diloco_resync_target(
    others: Others,
    *,
    round_: int,
    digest: str,
    completed_with: Sequence[str],
    vouchers: Collection[str] | None,
    groupmates: Groupmates | None = None,
    defers: bool = False,
) -> Target | None:
    """(round, digest, donors) of the state to adopt, or None to keep this peer's own (DiLoCo).

    Args:
        others: (peer id, round, state digest hex) of the other live peers ('' digest: none yet).
        round_, digest: this peer's round and the digest of the state it holds at its start.
        completed_with: peers (this one included) that completed this peer's last round with it
            from the same starting state: they hold the same state even before their records say so.
        vouchers: the peers whose records count (see :func:`counted`); None: this peer has no
            history (a joiner).
        groupmates: peer id → groupmates its signed record names (the joiner's evidence).
        defers: this peer serves no state (client mode: nobody can dial it), so no other peer can
            ever adopt its state: its own class counts as none, and it follows any other counted
            class the rule below allows, and also a class exactly one round behind when it completed
            its last round alone (without it, a peer that got ahead behind a NAT, even by one
            round, and a dialable peer behind it would each keep their own state for good).

    The rule. Only counted members of a class count (:func:`counted`). This peer's own class
    counts itself, ``completed_with`` and the counted peers publishing its (round, digest). It
    adopts the biggest other class (then the highest round, then the smallest digest) that has at
    least :data:`MIN_HOLDERS` counted members (or as many as there are counted peers, if fewer) and is

    * at its round or ahead and bigger than its own; or as big and ahead (it fell behind or
      missed a round); or as big, at its round, with the smaller digest (a tie between peers that
      diverged, e.g. by falling back to their own Δ: the :class:`Target` has ``tie`` set, and the
      catch-up takes it only if its validation loss is lower, so a digest ground to be small wins
      nothing);
    * two or more rounds behind and bigger (this peer raced ahead alone, e.g. while partitioned:
      the majority wins; the inner lr schedule follows the adopted φ's history);
    * in a split swarm (no class, this peer's own included, has that many counted members, as
      after a round in which every peer fell back to its own Δ), a single holder at its round with
      the smaller digest: a tie, taken only at a lower validation loss, so diverged honest peers
      settle on one state again (and a peer behind them can then follow the class they form).

    Classes exactly one round behind are ignored: those are peers that have not yet published the
    round they just finished. It never follows a lone peer that raced ahead of a bigger class. The
    donors are the counted members of the adopted class.
    """
    classes = counted(others, vouchers=vouchers, groupmates=groupmates, own=(round_, digest))
    population = len({p for members in classes.values() for p in members})
    required = min(MIN_HOLDERS, max(1, population))
    own = set(classes.pop((round_, digest), [])) | set(completed_with)
    own_count = 0 if defers else max(1, len(own))
    # A deferring peer that completed its last round alone is a round ahead of a class one round
    # behind, not waiting for it to publish: nobody can catch up with it, so it steps back.
    alone = len(set(completed_with)) <= 1

    # A split swarm: no class, this peer's own included, holds ``required`` counted members (e.g.
    # every peer fell back to its own Δ in a round without a group). Then a tie between single
    # holders at this round is still considered, and taken only at a lower validation loss (the
    # catch-up's check), so honest peers that diverged settle on one state again; a single holder
    # ahead of or behind this peer is never followed.
    split = max([own_count, *(len(m) for m in classes.values())]) < required

    def eligible(r: int, d: str, count: int) -> bool:
        if split and r == round_ and count == own_count == 1:
            return d < digest
        if count < required:
            return False
        if r >= round_:
            return count > own_count or (count == own_count and (r > round_ or d < digest))
        if defers and alone and r == round_ - 1:
            return count > own_count
        return r <= round_ - 2 and count > own_count

    candidates = [kv for kv in classes.items() if eligible(kv[0][0], kv[0][1], len(kv[1]))]
    if not candidates:
        return None
    (r, d), donors = min(candidates, key=lambda kv: (-len(kv[1]), -kv[0][0], kv[0][1]))
    return Target(r, d, donors, tie=r == round_ and len(donors) <= own_count)


def noloco_resync_target(
    others: Others,
    *,
    round_: int,
    fresh: bool,
    vouchers: Collection[str] | None,
    groupmates: Groupmates | None = None,
    defers: bool = False,
) -> Target | None:
    """(round, digest, donors) of the state to adopt, or None (NoLoCo: replicas differ by design).

    Args:
        others: (peer id, round, state digest hex) of the other live peers ('' digest: none yet).
        round_: this peer's round.
        fresh: this peer is at round 0, step 0 (it follows a swarm only one round ahead).
        vouchers, groupmates: which members count (:func:`counted`).
        defers: this peer serves no state (client mode): when no counted peer is at or ahead of its
            round and the rule below finds nothing, it follows the swarm behind it instead (the
            median counted peer at least two rounds behind): it raced ahead alone, and nobody can
            catch up with a state nobody can download.

    The rule. This peer follows only when it is behind the counted swarm: the counted peers ahead
    of its round are at least as many as those at its round or behind, plus this one unless it is
    fresh (its φ_0 is no work); so one peer ahead of the others is not the swarm. It then adopts,
    among the counted peers at least two rounds ahead (one, when fresh: round 0, step 0), the class
    of the median one (by round, then digest; the lower median), so a liar claiming the highest
    round does not choose the state.
    """
    classes = counted(others, vouchers=vouchers, groupmates=groupmates)
    ahead = sum(len(members) for (r, _), members in classes.items() if r > round_)
    level = sum(len(members) for (r, _), members in classes.items() if r <= round_) + (0 if fresh else 1)
    lead = round_ + (1 if fresh else 2)
    far = sorted((r, d, p) for (r, d), members in classes.items() if r >= lead for p in members)
    if defers and not far and not any(r >= round_ for r, _ in classes):
        behind = sorted((r, d, p) for (r, d), members in classes.items() if r <= round_ - 2 for p in members)
        if not behind:
            return None
        r, d, _ = behind[(len(behind) - 1) // 2]
        return Target(r, d, classes[(r, d)])
    if not far or ahead < level:
        return None
    r, d, _ = far[(len(far) - 1) // 2]
    return Target(r, d, classes[(r, d)])
