"""protocol.keys: the DHT keys under which a round's groupmates meet."""

from protocol.keys import round_group_bits


def test_retries_of_a_round_meet_under_their_own_key():
    first, retry = round_group_bits(7), round_group_bits(7, attempt=1)
    assert retry.startswith(first) and retry != first
    # a retry key never equals the key of a random group (NoLoCo) of the same round
    assert all(round_group_bits(7, group_index=g) != retry for g in range(16))
    assert round_group_bits(7, group_index=3, attempt=1) != round_group_bits(7, group_index=3)
