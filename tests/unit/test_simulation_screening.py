"""The simulation screens group means as a networked owner does (issue 17, item 4) and its adversary lies.

The reference means are written out here from the rules of peer/sync/screening.py: weights capped at
H × batch tokens, each contribution clipped to 1.5 × the lower median norm, then the weighted mean.
"""

import math

import pytest
import torch

from lab.adversary import Adversary
from lab.simulation import Simulation
from peer.sync.screening import CLIP_MEDIAN_FACTOR
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)

PEERS = 4


def plain_run():
    # outer SGD lr 1, no momentum: φ moves by exactly −(group mean) in one round
    return tiny_run().replace(
        sync={"algorithm": "diloco"}, outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False}
    )


def contributions(seed: int, attacker_scale: float) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # one tensor per member: each member owns one (tensor i: member i mod n), as in the all-reduce
    honest = [
        [
            torch.randn(6, 5, generator=g),
            torch.randn(7, generator=g),
            torch.randn(3, 4, generator=g),
            torch.randn(9, generator=g),
        ]
        for _ in range(PEERS - 1)
    ]
    return [*honest, [attacker_scale * t for t in honest[0]]]


def reference_mean(parts: list[list[torch.Tensor]], weights: list[float], cap: float) -> list[torch.Tensor]:
    out = []
    for i in range(len(parts[0])):
        w = [min(x, cap) for x in weights]
        norms = [float(p[i].double().norm()) for p in parts]
        refs = sorted(n * max(w) / wi for n, wi in zip(norms, w))
        threshold = CLIP_MEDIAN_FACTOR * refs[(len(refs) - 1) // 2]
        clipped = [p[i] * min(1.0, threshold / n) for p, n in zip(parts, norms)]
        out.append(sum(wi * x for wi, x in zip(w, clipped)) / sum(w))
    return out


def test_the_group_mean_caps_weights_and_clips_to_the_median(corpus):
    sim = Simulation(plain_run(), corpus, peers=PEERS, seed=0)
    parts, weights = contributions(0, -100.0), [256.0, 256.0, 128.0, 1e30]
    mean = sim._group_mean(list(range(PEERS)), parts, weights)
    for got, want in zip(mean, reference_mean(parts, weights, sim.max_weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert sim.counts.clipped == {PEERS - 1: 4}  # the attacker, once per tensor
    # screening off: the claimed 1e30 tokens make the mean the attacker's own payload
    bare = Simulation(plain_run(), corpus, peers=PEERS, seed=0, screening=False)
    torch.testing.assert_close(bare._group_mean(list(range(PEERS)), parts, weights)[0], parts[-1][0])


def test_a_repeat_offender_is_left_out_and_non_finite_contributions_never_count(corpus):
    sim = Simulation(plain_run(), corpus, peers=PEERS, seed=0)
    group, weights = list(range(PEERS)), [256.0] * PEERS
    for round_ in range(3):  # three clipped rounds: ignored from the next
        sim.round_ = round_
        sim._group_mean(group, contributions(round_, 100.0), weights)
    sim.round_ = 3
    parts = contributions(3, 100.0)
    mean = sim._group_mean(group, parts, weights)
    for i in range(PEERS - 1):  # the tensors the honest members own: the honest mean, exactly
        torch.testing.assert_close(mean[i], sum(p[i] for p in parts[:-1]) / (PEERS - 1), rtol=1e-6, atol=1e-6)
    # the attacker owns the last tensor and counts itself (clipped): that piece is its own to corrupt
    torch.testing.assert_close(mean[-1], reference_mean(parts, weights, sim.max_weight)[-1], rtol=1e-5, atol=1e-6)
    assert sim.counts.ignored == {PEERS - 1: PEERS - 1}  # by every other owner, not by itself
    parts[1] = [torch.full_like(t, math.inf) for t in parts[1]]
    assert sim.counts.dropped == {}
    mean = sim._group_mean(group, parts, weights)
    pair = reference_mean([parts[0], parts[2]], [256.0, 256.0], sim.max_weight)  # peer 1 dropped, 3 ignored
    for got, want in zip(mean[:-1], pair[:-1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(torch.isfinite(t).all() for t in mean)
    assert sim.counts.dropped == {1: PEERS - 1}  # by owners 0, 2 and 3; its own piece is no strike


@pytest.mark.parametrize("screening", [True, False])
def test_a_sign_flipping_peer_moves_the_honest_phi_by_little_only_when_screened(corpus, screening):
    adversary = Adversary(attack="sign-flip", peers=(PEERS - 1,))
    sim = Simulation(plain_run(), corpus, peers=PEERS, seed=1, screening=screening, adversary=adversary)
    phi0 = [p.clone() for p in sim.phis[0]]
    sim.run_round()
    thetas = [[p.detach().clone() for p in m.parameters()] for m in sim.models]
    moved = [sum(float((a - b).norm()) ** 2 for a, b in zip(sim.phis[j], phi0)) ** 0.5 for j in range(PEERS - 1)]
    assert thetas[0][0].isfinite().all()
    clean = Simulation(plain_run(), corpus, peers=PEERS, seed=1)
    clean.run_round()
    honest_step = sum(float((a - b).norm()) ** 2 for a, b in zip(clean.phis[0], phi0)) ** 0.5
    if screening:  # the attacker weighs a quarter and is clipped to 3x the median: at most ~2x the clean step
        assert max(moved) < 2.5 * honest_step
        assert set(sim.counts.clipped) == {PEERS - 1}
        # the receivers' share check is off by default (OWNER_SHARE_CHECK): no honest owner's mean is
        # refused (the attacker's own piece, its mean pulled by its flipped contribution, may be: the
        # direction check) and the honest φ stay identical; after the three rounds that get the
        # attacker ignored, no honest peer ignores another honest one
        assert set(sim.counts.refused) <= {PEERS - 1}
        assert all(torch.equal(a, b) for j in range(1, PEERS - 1) for a, b in zip(sim.phis[0], sim.phis[j]))
        sim.run_round()
        sim.run_round()
        for j in range(PEERS - 1):
            assert sim.strikes[j].ignored(sim.round_) == {PEERS - 1}
    else:  # the attacker's −100 Δ with 1e30 tokens is the mean, the same on every honest peer
        assert min(moved) > 50 * honest_step
        assert all(torch.equal(a, b) for j in range(1, PEERS - 1) for a, b in zip(sim.phis[0], sim.phis[j]))


@pytest.mark.parametrize("defended", [True, False])
def test_fake_progress_takes_over_only_the_rule_that_counts_every_record(corpus, defended):
    # 1 malicious peer of 6 and 6 fresh identities claim the next round with an all-zero state: 7 records
    # against the 5 honest peers' own class
    adversary = Adversary(attack="fake-progress", peers=(5,), fresh_identities=6)
    sim = Simulation(plain_run(), corpus, peers=6, seed=0, screening=defended, adversary=adversary)
    sim.run_round()
    sim.run_round()
    zeroed = [i for i in sim.honest if all(not p.any() for p in sim.phis[i])]
    if defended:  # only the malicious peer is a voucher: 1 counted record against 5
        assert sim.taken_over == {} and zeroed == [] and sim.counts.rule_chose_fake == 0
    else:
        assert sorted(sim.taken_over) == sim.honest == zeroed
