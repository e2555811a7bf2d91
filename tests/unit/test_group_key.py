"""peer.sync.group_key: a group bigger than this peer's target leaves the group bits as set; a peer
waiting for a leader looks the group key up a few times a second, not hundreds.

hivemind's own key manager draws one bucket per groupmate out of ``target_group_size`` buckets, so
a groupmate that leads a group bigger than this peer's target (it sees more live peers) made the
step fail with ``ValueError: Sample larger than population``.
"""

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID

from peer.sync.group_key import LOOKUP_INTERVAL_S, PinnedGroupBits, PinnedGroupKeyManager
from protocol import keys

PEERS = [PeerID(f"peer-{i}".encode()) for i in range(3)]
BITS = keys.round_group_bits(7)


def group_of_three() -> GroupInfo:
    return GroupInfo(group_id=b"g" * 32, peer_ids=tuple(PEERS), gathered=(b"",) * 3)


def manager(cls=GroupKeyManager, target_group_size: int = 2) -> GroupKeyManager:
    dht = SimpleNamespace(peer_id=PEERS[1])
    return cls(dht, "locoswarm_diloco_run", BITS, target_group_size)


def test_hivemind_key_manager_fails_on_a_group_bigger_than_its_target():
    with pytest.raises(ValueError, match="Sample larger than population"):
        asyncio.run(manager().update_key_on_group_assembled(group_of_three()))


def test_pinned_key_manager_keeps_the_bits_of_a_bigger_group():
    pinned = manager(PinnedGroupKeyManager)
    asyncio.run(pinned.update_key_on_group_assembled(group_of_three()))
    assert pinned.group_bits == BITS
    assert pinned.current_key == f"locoswarm_diloco_run.0b{BITS}"


def test_bits_set_by_the_round_loop_stay_after_a_group():
    pinned = manager(PinnedGroupKeyManager)
    pinned.group_bits = keys.round_group_bits(8, attempt=1)
    asyncio.run(pinned.update_key_on_group_assembled(group_of_three()))
    assert pinned.group_bits == keys.round_group_bits(8, attempt=1)


class Averager(PinnedGroupBits):
    """Stands in for LocoAverager: hivemind assigns ``self._matchmaking`` in the averager process."""


def test_the_averager_pins_the_key_manager_hivemind_creates():
    averager = Averager()
    with pytest.raises(AttributeError):
        _ = averager._matchmaking  # before the averager process started matchmaking
    original = manager(target_group_size=4)
    matchmaking = SimpleNamespace(group_key_manager=original)
    averager._matchmaking = matchmaking
    assert averager._matchmaking is matchmaking
    pinned = matchmaking.group_key_manager
    assert isinstance(pinned, PinnedGroupKeyManager)
    assert (pinned.prefix, pinned.group_bits, pinned.target_group_size, pinned.peer_id) == (
        "locoswarm_diloco_run",
        BITS,
        4,
        PEERS[1],
    )
    pinned.target_group_size = 2  # as LocoAverager.configure_round sets it for a smaller round
    asyncio.run(pinned.update_key_on_group_assembled(group_of_three()))
    assert pinned.group_bits == BITS


class CountingDHT:
    """The DHT a key manager looks up through: every group key is empty; counts the gets."""

    def __init__(self):
        self.peer_id = PEERS[1]
        self.gets = 0

    async def get(self, key, latest: bool, return_future: bool):
        self.gets += 1
        return None


def lookups_while_waiting_for_a_leader(cls, seconds: float) -> int:
    """Gets a hivemind matchmaking search (its own ``PotentialLeaders``) makes in ``seconds`` under a
    key no other averager declared: it waits for a leader that never comes."""
    dht = CountingDHT()
    key_manager = cls(dht, "locoswarm_diloco_run", BITS, 2)
    leaders = PotentialLeaders(PEERS[1], min_matchmaking_time=1.0, target_group_size=2)

    async def search() -> None:
        async with leaders.begin_search(SimpleNamespace(deadline=None), key_manager, declare=False):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(leaders.pop_next_leader(), seconds)

    asyncio.run(search())
    return dht.gets


def test_hivemind_looks_the_key_up_again_as_soon_as_a_lookup_comes_back():
    assert lookups_while_waiting_for_a_leader(GroupKeyManager, 1.0) > 100


def test_pinned_key_manager_spaces_its_lookups():
    gets = lookups_while_waiting_for_a_leader(PinnedGroupKeyManager, 1.0)
    assert 2 <= gets <= 1.0 / LOOKUP_INTERVAL_S + 1
