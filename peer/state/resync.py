"""Which state a peer adopts from the swarm: the re-sync rule of locoswarm's DiLoCo.

Peers publish, in their progress records, the digest of the state (φ, outer optimizer state,
round; peer/state/snapshot.py) they hold at the start of their round. A *class* is the set of peers
publishing the same (round, digest). After every round a peer compares its own class with the
others and adopts the state of another class by the rule of :func:`resync_target`; the state is
then downloaded from every member of that class at once.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def resync_target(others: Iterable[tuple[str, int, str]], *, round_: int, digest: str, completed_with: Sequence[str],
                  algorithm: str = "diloco", fresh: bool = False) -> tuple[int, str, list[str]] | None:
    """(round, digest, donors) of the state to adopt under ``algorithm``'s rule, or None.

    The outer algorithms (peer/train/outer.py) call the rule of their own algorithm directly:
    :func:`diloco_resync_target` or :func:`noloco_resync_target`.
    """
    if algorithm == "noloco":
        return noloco_resync_target(others, round_=round_, fresh=fresh)
    return diloco_resync_target(others, round_=round_, digest=digest, completed_with=completed_with)


def _classes(others: Iterable[tuple[str, int, str]]) -> dict[tuple[int, str], list[str]]:
    classes: dict[tuple[int, str], list[str]] = {}
    for peer_id, r, d in others:
        if d:
            classes.setdefault((r, d), []).append(peer_id)
    return classes


def diloco_resync_target(others: Iterable[tuple[str, int, str]], *, round_: int, digest: str,
                         completed_with: Sequence[str]) -> tuple[int, str, list[str]] | None:
    """(round, digest, donors) of the state to adopt, or None to keep this peer's own (DiLoCo).

    Args:
        others: (peer id, round, state digest hex) of the other live peers ('' digest: none yet).
        round_, digest: this peer's round and the digest of the state it holds at its start.
        completed_with: peers (this one included) that completed this peer's last round with it
            from the same starting state: they hold the same state even before their records say so.

    The rule. This peer's own class counts the peers publishing its (round, digest) and
    ``completed_with``. It adopts the biggest other class (then the highest round, then the
    smallest digest) that is

    * at its round or ahead and bigger than its own; or as big and ahead (it fell behind or
      missed a round); or as big, at its round, with the smaller digest (a tie between peers that
      diverged, e.g. by falling back to their own Δ: all settle on one state);
    * two or more rounds behind and bigger (this peer raced ahead alone, e.g. while partitioned:
      the majority wins; the inner lr schedule follows the adopted φ's history).

    Classes exactly one round behind are ignored: those are peers that have not yet published the
    round they just finished. It never follows a lone peer that raced ahead of a bigger class.
    """
    classes = _classes(others)
    own = set(classes.pop((round_, digest), [])) | set(completed_with)
    own_count = max(1, len(own))

    def eligible(r: int, d: str, count: int) -> bool:
        if r >= round_:
            return count > own_count or (count == own_count and (r > round_ or d < digest))
        return r <= round_ - 2 and count > own_count

    candidates = [kv for kv in classes.items() if eligible(kv[0][0], kv[0][1], len(kv[1]))]
    if not candidates:
        return None
    (r, d), donors = min(candidates, key=lambda kv: (-len(kv[1]), -kv[0][0], kv[0][1]))
    return r, d, sorted(donors)


def noloco_resync_target(others: Iterable[tuple[str, int, str]], *, round_: int,
                         fresh: bool) -> tuple[int, str, list[str]] | None:
    """(round, digest, donors) of the state to adopt, or None (NoLoCo: replicas differ by design).

    Follow only a swarm at least two rounds ahead (one, for a fresh peer: round 0, step 0), the
    class with the highest round, then the most peers.
    """
    ahead = [kv for kv in _classes(others).items() if kv[0][0] >= round_ + (1 if fresh else 2)]
    if not ahead:
        return None
    (r, d), donors = max(ahead, key=lambda kv: (kv[0][0], len(kv[1])))
    return r, d, donors
