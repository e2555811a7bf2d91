"""lab/adversary.py's colluding attacks (``alie``, ``ipm``) on small tensors, against the papers'
formulas written out here (arXiv 1902.06156, 1903.03936), and the engine hook's pooling."""

from __future__ import annotations

import statistics
import threading

import pytest
import torch

from lab.adversary import (
    COLLUDE_COSINE,
    COLLUDE_NORM_FACTOR,
    IPM_EPSILON,
    Adversary,
    alie,
    alie_z,
    ipm,
    z_for_norm,
)
from peer.sync.robust import SIMILARITY_MIN_ELEMENTS


def test_alie_z_is_the_papers_z_max_for_8_peers():
    # s = floor(8/2 + 1) - m; z = Phi^-1((8 - s) / 8)
    assert alie_z(8, 1) == pytest.approx(0.0, abs=1e-12)
    assert alie_z(8, 2) == pytest.approx(statistics.NormalDist().inv_cdf(5 / 8))
    assert alie_z(8, 2) == pytest.approx(0.3186, abs=1e-4)


def test_z_for_norm_lands_on_the_target_norm():
    g = torch.Generator().manual_seed(0)
    mu, sigma = torch.randn(50, generator=g), torch.rand(50, generator=g)
    target = 3.0 * float(mu.norm())
    z = z_for_norm(mu, sigma, target)
    assert z > 0
    assert float((mu - z * sigma).norm()) == pytest.approx(target, rel=1e-5)
    assert z_for_norm(mu, sigma, 0.5 * float(mu.norm())) == 0.0  # already past it: μ itself
    assert z_for_norm(mu, torch.zeros(50), target) == 0.0


def test_alie_with_two_colluders_is_mean_minus_z_std_at_the_norm_bound():
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(4, 8, generator=g), torch.randn(16, generator=g)]
    b = [torch.randn(4, 8, generator=g), torch.randn(16, generator=g)]
    forged = alie([a, b], z_min=alie_z(8, 2))
    for k, f in enumerate(forged):
        mu = (a[k] + b[k]) / 2
        sigma = (a[k] - b[k]).abs() / 2  # population std of two values
        target = COLLUDE_NORM_FACTOR * (float(a[k].norm()) + float(b[k].norm())) / 2
        z = max(alie_z(8, 2), z_for_norm(mu, sigma, target))
        torch.testing.assert_close(f, mu - z * sigma)
        assert f.shape == a[k].shape and f.dtype == torch.float32
        assert float(f.norm()) == pytest.approx(target, rel=1e-4)  # under the owners' 3x median clip


def test_alie_alone_uses_its_own_magnitude_as_sigma():
    x = torch.tensor([3.0, -4.0, 0.0, 1.0])
    (forged,) = alie([[x]], z_min=0.0)
    z = z_for_norm(x, x.abs(), COLLUDE_NORM_FACTOR * float(x.norm()))
    torch.testing.assert_close(forged, x - z * x.abs())
    assert bool((forged <= x).all())  # every coordinate moved down


def test_ipm_is_minus_epsilon_times_the_colluders_mean():
    a, b = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, -2.0])]
    torch.testing.assert_close(ipm([a, b])[0], -IPM_EPSILON * torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(ipm([a], epsilon=0.1)[0], torch.tensor([-0.1, -0.2]))


@pytest.mark.parametrize("attack", ["alie", "ipm"])
def test_the_engine_hook_pools_the_colluders_payloads_of_one_sync(attack):
    """Two colluders contributing from two threads forge one vector from both payloads, claim the
    attack's weight, and leave a NoLoCo payload's φ part honest."""
    adversary = Adversary(attack=attack, peers=(2, 3))
    hooks = adversary.hooks(run_id="r", inner_steps=5, noloco=True)
    payloads = {
        "sim-peer-2": [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([9.0])],
        "sim-peer-3": [torch.tensor([3.0, 0.0, -1.0]), torch.tensor([7.0])],
    }
    out: dict[str, tuple] = {}

    def contribute(peer: str) -> None:
        out[peer] = hooks.contribution(peer, list(payloads[peer]), 100.0, 1)

    threads = [threading.Thread(target=contribute, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    both = [[payloads[p][0]] for p in sorted(payloads)]
    expected = alie(both, z_min=alie_z(8, 2)) if attack == "alie" else ipm(both)
    for peer, (sent, weight) in out.items():
        torch.testing.assert_close(sent[0], expected[0])
        torch.testing.assert_close(sent[1], payloads[peer][1])  # φ: honest
        assert weight == adversary.claimed_tokens
    honest, weight = hooks.contribution("sim-peer-0", [torch.ones(3)], 100.0, None)
    torch.testing.assert_close(honest[0], torch.ones(3))
    assert weight == 100.0


def test_against_a_diloco_group_each_colluder_turns_its_copy_to_just_under_the_owners_kappa():
    """DiLoCo owners weigh down one vector sent twice (peer/sync/robust.py ``similarity_weighted``):
    each colluder sends the shared deviation from their mean at the same length, in a direction of
    its own, so the two deviations meet at cosine about COLLUDE_COSINE; pieces under
    SIMILARITY_MIN_ELEMENTS keep the shared vector."""
    adversary = Adversary(attack="alie", peers=(2, 3))
    hooks = adversary.hooks(run_id="r", inner_steps=5, noloco=False)
    gen = torch.Generator().manual_seed(1)
    payloads = {
        p: [torch.randn(4096, generator=gen), torch.randn(8, generator=gen)] for p in ("sim-peer-2", "sim-peer-3")
    }
    out: dict[str, tuple] = {}
    threads = [
        threading.Thread(target=lambda p=p: out.__setitem__(p, hooks.contribution(p, list(payloads[p]), 1.0, None)))
        for p in payloads
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    both = [payloads[p] for p in sorted(payloads)]
    shared = alie(both, z_min=alie_z(8, 2))
    mu = (both[0][0] + both[1][0]) / 2
    a, b = (out[p][0][0] - mu for p in sorted(payloads))
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) == pytest.approx(COLLUDE_COSINE, abs=0.05)
    for d in (a, b):
        assert float(d.norm()) == pytest.approx(float((shared[0] - mu).norm()), rel=1e-4)
    for p in payloads:
        torch.testing.assert_close(out[p][0][1], shared[1])  # 8 values: not judged, not turned
    assert SIMILARITY_MIN_ELEMENTS > 8
