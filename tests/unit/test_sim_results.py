"""lab/sim_results.py: the NoLoCo/DiLoCo group draw of the one-process runs, bytes and metrics."""

import math

import pytest
import torch

from lab.sim_results import butterfly_bytes, sync_groups, weight_spread, weighted_mean
from protocol.presets import tiny_run


def manifest(algorithm: str):
    return tiny_run().replace(sync={"algorithm": algorithm})


def test_noloco_groups_are_pairs_with_changing_partners():
    m = manifest("noloco")
    partners = {i: set() for i in range(8)}
    for round_ in range(20):
        groups = sync_groups(m, 8, round_)
        members = sorted(i for g in groups for i in g)
        assert members == list(range(8))  # every peer in exactly one group
        for group in groups:
            assert len(group) == 2 and group[0] != group[1]
            partners[group[0]].add(group[1])
            partners[group[1]].add(group[0])
    assert all(len(p) >= 3 for p in partners.values()), partners
    assert sync_groups(manifest("diloco"), 8, 0) == [list(range(8))]
    assert sync_groups(manifest("independent"), 3, 0) == [[0], [1], [2]]


def test_butterfly_bytes():
    assert butterfly_bytes(1000, 1) == 0.0
    assert butterfly_bytes(1000, 2) == 4000.0
    assert butterfly_bytes(1000, 8) == pytest.approx(2 * 7 / 8 * 4000)
    with pytest.raises(ValueError, match="group_size = 0"):
        butterfly_bytes(10, 0)


def test_weighted_mean_and_spread_against_hand_computation():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    b = [torch.tensor([3.0, 6.0]), torch.tensor([[4.0]])]
    mean = weighted_mean([a, b], [1.0, 3.0])
    torch.testing.assert_close(mean[0], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(mean[1], torch.tensor([[3.0]]))
    # φ̄ = ([2, 4], [2]); Σ‖φ_i − φ̄‖² = 2·(1 + 4 + 4) = 18; N·P = 2·3.
    assert weight_spread([a, b]) == pytest.approx(math.sqrt(18 / 6))
    assert weight_spread([a, a]) == 0.0
