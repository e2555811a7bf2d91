"""Routing of micro-batches to the replicas of the next pipeline stage (peer/pipeline/routing.py)."""

import pickle
from collections import Counter

import pytest

from peer.pipeline.routing import NoReplica, Router, routing_seed, stage_to_serve
from protocol.errors import LocoError

REPLICAS = ["peer-a", "peer-b", "peer-c"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(rule: str, clock: FakeClock | None = None, **kwargs) -> Router:
    return Router(rule, run_id="run", stage=1, clock=clock or FakeClock(), **kwargs)


def test_random_rule_is_the_same_on_every_peer_and_ignores_listing_order():
    one, two = router("random"), router("random")
    for step in range(5):
        for mb in range(7):
            first = one.order(REPLICAS, step=step, micro_batch=mb)
            assert sorted(first) == sorted(REPLICAS)
            assert first == two.order(list(reversed(REPLICAS)) + REPLICAS[:1], step=step, micro_batch=mb)


def test_random_rule_redraws_across_steps_and_seeds():
    many = [f"peer{i}" for i in range(8)]
    r = router("random")
    per_step = {tuple(r.order(many, step=step, micro_batch=0)) for step in range(10)}
    assert len(per_step) > 5
    assert r.order(many, step=0, micro_batch=0) != Router("random", run_id="other-run", stage=1).order(
        many, step=0, micro_batch=0
    )
    assert routing_seed(run_id="run", stage=1, step=0, block=0) != routing_seed(run_id="run", stage=2, step=0, block=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 10, 31])
def test_random_rule_balances_a_block_of_micro_batches(n):
    counts = Counter(router("random").order(REPLICAS, step=4, micro_batch=mb)[0] for mb in range(n))
    r = len(REPLICAS)
    assert sum(counts.values()) == n
    assert all(n // r <= counts[p] <= -(-n // r) for p in REPLICAS), counts


def test_random_rule_mixes_replicas_over_blocks():
    # every replica is first choice for micro-batch 0 in some step: no sender sticks to one receiver
    firsts = {router("random").order(REPLICAS, step=step, micro_batch=0)[0] for step in range(30)}
    assert firsts == set(REPLICAS)


def test_fastest_prefers_the_faster_replica_and_spreads_by_calls_in_flight():
    r = router("fastest")
    r.started("peer-a"), r.finished("peer-a", 1.0)
    r.started("peer-b"), r.finished("peer-b", 3.0)
    assert r.order(["peer-a", "peer-b"], step=0, micro_batch=0) == ["peer-a", "peer-b"]
    # (in_flight + 1) x ema: a at 1 s with 2 in flight costs 3 s, ties b at 3 s; 3 in flight costs 4 s
    r.started("peer-a"), r.started("peer-a"), r.started("peer-a")
    assert r.in_flight("peer-a") == 3
    assert r.order(["peer-a", "peer-b"], step=0, micro_batch=0) == ["peer-b", "peer-a"]
    r.finished("peer-a", 1.0)
    r.finished("peer-a", 1.0)
    assert r.order(["peer-a", "peer-b"], step=0, micro_batch=0)[0] == "peer-a"


def test_fastest_moving_average_and_prior_for_unseen_replicas():
    r = router("fastest", default_seconds=2.5, ema=0.5)
    assert r.seconds_per_batch("peer-x") == 2.5
    r.finished("peer-a", 1.0)
    r.finished("peer-a", 3.0)
    assert r.seconds_per_batch("peer-a") == pytest.approx(2.0)  # 0.5 x 1 + 0.5 x 3
    r.finished("peer-b", 4.0)
    assert r.seconds_per_batch("peer-c") == pytest.approx(3.0)  # mean of a (2.0) and b (4.0)
    assert r.order(REPLICAS, step=0, micro_batch=0) == ["peer-a", "peer-c", "peer-b"]
    assert r.in_flight("peer-a") == 0  # a finished without a started never goes negative


def test_fastest_ties_are_deterministic_and_spread_across_micro_batches():
    one, two = router("fastest"), router("fastest")
    firsts = []
    for mb in range(6):
        order = one.order(REPLICAS, step=2, micro_batch=mb)
        assert order == two.order(list(reversed(REPLICAS)), step=2, micro_batch=mb)
        firsts.append(order[0])
    assert set(firsts) == set(REPLICAS)  # unseen replicas tie: the shared random order breaks it


@pytest.mark.parametrize("rule", ["random", "fastest"])
def test_a_failed_replica_is_skipped_during_its_cooldown(rule):
    clock = FakeClock()
    r = router(rule, clock, cooldown_s=30.0)
    full = r.order(REPLICAS, step=0, micro_batch=0)
    first = full[0]
    r.started(first)
    r.failed(first, "timeout")
    assert r.in_flight(first) == 0
    clock.now += 29.9
    assert r.order(REPLICAS, step=0, micro_batch=0) == full[1:]
    clock.now += 0.1
    assert r.order(REPLICAS, step=0, micro_batch=0) == full


@pytest.mark.parametrize("rule", ["random", "fastest"])
def test_no_live_replica_raises_no_replica(rule):
    clock = FakeClock()
    r = router(rule, clock)
    with pytest.raises(NoReplica, match="no live replica of pipeline stage 1: the pipeline pauses"):
        r.order([], step=0, micro_batch=0)
    for peer in REPLICAS:
        r.failed(peer, "connection refused")
    with pytest.raises(NoReplica, match=r"stage 1 \(3 cooling down") as info:
        r.order(REPLICAS, step=0, micro_batch=0)
    assert isinstance(info.value, LocoError) and info.value.stage == 1
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.stage == 1


def test_stage_to_serve_picks_the_fewest_replicas_lowest_index_on_ties():
    assert stage_to_serve({0: 3, 1: 1, 2: 2}, 3) == 1
    assert stage_to_serve({0: 2, 1: 1, 2: 1}, 3) == 1
    assert stage_to_serve({0: 2, 2: 1}, 3) == 1  # a stage nobody serves has 0
    assert stage_to_serve({}, 4) == 0
    assert stage_to_serve({0: 0, 1: 5}, 2, requested=1) == 1


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stage_to_serve({}, 0), "stages = 0"),
        (lambda: stage_to_serve({3: 1}, 3), "stage 3 in live_replicas"),
        (lambda: stage_to_serve({0: -1}, 2), r"live_replicas\[0\] = -1"),
        (lambda: stage_to_serve({}, 2, requested=2), "requested stage = 2"),
        (lambda: Router("round-robin", run_id="r", stage=0), "pipeline.routing = 'round-robin'"),
        (lambda: Router("random", run_id="r", stage=-1), "stage = -1"),
        (lambda: Router("random", run_id="r", stage=0, cooldown_s=-1.0), "cooldown_s = -1.0"),
        (lambda: Router("fastest", run_id="r", stage=0, default_seconds=0.0), "default_seconds = 0.0"),
        (lambda: Router("fastest", run_id="r", stage=0, ema=1.5), "ema = 1.5"),
        (lambda: router("random").order(REPLICAS, step=-1, micro_batch=0), "step = -1"),
        (lambda: router("random").order(REPLICAS, step=0, micro_batch=-2), "micro_batch = -2"),
        (lambda: router("fastest").finished("peer-a", float("nan")), "seconds = nan"),
    ],
)
def test_bad_inputs_raise_with_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
