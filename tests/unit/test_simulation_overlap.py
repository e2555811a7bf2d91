"""sync.overlap in the in-process simulation (lab/simulation.py): the swarm's overlap rules with
every outer algorithm and codec; φ stays identical across DiLoCo replicas, the loss falls."""

import math

import pytest
import torch

from lab.simulation import Simulation, run_simulation
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def manifest(algorithm: str, overlap: str, **sections):
    return tiny_run().replace(sync={"algorithm": algorithm, "overlap": overlap}, **sections)


def identical(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_diloco_overlap_lands_each_mean_a_round_late_on_identical_phi(corpus, overlap):
    sim = Simulation(manifest("diloco", overlap), corpus, peers=3, seed=0)
    phi0 = [p.clone() for p in sim.phis[0]]
    sim.run_round()
    assert identical(sim.phis[0], phi0)  # round 0's sync still "in flight"
    starts = [[p.detach().clone() for p in m.parameters()] for m in sim.models]
    assert not identical(starts[0], phi0) and not identical(starts[0], starts[1])  # own progress carried
    sim.run_round()
    assert not identical(sim.phis[0], phi0)  # round 0's mean landed
    for phi in sim.phis[1:]:
        assert identical(phi, sim.phis[0])  # ... as the same bytes everywhere
    sim.finish()
    for phi, model in zip(sim.phis, sim.models):
        assert identical(phi, sim.phis[0]) and identical([p.detach() for p in model.parameters()], phi)
    sim.finish()  # nothing left in flight: a no-op


@pytest.mark.parametrize(
    "algorithm,overlap,codec",
    [
        ("diloco", "delayed", "int8"),
        ("diloco", "eager", "topk"),
        ("noloco", "eager", "none"),
        ("noloco", "delayed", "int8"),
    ],
)
def test_overlap_trains_with_noloco_and_lossy_codecs(corpus, algorithm, overlap, codec):
    m = manifest(algorithm, overlap, compression={"codec": codec})
    result = run_simulation(m, corpus, peers=2, rounds=4, seed=1, eval_every_rounds=4)
    first, last = result.history[0], result.history[-1]
    assert math.isfinite(last.loss_bpb) and last.loss_bpb < first.loss_bpb - 0.2
    if algorithm == "diloco":
        assert last.sigma == 0.0  # one φ, bit-identical across replicas


def test_overlap_none_is_unchanged(corpus):
    """The default runs the blocking rule: the same φ as a manifest that never heard of overlap."""
    a = Simulation(tiny_run().replace(sync={"algorithm": "diloco"}), corpus, peers=2, seed=0)
    b = Simulation(manifest("diloco", "none"), corpus, peers=2, seed=0)
    for sim in (a, b):
        sim.run_round()
        sim.run_round()
    assert identical(a.phis[0], b.phis[0])


def test_overlap_from_round_k_runs_the_first_k_rounds_blocking(corpus):
    """``overlap_from_round`` K: rounds 1..K are exactly the blocking run's, then the mean of round
    K + 1 lands a round late, from a round that started at φ."""
    blocking = Simulation(manifest("diloco", "none"), corpus, peers=2, seed=0)
    switched = Simulation(manifest("diloco", "none"), corpus, peers=2, seed=0)
    for sim in (blocking, switched):
        sim.run_round()
    assert identical(blocking.phis[0], switched.phis[0])
    switched.start_overlap("eager")
    assert switched.m.sync.overlap == "eager" and identical(switched.anchors[0], switched.phis[0])
    phi_k = [p.clone() for p in switched.phis[0]]
    switched.run_round()
    assert identical(switched.phis[0], phi_k)  # round K + 1's mean is in flight
    switched.finish()
    assert not identical(switched.phis[0], phi_k) and identical(switched.phis[0], switched.phis[1])
    with pytest.raises(ValueError, match="without overlap"):
        switched.start_overlap("delayed")  # it overlaps already
    with pytest.raises(ValueError, match="only 'delayed' or 'eager'"):
        blocking.start_overlap("streaming")


def test_run_simulation_overlap_from_round(corpus):
    """Overlap from the last round changes nothing (that round starts from φ and its mean lands
    before the final evaluation, as without overlap); from the round before, the last round starts
    from eager's point and the result differs."""

    def from_round(k):
        return manifest("diloco", "eager").replace(sync={"overlap_from_round": k})

    plain = run_simulation(manifest("diloco", "none"), corpus, peers=2, rounds=3, seed=0, eval_every_rounds=3)
    last = run_simulation(from_round(2), corpus, peers=2, rounds=3, seed=0, eval_every_rounds=3)
    two = run_simulation(from_round(1), corpus, peers=2, rounds=3, seed=0, eval_every_rounds=3)
    assert last.history[-1].loss_bpb == plain.history[-1].loss_bpb
    assert math.isfinite(two.history[-1].loss_bpb) and two.history[-1].loss_bpb != plain.history[-1].loss_bpb


def test_a_simulation_from_the_manifest_switches_at_round_k_as_start_overlap_does(corpus):
    """``sync.overlap_from_round`` K in the manifest: the Simulation itself starts overlap at
    round K (0-based), bit-identical to a blocking run switched by hand before that round."""
    by_hand = Simulation(manifest("diloco", "none"), corpus, peers=2, seed=0)
    by_manifest = Simulation(
        manifest("diloco", "eager").replace(sync={"overlap_from_round": 2}), corpus, peers=2, seed=0
    )
    for r in range(4):
        if r == 2:
            assert by_manifest.m.sync.overlap == "none"
            by_hand.start_overlap("eager")
        for sim in (by_hand, by_manifest):
            sim.run_round()
        assert by_manifest.m.sync.overlap == ("eager" if r >= 2 else "none")
        assert identical(by_hand.phis[0], by_manifest.phis[0]) and identical(by_hand.anchors[0], by_manifest.anchors[0])
    for sim in (by_hand, by_manifest):
        sim.finish()
    assert identical(by_hand.phis[0], by_manifest.phis[0])
