"""NoLoCo's outer step against the paper's equations written out here; its stability bound."""

import math

import pytest
import torch

from peer.train.outer import NoLoCo, make_outer, pseudo_gradient
from protocol.errors import BadPayload, ManifestError
from protocol.manifest import NoLoCoSpec, RunManifest, load_manifest


def reference(phis, thetas_by_round, alpha, beta, gamma):
    """NoLoCo (arXiv 2506.10911, Eqs. 1-3, reference-code form), paper sign Δ = θ − φ, for a group
    that averages together every round (uniform weights):
        δ_i ← α δ_i + β·mean_j(θ_j − φ_j) + γ·(mean_j φ_j − φ_i);  φ_i ← φ_i + δ_i."""
    phis = [p.clone() for p in phis]
    deltas = [torch.zeros_like(p) for p in phis]
    for thetas in thetas_by_round:
        mean_fast_minus_slow = sum(t - p for t, p in zip(thetas, phis)) / len(phis)
        mean_phi = sum(phis) / len(phis)
        for i in range(len(phis)):
            deltas[i] = alpha * deltas[i] + beta * mean_fast_minus_slow + gamma * (mean_phi - phis[i])
        phis = [p + d for p, d in zip(phis, deltas)]
    return phis


@pytest.mark.parametrize("gamma", [0.7, 0.9])  # γ = β and γ ≠ β
def test_noloco_step_matches_reference_over_rounds(gamma):
    g = torch.Generator().manual_seed(0)
    shape = torch.Size([6, 4])
    start = [torch.randn(shape, generator=g) for _ in range(2)]  # two replicas with different φ
    rounds = [[torch.randn(shape, generator=g) for _ in range(2)] for _ in range(4)]  # θ after H steps
    spec = NoLoCoSpec(momentum=0.5, lr=0.7, pull=gamma)
    replicas = [[p.clone()] for p in start]
    outers = [NoLoCo([shape], spec) for _ in range(2)]
    for thetas in rounds:
        payloads = [o.payload(phi, pseudo_gradient(phi, [t])) for o, phi, t in zip(outers, replicas, thetas)]
        mean = [(a + b) / 2 for a, b in zip(*payloads)]
        for o, phi in zip(outers, replicas):
            o.apply(phi, mean)
    expected = reference(start, rounds, 0.5, 0.7, gamma)
    for phi, exp in zip(replicas, expected):
        torch.testing.assert_close(phi[0], exp, rtol=1e-5, atol=1e-6)


def test_gamma_equal_beta_reduces_to_step_toward_mean_fast_weights():
    # With γ = β: φ ← φ + α·δ_old + β·(mean θ − φ) (docs/algorithms.md §2); first round δ_old = 0.
    phi, other_phi = [torch.zeros(3)], [torch.ones(3)]
    theta, other_theta = torch.full((3,), 0.5), torch.full((3,), 2.0)
    o = NoLoCo([torch.Size([3])], NoLoCoSpec(momentum=0.5, lr=0.7, pull=0.7))
    p1 = o.payload(phi, pseudo_gradient(phi, [theta]))
    p2 = o.payload(other_phi, pseudo_gradient(other_phi, [other_theta]))
    o.apply(phi, [(a + b) / 2 for a, b in zip(p1, p2)])
    torch.testing.assert_close(phi[0], 0.7 * ((0.5 + 2.0) / 2 - 0.0) * torch.ones(3))


def test_alone_noloco_has_no_pull_and_rejects_nan():
    o = NoLoCo([torch.Size([2])], NoLoCoSpec(momentum=0.5, lr=0.7, pull=0.7))
    phi = [torch.zeros(2)]
    o.apply(phi, o.payload(phi, [torch.full((2,), -1.0)]))  # Δ = φ − θ = −1: θ moved to +1
    torch.testing.assert_close(phi[0], torch.full((2,), 0.7))
    with pytest.raises(BadPayload):
        o.apply(phi, [torch.tensor([float("nan"), 0.0]), torch.zeros(2)])
    torch.testing.assert_close(phi[0], torch.full((2,), 0.7))


def test_stability_bound_is_enforced_naming_bound_and_values(tmp_path):
    # n = 2, α = 0.5: 0.5 < γ < 1.5
    with pytest.raises(ManifestError) as info:
        RunManifest().replace(sync={"algorithm": "noloco"}, noloco={"momentum": 0.5, "pull": 1.6})
    text = str(info.value)
    assert "noloco.pull (γ) = 1.6" in text and "0.5 < γ < 1.5" in text and "α = 0.5" in text
    with pytest.raises(ManifestError, match="must exceed"):
        RunManifest().replace(sync={"algorithm": "noloco"}, noloco={"momentum": 0.8, "lr": 0.7, "pull": 0.9})
    lo = 0.5 * math.sqrt(4 / 6)
    with pytest.raises(ManifestError, match=f"{lo:.4g} < γ"):
        RunManifest().replace(sync={"algorithm": "noloco"}, noloco={"momentum": 0.5, "group_size": 4, "pull": 0.3})
    # Inside the bound: accepted; an unused noloco section is not checked against the bound.
    assert RunManifest().replace(sync={"algorithm": "noloco"}, noloco={"pull": 1.2}).noloco.pull == 1.2
    assert RunManifest().replace(noloco={"pull": 1.6}).sync.algorithm == "diloco"


def test_pull_defaults_to_lr_in_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[sync]\nalgorithm = "noloco"\n[noloco]\nlr = 0.9\n')
    manifest = load_manifest(path)
    assert manifest.noloco.pull == 0.9
    assert isinstance(make_outer(manifest, [torch.Size([1])]), NoLoCo)
