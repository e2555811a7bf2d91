"""lab/engine_sim.py: N real round loops in threads over the in-process transport."""

from __future__ import annotations

import math

import pytest

from lab.engine_sim import run_engine_simulation
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def test_three_peers_hold_identical_phi_after_blocking_diloco_rounds(corpus):
    manifest = tiny_run()
    assert manifest.sync.algorithm == "diloco" and manifest.sync.overlap == "none"
    seen = []
    result = run_engine_simulation(manifest, corpus, peers=3, rounds=2, on_eval=seen.append, timeout_s=240.0)
    assert len(set(result.state_digests)) == 1 and len(result.state_digests) == 3  # φ and outer state, bit for bit
    assert [h.round_ for h in result.history] == [0, 1, 2] and seen == result.history
    for h in result.history:
        assert h.sigma == 0.0 and h.replica_mean_bpb is None and math.isfinite(h.loss_bpb)
    batch = manifest.inner_optimizer.batch_size_tokens
    assert [h.tokens for h in result.history] == [
        0,
        3 * manifest.sync.inner_steps * batch,
        6 * manifest.sync.inner_steps * batch,
    ]
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb
    assert result.bytes_sent_per_peer > 0 and len(result.round_end_s) == 2 and result.train_s > 0


def test_the_engine_refuses_what_it_cannot_run(corpus):
    with pytest.raises(ValueError):
        run_engine_simulation(tiny_run(), corpus, peers=2, rounds=1, data_parallel=True)
    with pytest.raises(ValueError, match="init_seed"):
        run_engine_simulation(tiny_run(), corpus, peers=2, rounds=1, seed=tiny_run().model.init_seed + 1)


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_the_engine_and_the_simulation_train_the_same_curve(corpus, algorithm):
    """bench/compare.py runs blocking DiLoCo and NoLoCo on the round engine and data-parallel on
    lab/simulation.py: the two must agree where both run, so the simulation's other figures stay
    held to the code a peer runs. Same seed, data shards and φ_0: the same losses round by round."""
    from lab.simulation import run_simulation

    manifest = tiny_run().replace(sync={"algorithm": algorithm})
    seed = manifest.model.init_seed
    engine = run_engine_simulation(manifest, corpus, peers=3, rounds=3, seed=seed, timeout_s=240.0)
    simulated = run_simulation(manifest, corpus, peers=3, rounds=3, seed=seed)
    assert [h.round_ for h in engine.history] == [h.round_ for h in simulated.history] == [0, 1, 2, 3]
    for e, s in zip(engine.history, simulated.history, strict=True):
        assert e.tokens == s.tokens
        assert math.isclose(e.loss_bpb, s.loss_bpb, rel_tol=1e-5), (e.round_, e.loss_bpb, s.loss_bpb)
    assert engine.history[-1].loss_bpb < engine.history[0].loss_bpb
