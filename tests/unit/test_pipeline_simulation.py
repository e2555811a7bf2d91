"""lab/pipeline.py: S stages × R replicas in one process, per-stage outer sync (issue #19)."""

from __future__ import annotations

import pytest

from lab.engine_sim import run_engine_simulation
from lab.pipeline import run_pipeline
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def manifest(stages: int, algorithm: str = "diloco", routing: str = "random", dtype: str = "bf16"):
    return tiny_run().replace(
        model={"num_layers": 2},
        sync={"algorithm": algorithm, "inner_steps": 10},
        pipeline={"stages": stages, "routing": routing, "activation_dtype": dtype},
    )


def test_one_stage_is_the_unpipelined_swarm(corpus):
    """S = 1: the same shards, the same AdamW, the same outer step: the same losses as the swarm's
    round loops on the engine (lab/engine_sim.py), and nothing crosses a stage boundary."""
    piped = run_pipeline(manifest(1), corpus, replicas=2, rounds=2, seed=manifest(1).model.init_seed)
    m = manifest(1)
    plain = run_engine_simulation(m, corpus, peers=2, rounds=2, seed=m.model.init_seed, timeout_s=240.0)
    assert piped.activation_bytes_per_token == 0
    assert [p.tokens for p in piped.history] == [p.tokens for p in plain.history]
    assert [p.loss_bpb for p in piped.history] == pytest.approx([p.loss_bpb for p in plain.history], rel=1e-4)


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_two_stages_train_and_send_bf16_activations_both_ways(corpus, algorithm):
    result = run_pipeline(manifest(2, algorithm), corpus, replicas=2, rounds=2, seed=0)
    first, last = result.history[0], result.history[-1]
    assert last.loss_bpb < first.loss_bpb - 0.2
    # one boundary: hidden (32) bf16 forward and back, plus the int32 target: 2·32·2 + 4 bytes per token
    assert result.activation_bytes_per_token == pytest.approx(2 * 32 * 2 + 4)
    if algorithm == "diloco":
        assert last.sigma == 0  # a stage's replicas leave each round with one φ
    fp32 = run_pipeline(manifest(2, algorithm, dtype="fp32"), corpus, replicas=2, rounds=1, seed=0)
    assert fp32.activation_bytes_per_token == pytest.approx(2 * 32 * 4 + 4)


def test_fastest_routing_trains_too(corpus):
    result = run_pipeline(manifest(2, routing="fastest"), corpus, replicas=2, rounds=1, seed=0)
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb


@pytest.mark.parametrize("routing", ["random", "fastest"])
def test_every_replica_of_a_stage_serves_a_step_of_concurrent_micro_batches(corpus, routing):
    """R micro-batches in flight at once over R replicas: 'random' deals a permutation, 'fastest'
    spreads them by calls in flight (SWARM), so every replica steps on one micro-batch."""
    from lab.pipeline import PipelineSimulation

    sim = PipelineSimulation(manifest(2, routing=routing), corpus, replicas=3, seed=0)
    for _ in range(4):
        paths = [sim._route(r) for r in range(3)]
        assert sorted(p[1] for p in paths) == [0, 1, 2]
        for p in paths:
            sim.routers[1].finished(sim.ids[1][p[1]], 0.01)
        sim.inner_step += 1
