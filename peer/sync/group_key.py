"""Group bits stay as locoswarm set them: hivemind's re-keying after each assembled group is off.

hivemind moves a peer to a new bucket after every group (``GroupKeyManager.
update_key_on_group_assembled``) by drawing ``group_size`` distinct buckets out of
``target_group_size``. locoswarm sets ``target_group_size`` per round (``LocoAverager.
configure_round``: the live peers this peer sees), and a groupmate that sees more peers can lead a
bigger group, so the draw fails with ``ValueError: Sample larger than population`` and the step
with it. The draw is also useless here: the round loop sets the group bits itself before every
step (``protocol.keys.round_group_bits`` in ``NetworkTransport._attempt``), so whatever hivemind
wrote would be overwritten unread.
"""

from __future__ import annotations

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager


class PinnedGroupKeyManager(GroupKeyManager):
    """A GroupKeyManager whose group bits change only when they are set (``set_group_bits``)."""

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
