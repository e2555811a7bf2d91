"""The re-sync rule (peer/state/resync.py): which state a peer adopts from the swarm."""

from peer.state.resync import resync_target

A, B = "a" * 32, "b" * 32


def test_a_peer_behind_adopts_the_swarm():
    others = [("p1", 5, A), ("p2", 5, A)]
    assert resync_target(others, round_=3, digest=B, completed_with=["me"]) == (5, A, ["p1", "p2"])


def test_a_diverged_peer_adopts_the_bigger_class_at_its_round():
    others = [("p1", 4, A), ("p2", 4, A), ("p3", 4, B)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"]) == (4, A, ["p1", "p2"])


def test_the_bigger_class_keeps_its_state():
    others = [("p1", 4, A), ("p2", 4, B), ("p3", 4, B)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"]) is None


def test_groupmates_that_have_not_published_yet_count_for_the_own_class():
    # p2 and p3 completed the round with this peer; their records still show the last round
    others = [("p1", 5, A), ("p4", 5, A), ("p2", 4, "c" * 32), ("p3", 4, "c" * 32)]
    assert resync_target(others, round_=5, digest=B, completed_with=["me", "p2", "p3"]) is None


def test_a_tie_between_diverged_peers_goes_to_the_smaller_digest():
    assert resync_target([("p1", 4, A)], round_=4, digest=B, completed_with=["me"]) == (4, A, ["p1"])
    assert resync_target([("p1", 4, B)], round_=4, digest=A, completed_with=["me"]) is None


def test_peers_one_round_behind_are_ignored():
    others = [("p1", 3, A), ("p2", 3, A), ("p3", 3, A)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"]) is None


def test_a_peer_that_raced_ahead_goes_back_to_the_majority():
    others = [("p1", 3, A), ("p2", 3, A)]
    assert resync_target(others, round_=6, digest=B, completed_with=["me"]) == (3, A, ["p1", "p2"])


def test_a_lone_peer_ahead_is_not_followed():
    others = [("racer", 9, A), ("p2", 6, B)]
    assert resync_target(others, round_=6, digest=B, completed_with=["me", "p3"]) is None


def test_peers_without_a_state_are_not_donors():
    assert resync_target([("p1", 7, "")], round_=0, digest=B, completed_with=["me"]) is None


def test_noloco_follows_only_a_swarm_two_rounds_ahead():
    others = [("p1", 5, A), ("p2", 6, B)]
    assert resync_target(others, round_=5, digest="c" * 32, completed_with=["me"], algorithm="noloco") is None
    assert resync_target(others, round_=4, digest="c" * 32, completed_with=["me"],
                         algorithm="noloco") == (6, B, ["p2"])
    assert resync_target(others, round_=5, digest="c" * 32, completed_with=["me"], algorithm="noloco",
                         fresh=True) == (6, B, ["p2"])
