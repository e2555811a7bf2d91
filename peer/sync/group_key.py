"""hivemind's group key manager, changed twice: the group bits stay as locoswarm set them, and the
group key's averagers are looked up at most every :data:`LOOKUP_INTERVAL_S`.

Group bits: hivemind's re-keying after each assembled group is off.

hivemind moves a peer to a new bucket after every group (``GroupKeyManager.
update_key_on_group_assembled``) by drawing ``group_size`` distinct buckets out of
``target_group_size``. locoswarm sets ``target_group_size`` per round (``LocoAverager.
configure_round``: the live peers this peer sees), and a groupmate that sees more peers can lead a
bigger group, so the draw fails with ``ValueError: Sample larger than population`` and the step
with it. The draw is also useless here: the round loop sets the group bits itself before every
step (``protocol.keys.round_group_bits`` in ``NetworkTransport._attempt``), so whatever hivemind
wrote would be overwritten unread.

Lookups: hivemind's matchmaking (``PotentialLeaders.pop_next_leader``) asks for a new lookup of the
group key as soon as the last one came back whenever it has no leader to try: an empty queue, or
only peers that would follow this one. The peer that ends up leading a group, and every peer alone
under its key, so looked the key up hundreds of times a second for its whole matchmaking time,
each lookup a DHT get to its neighbours: ~4,400 packets and 0.5 MB a second on a two-peer swarm
here, none of it under ``--max-upload-mbit`` (the DHT's RPCs are not paced).
"""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager

LOOKUP_INTERVAL_S = 0.25
"""Least time between the starts of two lookups of the group key's averagers (s): a follower finds
a leader that declared itself at most this much later than it could have; a peer waiting for
followers makes four DHT gets a second. Matchmaking lasts at least ``min_matchmaking_time_s``
(1 s by default)."""


class PinnedGroupKeyManager(GroupKeyManager):
    """A GroupKeyManager whose group bits change only when they are set (``set_group_bits``), and
    whose lookups (:meth:`get_averagers`) start at least :data:`LOOKUP_INTERVAL_S` apart."""

    _last_lookup = float("-inf")
    """``time.monotonic()`` when the last lookup started (s)."""

    async def get_averagers(self, group_key, only_active):
        """hivemind's lookup, started no sooner than :data:`LOOKUP_INTERVAL_S` after the last one
        (the wait is an ``asyncio.sleep``: cancelling the search cancels it)."""
        wait = self._last_lookup + LOOKUP_INTERVAL_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_lookup = time.monotonic()
        return await super().get_averagers(group_key, only_active)

    async def update_key_on_group_assembled(self, group_info: GroupInfo) -> None:
        """Keep the group bits: the next step's are set by the round loop (module docstring)."""

    @classmethod
    def adopt(cls, manager: GroupKeyManager) -> PinnedGroupKeyManager:
        """A pinned manager with ``manager``'s state (DHT, prefix, bits, target size, peer id)."""
        pinned = cls.__new__(cls)
        pinned.__dict__.update(vars(manager))
        return pinned


class PinnedGroupBits:
    """Mixin for a hivemind ``DecentralizedAverager``: when hivemind creates its Matchmaking (in the
    averager process), the Matchmaking's key manager is replaced by a :class:`PinnedGroupKeyManager`.

    hivemind builds the Matchmaking inside ``_run_internal`` with no hook for its key manager, so
    the assignment to ``self._matchmaking`` is where it can be swapped.
    """

    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking: the averager process has not started matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        matchmaking.group_key_manager = PinnedGroupKeyManager.adopt(matchmaking.group_key_manager)
        self.__dict__["_matchmaking"] = matchmaking
