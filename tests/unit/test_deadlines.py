"""Adaptive sync deadlines (peer/sync/deadlines.py)."""

import math

import pytest

from peer.sync.deadlines import WINDOW, DeadlinePolicy
from protocol.errors import ManifestError
from protocol.manifest import SyncSpec


def test_before_any_round_the_manifest_values_are_used():
    d = DeadlinePolicy(SyncSpec(matchmaking_time_s=4.0, allreduce_timeout_s=50.0)).current()
    assert (d.matchmaking_s, d.matchmaking_deadline_s, d.allreduce_s) == (4.0, 12.0, 50.0)
    assert d.total_s == 12.0 + 50.0 + 5.0


def test_deadlines_follow_the_observed_rounds_within_bounds():
    policy = DeadlinePolicy(SyncSpec(matchmaking_time_s=5.0, allreduce_timeout_s=60.0, next_chunk_timeout_s=2.0))
    policy.observe(wait_s=0.6, allreduce_s=4.0)
    d = policy.current()
    assert math.isclose(d.matchmaking_s, 1.5 * 0.6 + 0.5)
    assert math.isclose(d.allreduce_s, 3 * 4.0 + 2.0)
    policy.observe(wait_s=0.0, allreduce_s=0.1)  # the window keeps the slowest recent round
    assert math.isclose(policy.current().allreduce_s, 14.0)
    policy.observe(wait_s=10.0, allreduce_s=100.0)  # clamped to the manifest's maximum
    assert (policy.current().matchmaking_s, policy.current().allreduce_s) == (5.0, 60.0)


def test_fast_rounds_are_clamped_to_the_minimum_and_old_rounds_are_forgotten():
    policy = DeadlinePolicy(SyncSpec(min_matchmaking_time_s=1.0, min_allreduce_timeout_s=8.0, next_chunk_timeout_s=0.5))
    policy.observe(wait_s=30.0, allreduce_s=1.0)
    for _ in range(WINDOW):
        policy.observe(wait_s=0.0, allreduce_s=0.0)
    d = policy.current()
    assert (d.matchmaking_s, d.allreduce_s) == (1.0, 8.0)


def test_the_all_reduce_deadline_leaves_time_to_detect_a_hung_groupmate():
    policy = DeadlinePolicy(SyncSpec(next_chunk_timeout_s=5.0, min_allreduce_timeout_s=5.0, allreduce_timeout_s=60.0))
    policy.observe(wait_s=0.1, allreduce_s=0.5)
    assert policy.current().allreduce_s == 2 * 5.0 + 5.0


def test_adaptation_can_be_turned_off():
    policy = DeadlinePolicy(SyncSpec(adaptive_deadlines=False))
    policy.observe(wait_s=0.1, allreduce_s=0.1)
    assert policy.current() == policy.worst_case()


@pytest.mark.parametrize("wait_s, allreduce_s", [(-1.0, 1.0), (1.0, float("nan")), (float("inf"), 1.0)])
def test_bad_observations_are_refused(wait_s, allreduce_s):
    with pytest.raises(ValueError, match="expected a finite duration"):
        DeadlinePolicy(SyncSpec()).observe(wait_s=wait_s, allreduce_s=allreduce_s)


def test_a_minimum_above_the_maximum_is_a_manifest_error():
    with pytest.raises(ManifestError, match="min_matchmaking_time_s"):
        SyncSpec(matchmaking_time_s=0.5)


def test_a_missed_group_widens_the_next_window_until_the_bound():
    """The expected groupmates arrived after the window closed: the next window is 1.5× + 0.5 s,
    again after each miss, never beyond the manifest's matchmaking_time_s; successes then narrow it."""
    policy = DeadlinePolicy(SyncSpec(matchmaking_time_s=10.0, min_matchmaking_time_s=1.0, next_chunk_timeout_s=1.0))
    policy.observe(wait_s=1.0, allreduce_s=1.0)
    windows = []
    for _ in range(5):
        d = policy.current()
        windows.append(d.matchmaking_s)
        policy.observe_missed_group(d.matchmaking_s)
    assert windows[:3] == [2.0, 3.5, 5.75] and windows[-1] == 10.0
    for _ in range(WINDOW):
        policy.observe(wait_s=0.2, allreduce_s=1.0)
    assert policy.current().matchmaking_s == 1.0  # 1.5 × 0.2 + 0.5, clamped to the minimum
    with pytest.raises(ValueError):
        policy.observe_missed_group(-1.0)


def test_the_window_covers_a_groupmate_predicted_to_arrive_within_the_bound():
    from peer.sync.deadlines import ARRIVAL_MARGIN_S

    policy = DeadlinePolicy(SyncSpec(matchmaking_time_s=5.0, min_matchmaking_time_s=1.0))
    policy.observe(wait_s=0.0, allreduce_s=1.0)  # a start barrier: everyone arrived at once
    assert policy.current().matchmaking_s == 1.0
    d = policy.current(expected_wait_s=2.0)
    assert d.matchmaking_s == 2.0 + ARRIVAL_MARGIN_S and d.matchmaking_deadline_s == 3 * d.matchmaking_s
    assert policy.current(expected_wait_s=60.0).matchmaking_s == 5.0  # never past the manifest's bound
    policy.observe(wait_s=2.0, allreduce_s=1.0)
    assert policy.current(expected_wait_s=0.1).matchmaking_s == 1.5 * 2.0 + 0.5  # history still counts


def test_a_background_sync_waits_its_budget_plus_the_manifests_bound():
    policy = DeadlinePolicy(SyncSpec(matchmaking_time_s=2.0, min_matchmaking_time_s=1.0))
    assert policy.current(wait_budget_s=5.0).matchmaking_s == 5.0 + 2.0  # no history yet
    policy.observe(wait_s=0.0, allreduce_s=1.0)
    assert policy.current(expected_wait_s=4.0).matchmaking_s == 2.0  # blocking: the bound
    d = policy.current(expected_wait_s=4.0, wait_budget_s=10.0)
    assert d.matchmaking_s == 12.0 and d.matchmaking_deadline_s == 36.0  # background: budget + bound
    assert policy.current(wait_budget_s=0.5).matchmaking_s == 2.5
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="wait_budget_s"):
            policy.current(wait_budget_s=bad)
