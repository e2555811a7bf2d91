"""Who may vouch for a state this peer adopts (issue #17, item 3).

The re-sync rule (peer/train/resync.py) adopts the state of a class of peers: those that publish
the same (round, digest) in their signed progress records. Signatures bind a record to its peer
(protocol/signing.py), but identities are free: anyone can make four fresh Ed25519 keys and sign
four records claiming round r+1 with an all-zero φ. So a class member counts only when this peer
has reason to believe it did the work:

* :class:`Ledger`: the peers this peer completed an all-reduce with (bytes exchanged, no
  exclusions), and the round that first happened. A peer counts as a *voucher* from the round
  after: a burst of fresh identities counts for nothing until each of them has taken part in a
  group with this peer, in full, in an earlier round.
* ``attested`` (peer/train/resync.py, beside the rule that uses it): for a joiner, which has no ledger, the peers whose signed records name each
  other as groupmates (mutual statements, rounds at most one apart).
* :class:`RoundClock`: a claimed round may not run ahead of what elapsed time allows since this
  reader first saw the peer; a record that does is ignored and counted.

Counting is not all (issue #51, item 2): a DiLoCo class needs at least two counted members
(peer/train/resync.py ``MIN_HOLDERS``), and a downloaded state that is clearly worse on this peer's
validation windows than its own is refused and its digest added to :attr:`Vouching.refused`
(peer/round/catchup.py).

A peer without history also needs its state to be as good as the records claim (issue #65, item
6): :func:`class_claims` gives each counted class's claimed loss, and a state more than the
catch-up's ``CLAIM_MARGIN`` above the best claim is refused as *outclaimed*
(:attr:`Vouching.outclaimed`). A claim is believed only while it is backed: a class whose own state
fails its checks, or cannot be downloaded when its claim is checked, is :attr:`Vouching.unbacked`
(its claims count no more) and the states it outclaimed may be tried again
(:meth:`Vouching.refuse`), so forged low claims delay a joiner by a download, no more.

What this cannot do: a cluster of identities that really completes all-reduces with this peer
(paying the bandwidth, passing the screening of peer/sync/screening.py) is vouched for from the
next round, and a majority of vouchers wins the rule (if its state passes the loss check). A
joiner has no history: identities that attest each other in their records are counted by it (see
peer/train/resync.py ``attested``), but their state is adopted only if its loss is within the
margin of the best backed claim, so capturing a joiner takes a state trained about as well as the
honest swarm's (or identities that outnumber it and train), not fresh keys alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

MIN_INNER_STEP_S = 1e-3
"""No inner step (forward, backward and AdamW over a whole batch, on any device this client runs)
completes in under a millisecond: the floor of a round's duration is H of them."""
SLACK_ROUNDS = 2
"""Rounds a peer may move beyond the time bound: a record published at a round boundary, just
after the first sight, and the reader's poll interval."""


class Ledger:
    """Peers this peer completed an all-reduce with (bytes exchanged), and the round that first happened.

    Only a sync that completed with every groupmate counts (none excluded, no piece averaged
    without one): then each of them sent and received its share of the payload.
    """

    def __init__(self) -> None:
        self._first: dict[str, int] = {}

    def record_group(self, round_: int, peer_ids: Iterable[str]) -> None:
        """Note that this peer completed the sync of ``round_`` with ``peer_ids`` (this peer's own id
        may be among them: it is a voucher of nothing, and ignored by the rule anyway).

        Raises:
            ValueError: ``round_`` is negative.
        """
        if round_ < 0:
            raise ValueError(f"round_ = {round_}: expected >= 0")
        for peer in peer_ids:
            first = self._first.get(peer)
            if first is None or round_ < first:
                self._first[peer] = round_

    def vouchers(self, round_: int) -> frozenset[str]:
        """Peers first seen in a completed group at a round < ``round_`` (seen for at least one round)."""
        return frozenset(p for p, first in self._first.items() if first < round_)

    def first_seen(self, peer_id: str) -> int | None:
        """The round of the first completed group with ``peer_id``, or None (never)."""
        return self._first.get(peer_id)

    def __len__(self) -> int:
        return len(self._first)

    def as_dict(self) -> dict[str, int]:
        """Peer id → round of the first completed group with it (for a checkpoint)."""
        return dict(self._first)

    def load(self, first: Mapping[str, int]) -> None:
        """Merge a ledger saved by :meth:`as_dict` (a restarted peer keeps its vouchers).

        Raises:
            ValueError: a peer id that is not a non-empty string or a round that is not an int >= 0;
                the ledger is left unchanged.
        """
        items = list(first.items())
        for peer, round_ in items:
            if (
                not isinstance(peer, str)
                or not peer
                or isinstance(round_, bool)
                or not isinstance(round_, int)
                or round_ < 0
            ):
                raise ValueError(f"ledger entry {peer!r}: {round_!r}: expected a peer id and a round >= 0")
        for peer, round_ in items:
            self.record_group(round_, [peer])


