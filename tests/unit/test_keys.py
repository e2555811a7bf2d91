"""protocol.keys: the DHT keys under which a round's groupmates meet."""

import pytest

from protocol.keys import round_group_bits


def test_retries_of_a_round_meet_under_their_own_key():
    first, retry = round_group_bits(7), round_group_bits(7, attempt=1)
    assert retry.startswith(first) and retry != first
    # a retry key never equals the key of a random group (NoLoCo) of the same round
    assert all(round_group_bits(7, group_index=g) != retry for g in range(16))
    assert round_group_bits(7, group_index=3, attempt=1) != round_group_bits(7, group_index=3)


def test_each_fragment_sync_of_a_round_meets_under_its_own_key():
    from protocol.keys import sync_index

    keys = {round_group_bits(sync_index(r, f, 3)) for r in range(4) for f in range(3)}
    assert len(keys) == 12  # no two (round, fragment) syncs share a key
    assert sync_index(5) == 5 and sync_index(2, 1, 3) == 7
    with pytest.raises(ValueError, match="fragment = 3"):
        sync_index(0, 3, 3)
