"""A lying owner in the simulation (issue 17): honest receivers check each owner's mean with
peer/sync/screening.py's ``owner_mean_problem`` and apply zeros (Δ) or their own φ instead of a refused one."""

import math

import pytest
import torch

import peer.sync.screening as screening_module
from lab.adversary import Adversary
from lab.simulation import Simulation
from peer.sync.screening import OWNER_CHECK_MIN_ELEMENTS
from peer.train.data import validation_batch
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def share_check_on(monkeypatch):
    """The receivers' share check is off by default (peer/sync/screening.py OWNER_SHARE_CHECK):
    these tests test it, so they turn it on."""
    monkeypatch.setattr(screening_module, "OWNER_SHARE_CHECK", True)


PEERS = 4
LIAR = PEERS - 1


def plain_run(algorithm: str = "diloco"):
    # outer SGD lr 1, no momentum: φ moves by exactly −(group mean) in one round
    return tiny_run().replace(
        sync={"algorithm": algorithm}, outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False}
    )


def distance(a, b) -> float:
    return math.sqrt(sum(float((x.double() - y.double()).norm()) ** 2 for x, y in zip(a, b)))


def two_rounds(corpus, *, screening: bool, attack: str | None) -> Simulation:
    adversary = Adversary(attack=attack, peers=(LIAR,)) if attack else None
    sim = Simulation(plain_run(), corpus, peers=PEERS, seed=1, screening=screening, adversary=adversary)
    sim.run_round()
    sim.run_round()
    return sim


def test_honest_receivers_refuse_a_flipped_owner_mean_and_stay_identical(corpus):
    clean = two_rounds(corpus, screening=True, attack=None)
    assert clean.counts.refused == {}  # no honest mean refused: the clean run is today's
    screened = two_rounds(corpus, screening=True, attack="owner-flip")
    bare = two_rounds(corpus, screening=False, attack="owner-flip")
    honest = screened.honest
    assert honest == list(range(PEERS - 1))
    # the liar owns tensors LIAR, LIAR + 4, ...; every honest receiver refuses each one large enough to
    # check, each round
    pieces = len(
        [
            i
            for i in range(LIAR, len(screened.phis[0]), PEERS)
            if screened.phis[0][i].numel() >= OWNER_CHECK_MIN_ELEMENTS
        ]
    )
    assert screened.counts.refused == {LIAR: 2 * len(honest) * pieces}
    assert bare.counts.refused == {}
    for sim in (screened, bare):
        assert all(bool(torch.isfinite(p).all()) for i in honest for p in sim.phis[i])
        for i in honest[1:]:  # one group of all peers: the honest φ stay bit-identical
            assert all(torch.equal(a, b) for a, b in zip(sim.phis[honest[0]], sim.phis[i]))
    # screening off the flipped means land: the honest φ move away from the clean run's far more
    off = distance(bare.phis[0], clean.phis[0])
    on = distance(screened.phis[0], clean.phis[0])
    assert off > 0 and on < 0.75 * off
    # screened, the liar's pieces of the honest φ never moved (zeros applied, outer SGD lr 1); off, they did
    start = Simulation(plain_run(), corpus, peers=PEERS, seed=1).phis[0]
    mine = [i for i in range(LIAR, len(start), PEERS) if start[i].numel() >= OWNER_CHECK_MIN_ELEMENTS]
    assert mine and all(torch.equal(screened.phis[0][i], start[i]) for i in mine)
    assert all(not torch.equal(bare.phis[0][i], start[i]) for i in mine)
    # and the honest peers' validation loss differs from the clean run's: the attack gets through. (Not
    # asserted: that refusing helps the loss. In this 2-round tiny run freezing the liar's pieces costs
    # more than its flipped means do.)
    windows = validation_batch(corpus, clean.m.data)
    assert bare.evaluate(windows).loss_bpb != clean.evaluate(windows).loss_bpb


def test_owner_scale_gets_through_the_norm_bound(corpus):
    clean = two_rounds(corpus, screening=True, attack=None)
    scaled = two_rounds(corpus, screening=True, attack="owner-scale")
    assert scaled.counts.refused == {}  # 2.5 x the mean is inside the receivers' bound
    assert distance(scaled.phis[0], clean.phis[0]) > 0


def test_a_refused_phi_mean_is_replaced_by_the_receivers_own_phi(corpus):
    # NoLoCo sends Δ then φ; in a pair a refused mean, Δ or φ, becomes the receiver's own values
    sim = Simulation(
        plain_run("noloco"), corpus, peers=2, seed=0, adversary=Adversary(attack="owner-zeros", peers=(1,))
    )
    params = len(sim.shapes)
    assert sim.outers[0].phi_from(params) == params
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g) for s in sim.shapes]
    own = [
        [
            *(0.01 * b + 0.001 * torch.randn(b.shape, generator=g) for b in base),
            *(b + 0.01 * torch.randn(b.shape, generator=g) for b in base),
        ]
        for _ in range(2)
    ]
    weights = [sim.max_weight, sim.max_weight]
    mean = sim._group_mean([0, 1], own, weights)
    liars = range(1, 2 * params, 2)  # peer 1 owns the odd pieces
    checked = [i for i in liars if mean[i].numel() >= OWNER_CHECK_MIN_ELEMENTS]
    assert checked and any(i < params for i in checked) and any(i >= params for i in checked)
    for forged in (sim._owners_send([0, 1], mean), [-100 * t if i % 2 else t for i, t in enumerate(mean)]):
        if forged[1].any():
            assert all(torch.equal(forged[i], -100 * mean[i]) for i in liars)
        else:
            assert all(not forged[i].any() for i in liars)  # owner-zeros
        sim.counts.refused.clear()
        got = sim._receive([0, 1], mean, forged, own, weights, own)
        # zeros pass the norm bound every piece gets and fail the checks of pieces large enough for
        # direction (or φ of typical size); 100x the mean fails the norm bound, whatever the size.
        # A pair's receiver applies a refused piece as its own values, and an owner it refused on
        # one piece is trusted on none (peer/sync/pairs.py): every piece of the liar, its own values
        for i in range(2 * params):
            if i % 2 == 0:  # peer 0's own pieces
                assert got[0][i] is forged[i]
            else:
                assert torch.equal(got[0][i], own[0][i])
        assert all(a is b for a, b in zip(got[1], mean))  # the liar applies the honest means
        assert set(sim.counts.refused) == {1} and sim.counts.refused[1] >= len(checked)
