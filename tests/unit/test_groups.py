"""The group plan (protocol/groups.py) and the outer algorithms' choice of group and re-sync rule."""

import torch

from peer.train.outer import DiLoCo, Independent, NoLoCo
from protocol.groups import SEED_MODULUS, codec_seed, group_of, partition, plan_groups
from protocol.manifest import NoLoCoSpec, OuterOptimizerSpec

SHAPES = [torch.Size([2, 3])]


def test_partition_never_pairs_a_peer_with_itself_and_redraws_partners():
    peers = [f"peer{i}" for i in range(8)]
    met = {p: set() for p in peers}
    for round_ in range(20):
        groups = partition(peers + peers[:2], run_id="run", round_=round_, group_size=2)
        assert sorted(p for g in groups for p in g) == sorted(peers)
        for group in groups:
            assert len(set(group)) == len(group) == 2
            for p in group:
                met[p].update(set(group) - {p})
        # every peer computes the same groups from the same view
        assert groups == partition(list(reversed(peers)), run_id="run", round_=round_, group_size=2)
    assert all(len(partners) >= 3 for partners in met.values()), met


def test_partition_leftover_and_lookup():
    groups = partition(["a", "b", "c"], run_id="r", round_=0, group_size=2)
    assert sorted(map(len, groups)) == [1, 2]
    index, members = group_of("c", groups)
    assert "c" in members and groups[index] == members
    assert group_of("zz", groups) == (-1, ["zz"])


def test_plan_groups_per_algorithm():
    peers = ["c", "a", "b", "a"]
    assert plan_groups(peers, algorithm="diloco", run_id="r", round_=3, group_size=2) == [["a", "b", "c"]]
    assert plan_groups(peers, algorithm="independent", run_id="r", round_=3, group_size=2) == [["a"], ["b"], ["c"]]
    assert plan_groups(peers, algorithm="noloco", run_id="r", round_=3, group_size=2) == partition(
        peers, run_id="r", round_=3, group_size=2
    )


def test_plan_groups_names_an_unknown_algorithm():
    try:
        plan_groups(["a"], algorithm="gossip", run_id="r", round_=0, group_size=2)
    except ValueError as exc:
        assert "gossip" in str(exc)
    else:
        raise AssertionError("an unknown algorithm was accepted")


def test_codec_seed_is_shared_and_bounded():
    assert codec_seed(3, 7) == codec_seed(3, 7) == 3 * 1_000_003 + 7
    assert 0 <= codec_seed(10**9, 5) < SEED_MODULUS
    assert codec_seed(4, 0) != codec_seed(5, 0)


def test_diloco_syncs_with_every_live_peer_whatever_its_round():
    outer = DiLoCo(SHAPES, OuterOptimizerSpec())
    choice = outer.choose_group("me", round_=5, live=[("p1", 5), ("p2", 1)], run_id="r")
    assert (choice.expected_size, choice.index, choice.members) == (3, None, None)
    alone = outer.choose_group("me", round_=5, live=[], run_id="r")
    assert alone.expected_size == 1 and "alone" in alone.note


def test_noloco_groups_only_peers_within_one_round_and_all_draw_the_same():
    outer = NoLoCo(SHAPES, NoLoCoSpec())
    live = {"me": 5, "p1": 5, "p2": 4, "p3": 6, "far": 9}
    choices = {
        me: outer.choose_group(me, round_=5, live=[(p, r) for p, r in live.items() if p != me], run_id="r")
        for me in ("me", "p1")
    }
    mine = choices["me"]
    groups = plan_groups(["me", "p1", "p2", "p3"], algorithm="noloco", run_id="r", round_=5, group_size=2)
    assert mine.members == tuple(group_of("me", groups)[1]) and mine.index == group_of("me", groups)[0]
    assert "far" not in mine.members
    assert choices["p1"].members == tuple(group_of("p1", groups)[1])


def test_independent_never_syncs_nor_adopts():
    outer = Independent(SHAPES)
    assert outer.choose_group("me", round_=0, live=[("p1", 0)], run_id="r").expected_size == 1
    assert (
        outer.resync_target(
            [("p1", 9, "a" * 32)], round_=0, digest="b" * 32, completed_with=["me"], fresh=True, vouchers=None
        )
        is None
    )


def test_payload_shapes_and_phi_offset():
    assert DiLoCo(SHAPES, OuterOptimizerSpec()).payload_shapes(SHAPES) == SHAPES
    assert DiLoCo(SHAPES, OuterOptimizerSpec()).phi_from(1) is None
    assert NoLoCo(SHAPES, NoLoCoSpec()).payload_shapes(SHAPES) == SHAPES * 2
    assert NoLoCo(SHAPES, NoLoCoSpec()).phi_from(1) == 1