class RoundClock:
    """Bounds the round a peer may claim by the time since this reader first saw it.

    Peer ``p``, first seen at monotonic time ``t0`` claiming round ``r0``, may claim at time ``t``
    at most ``r0 + SLACK_ROUNDS + (t − t0) / min_round_s``. A record claiming more is ignored
    (:meth:`admit` returns False) and counted in :attr:`ignored`; the peer's first sight is kept,
    so it may claim a plausible round again later. On first sight any round is taken: a joiner
    cannot bound what it has never seen.

    Args:
        min_round_s: the shortest a round can be, s (H × :data:`MIN_INNER_STEP_S`).
        max_peers: peers remembered; past it the earliest seen is forgotten (its next claim is a
            first sight again), so a flood of fresh identities costs bounded memory.

    Raises:
        ValueError: ``min_round_s`` not above 0 or ``max_peers`` below 1.
    """

    def __init__(self, *, min_round_s: float, max_peers: int = 1 << 16):
        if not min_round_s > 0 or max_peers < 1:
            raise ValueError(f"min_round_s = {min_round_s!r}, max_peers = {max_peers!r}: expected > 0 and >= 1")
        self.min_round_s, self.max_peers = min_round_s, max_peers
        self._first: dict[str, tuple[float, int]] = {}
        self.ignored = 0
        """Records ignored for claiming a round faster than time allows."""
        self._warned: set[str] = set()

    def limit(self, peer_id: str, now: float | None = None) -> int | None:
        """The highest round ``peer_id`` may claim at ``now`` (monotonic s), or None if never seen."""
        first = self._first.get(peer_id)
        if first is None:
            return None
        now = time.monotonic() if now is None else now
        t0, r0 = first
        return r0 + SLACK_ROUNDS + int(max(0.0, now - t0) / self.min_round_s)

    def admit(self, peer_id: str, round_: int, now: float | None = None) -> bool:
        """Whether ``peer_id``'s claim of ``round_`` at ``now`` (monotonic s) is believable; the
        first claim seen of a peer always is (and starts its clock)."""
        now = time.monotonic() if now is None else now
        if peer_id not in self._first:
            if len(self._first) >= self.max_peers:
                del self._first[next(iter(self._first))]
            self._first[peer_id] = (now, round_)
            return True
        limit = self.limit(peer_id, now)
        assert limit is not None  # peer_id was seen (above)
        if round_ <= limit:
            return True
        self.ignored += 1
        if peer_id not in self._warned:  # once per peer: a liar republishes four times a round
            self._warned.add(peer_id)
            logger.warning("ignoring %s's record: it claims round %d, time allows at most %d", peer_id, round_, limit)
        return False


def class_claims(
    records: Iterable[Any], classes: Mapping[tuple[int, str], Sequence[str]]
) -> dict[tuple[int, str], float]:
    """The loss each class claims: the lower median of its members' ``claimed_loss``
    (protocol/records.py), in nats/token; classes none of whose members claims one are left out.

    Args:
        records: progress records (``peer.net.dht.PeerProgress``: ``peer_id``, ``record``).
        classes: (round, digest) → the member peer ids to read (the counted ones).
    """
    by_peer = {r.peer_id: r.record.claimed_loss for r in records}
    out: dict[tuple[int, str], float] = {}
    for key, members in classes.items():
        losses = sorted(v for p in members if (v := by_peer.get(p)) is not None)
        if losses:
            out[key] = losses[(len(losses) - 1) // 2]
    return out


class Vouching:
    """What one peer holds to judge the records its re-sync rule reads: its :class:`Ledger`, a
    :class:`RoundClock` and the digests whose downloaded state failed the sanity bounds.

    Args:
        min_round_s: the shortest a round can be, s (the round loop passes H × :data:`MIN_INNER_STEP_S`).
    """

    def __init__(self, *, min_round_s: float):
        self.ledger = Ledger()
        self.clock = RoundClock(min_round_s=min_round_s)
        self.refused: set[str] = set()
        """Digests whose state was refused once: not downloaded again (unless only outclaimed by a
        class whose claim then fell, :meth:`refuse`)."""
        self.unbacked: set[str] = set()
        """Digests whose records' claimed loss counts no more: their state was refused, or could not
        be downloaded when their claim was checked."""
        self.outclaimed: dict[str, str] = {}
        """Digest refused for a loss above another class's claim → that class's digest."""

    def refuse(self, digest: str, *, outclaimed_by: str | None = None) -> None:
        """Refuse ``digest``'s state: add it to :attr:`refused`. With ``outclaimed_by`` it was refused
        only for a loss above that class's claim (:attr:`outclaimed`); otherwise its own claim falls
        with it (:meth:`unback`)."""
        self.refused.add(digest)
        if outclaimed_by is not None:
            self.outclaimed[digest] = outclaimed_by
        else:
            self.unback(digest)

    def unback(self, digest: str) -> None:
        """Believe ``digest``'s claimed loss no more, and let the states refused only because of it
        be tried again (removed from :attr:`refused`)."""
        self.unbacked.add(digest)
        for refused, by in list(self.outclaimed.items()):
            if by == digest:
                del self.outclaimed[refused]
                self.refused.discard(refused)

    def screen(self, records: Iterable[Any], *, round_: int) -> tuple[list[Any], frozenset[str] | None]:
        """The records the rule may read, and the vouchers it counts, for a peer at ``round_``.

        Args:
            records: the other live peers' records (``peer.net.dht.PeerProgress``: ``peer_id``, ``record``).
            round_: this peer's round.

        Returns:
            The records without those of refused digests or of rounds the clock does not admit
            (ignored and counted), and :meth:`Ledger.vouchers` of ``round_``; None (no history:
            the joiner's rule) when the ledger is empty or none of its vouchers is among the records
            (a restarted peer, or the swarm turned over while this peer was away).
        """
        kept = [
            r
            for r in records
            if r.record.state_digest not in self.refused and self.clock.admit(r.peer_id, r.record.round)
        ]
        vouchers: frozenset[str] | None = self.ledger.vouchers(round_) if len(self.ledger) else None
        if vouchers is not None and not vouchers & {r.peer_id for r in kept}:
            vouchers = None
        return kept, vouchers
