"""The re-sync rule (peer/train/resync.py): which state a peer adopts from the swarm, and which
members of a class count (peer/state/vouching.py)."""

from peer.state.vouching import Ledger, RoundClock
from peer.train.resync import attested, resync_target

A, B, C = "a" * 32, "b" * 32, "c" * 32
EVERYONE = frozenset(f"p{i}" for i in range(10)) | {"racer"}
"""Vouchers: every peer of these tests completed a group with this one in an earlier round."""


def test_a_peer_behind_adopts_the_swarm():
    others = [("p1", 5, A), ("p2", 5, A)]
    assert resync_target(others, round_=3, digest=B, completed_with=["me"], vouchers=EVERYONE) == (5, A, ["p1", "p2"])


def test_a_diverged_peer_adopts_the_bigger_class_at_its_round():
    others = [("p1", 4, A), ("p2", 4, A), ("p3", 4, B)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"], vouchers=EVERYONE) == (4, A, ["p1", "p2"])


def test_the_bigger_class_keeps_its_state():
    others = [("p1", 4, A), ("p2", 4, B), ("p3", 4, B)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"], vouchers=EVERYONE) is None


def test_groupmates_that_have_not_published_yet_count_for_the_own_class():
    # p2 and p3 completed the round with this peer; their records still show the last round
    others = [("p1", 5, A), ("p4", 5, A), ("p2", 4, C), ("p3", 4, C)]
    assert resync_target(others, round_=5, digest=B, completed_with=["me", "p2", "p3"], vouchers=EVERYONE) is None


def test_a_tie_between_diverged_peers_goes_to_the_smaller_digest():
    assert resync_target([("p1", 4, A)], round_=4, digest=B, completed_with=["me"], vouchers=EVERYONE) == (4, A, ["p1"])
    assert resync_target([("p1", 4, B)], round_=4, digest=A, completed_with=["me"], vouchers=EVERYONE) is None


def test_a_split_swarm_settles_by_ties_between_single_holders_and_never_follows_one_ahead():
    """Every peer fell back to its own Δ (a round without a group): no class has two holders. A
    single holder at this round with a smaller digest is a tie (taken at a lower loss only); a
    single holder ahead is not followed; once two agree, the class of two is followed."""
    split = [("p1", 8, A), ("p2", 8, C)]
    target = resync_target(split, round_=8, digest=B, completed_with=["me"], vouchers=EVERYONE)
    assert target == (8, A, ["p1"]) and target.tie
    assert resync_target(split, round_=8, digest="0" * 32, completed_with=["me"], vouchers=EVERYONE) is None
    behind = resync_target(split, round_=6, digest=B, completed_with=["me"], vouchers=EVERYONE)
    assert behind is None  # two single holders ahead: neither is followed
    healed = [("p1", 8, A), ("p2", 8, A)]
    target = resync_target(healed, round_=6, digest=B, completed_with=["me"], vouchers=EVERYONE)
    assert target == (8, A, ["p1", "p2"]) and not target.tie
    # this peer agrees with a groupmate: no longer split, single holders are not considered
    assert resync_target(split, round_=8, digest=B, completed_with=["me", "p3"], vouchers=EVERYONE) is None


def test_peers_one_round_behind_are_ignored():
    others = [("p1", 3, A), ("p2", 3, A), ("p3", 3, A)]
    assert resync_target(others, round_=4, digest=B, completed_with=["me"], vouchers=EVERYONE) is None


def test_a_peer_that_raced_ahead_goes_back_to_the_majority():
    others = [("p1", 3, A), ("p2", 3, A)]
    assert resync_target(others, round_=6, digest=B, completed_with=["me"], vouchers=EVERYONE) == (3, A, ["p1", "p2"])


def test_a_lone_peer_ahead_is_not_followed():
    others = [("racer", 9, A), ("p2", 6, B)]
    assert resync_target(others, round_=6, digest=B, completed_with=["me", "p3"], vouchers=EVERYONE) is None


def test_peers_without_a_state_are_not_donors():
    assert resync_target([("p1", 7, "")], round_=0, digest=B, completed_with=["me"], vouchers=EVERYONE) is None


def test_noloco_follows_only_a_swarm_two_rounds_ahead():
    others = [("p1", 5, A), ("p2", 6, B)]
    kw = dict(digest=C, completed_with=["me"], vouchers=EVERYONE, algorithm="noloco")
    assert resync_target(others, round_=5, **kw) is None
    assert resync_target(others, round_=4, **kw) == (6, B, ["p2"])
    assert resync_target(others, round_=5, fresh=True, **kw) == (6, B, ["p2"])


def test_noloco_does_not_follow_one_peer_ahead_of_the_others():
    others = [("p1", 5, A), ("p2", 5, B), ("racer", 7, C)]
    kw = dict(digest="d" * 32, completed_with=["me"], vouchers=EVERYONE, algorithm="noloco")
    assert resync_target(others, round_=5, **kw) is None
    assert resync_target([("racer", 7, C)], round_=5, **kw) == (7, C, ["racer"])  # a swarm of one is the swarm


def test_noloco_adopts_the_median_peer_ahead_not_the_highest_claim():
    others = [("p1", 9, A), ("p2", 9, B), ("racer", 40, C)]
    kw = dict(digest="d" * 32, completed_with=["me"], vouchers=EVERYONE, algorithm="noloco")
    assert resync_target(others, round_=5, **kw) == (9, B, ["p2"])


def test_only_vouchers_count_for_a_peer_with_history():
    # four fresh identities (never in a group with this peer) and one real peer claim (5, A)
    others = [("p1", 5, A), *((f"fresh{i}", 5, A) for i in range(4)), ("p2", 4, B), ("p3", 4, B)]
    vouchers = {"p1", "p2", "p3"}
    assert resync_target(others, round_=4, digest=B, completed_with=["me", "p2", "p3"], vouchers=vouchers) is None
    # the same claim from vouchers is the swarm moving on
    assert resync_target(
        others, round_=4, digest=B, completed_with=["me"], vouchers=vouchers | {f"fresh{i}" for i in range(4)}
    ) == (5, A, ["fresh0", "fresh1", "fresh2", "fresh3", "p1"])


def test_a_peer_with_history_and_no_voucher_among_the_others_adopts_nothing():
    assert (
        resync_target([("p1", 9, A), ("p2", 9, A)], round_=3, digest=B, completed_with=["me"], vouchers=frozenset())
        is None
    )


def test_a_joiner_follows_a_single_class_even_unattested():
    assert resync_target([("lone", 7, A)], round_=0, digest=B, completed_with=["me"], vouchers=None) == (7, A, ["lone"])


def test_a_joiner_counts_only_mutually_attested_peers_between_several_classes():
    others = [("p1", 5, A), ("p2", 5, A), ("p3", 5, A), *((f"fake{i}", 6, C) for i in range(4))]
    mates = {"p1": ["p2", "p3"], "p2": ["p1", "p3"], "p3": ["p1", "p2"], "fake0": ["p1"]}  # p1 never names fake0
    assert resync_target(others, round_=0, digest=B, completed_with=["me"], vouchers=None, groupmates=mates) == (
        5,
        A,
        ["p1", "p2", "p3"],
    )
    # identities of one owner can attest each other: the bigger such cluster wins a joiner (the stated limit)
    sybils = {f"fake{i}": [f"fake{j}" for j in range(4) if j != i] for i in range(4)}
    assert resync_target(
        others, round_=0, digest=B, completed_with=["me"], vouchers=None, groupmates={**mates, **sybils}
    )[:2] == (6, C)


def test_the_ledger_vouches_from_the_round_after_the_first_group():
    ledger = Ledger()
    ledger.record_group(3, ["p1", "p2"])
    ledger.record_group(5, ["p2", "p3"])
    assert ledger.vouchers(3) == frozenset()
    assert ledger.vouchers(4) == {"p1", "p2"}
    assert ledger.vouchers(6) == {"p1", "p2", "p3"}
    assert ledger.first_seen("p2") == 3 and ledger.first_seen("p9") is None and len(ledger) == 3


def test_attestation_needs_both_statements_at_most_a_round_apart():
    statements = {
        "a": (4, ["b"]),
        "b": (5, ["a", "c"]),
        "c": (4, []),
        "d": (5, ["a"]),
        "e": (7, ["f"]),
        "f": (5, ["e"]),
    }
    assert attested(statements) == {"a", "b"}  # c names no one, a does not name d, e and f are two rounds apart
    assert attested({"a": (4, ["a"])}) == frozenset()  # naming itself proves nothing


def test_the_round_clock_ignores_a_jump_faster_than_rounds_can_go():
    clock = RoundClock(min_round_s=1.0)
    assert clock.admit("p", 10, now=100.0)  # first sight: any round
    assert clock.admit("p", 12, now=100.5)  # slack
    assert not clock.admit("p", 50, now=110.0)  # 40 rounds in 10 s of 1 s rounds
    assert clock.admit("p", 22, now=110.0)
    assert clock.ignored == 1


def test_the_round_clock_remembers_a_bounded_number_of_peers():
    clock = RoundClock(min_round_s=1.0, max_peers=2)
    for peer in ("a", "b", "c"):
        assert clock.admit(peer, 1, now=0.0)
    assert clock.limit("a") is None and clock.limit("c", now=0.0) == 3


def test_screening_drops_refused_digests_and_falls_back_to_the_joiners_rule_without_a_live_voucher():
    from types import SimpleNamespace as NS

    from peer.state.vouching import Vouching

    def rec(peer, round_, digest):
        return NS(peer_id=peer, record=NS(round=round_, state_digest=digest))

    v = Vouching(min_round_s=1.0)
    assert v.screen([rec("p1", 3, A)], round_=3)[1] is None  # no history
    v.ledger.record_group(1, ["p1"])
    v.refused.add(B)
    kept, vouchers = v.screen([rec("p1", 3, A), rec("p2", 3, B)], round_=3)
    assert [r.peer_id for r in kept] == ["p1"] and vouchers == {"p1"}
    assert v.screen([rec("p3", 3, A)], round_=3)[1] is None  # its only voucher is gone: no history here


def test_a_peer_that_serves_no_state_follows_the_dialable_swarm_even_behind_it():
    """A client-mode peer raced ahead alone; the dialable peer behind cannot download its state (it
    publishes no digest), so without deferring both would keep their own state for good."""
    from peer.train.resync import diloco_resync_target, noloco_resync_target

    others = [("open", 3, "b" * 32)]
    kwargs = dict(round_=40, digest="a" * 32, completed_with=("walled",), vouchers=None)
    assert diloco_resync_target(others, **kwargs) is None  # a dialable peer keeps its own (1 against 1)
    assert diloco_resync_target(others, **kwargs, defers=True) == (3, "b" * 32, ["open"])
    # a class exactly one round behind: after a round this peer completed alone, it steps back to it
    assert diloco_resync_target([("open", 39, "b" * 32)], **kwargs, defers=True) == (39, "b" * 32, ["open"])
    # ... but after a round completed with groupmates, they have not published the new round yet
    assert (
        diloco_resync_target([("open", 39, "b" * 32)], **dict(kwargs, completed_with=("walled", "open")), defers=True)
        is None
    )
    # the same state as its groupmates: nothing to adopt
    assert diloco_resync_target([("open", 40, "a" * 32)], **kwargs, defers=True) is None
    assert noloco_resync_target(others, round_=40, fresh=False, vouchers=None) is None
    assert noloco_resync_target(others, round_=40, fresh=False, vouchers=None, defers=True) == (3, "b" * 32, ["open"])
    # NoLoCo: with a counted peer at or ahead of its round, it does not go back
    assert (
        noloco_resync_target(
            [*others, ("peer", 40, "c" * 32)], round_=40, fresh=False, vouchers={"open", "peer"}, defers=True
        )
        is None
    )
    assert noloco_resync_target(others, round_=40, fresh=False, vouchers={"open"}, defers=True) == (
        3,
        "b" * 32,
        ["open"],
    )
