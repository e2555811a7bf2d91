"""Adaptive compression: the plan fits the budget and spends bytes where the energy is."""

import logging

import pytest
import torch

from peer.sync.adaptive import plan, sent_bytes
from protocol.codecs import decode
from protocol.manifest import CompressionSpec


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(128, 2, generator=g) @ torch.randn(2, 96, generator=g)  # energy in 2 directions
    return [
        low_rank,
        torch.randn(128, 96, generator=g),  # full rank, same shape
        torch.randn(64, 64, generator=g) * 10,  # much more energy
        torch.randn(64, 64, generator=g) * 0.1,  # much less
        torch.randn(96, generator=g),  # a norm gain: 1-D
        torch.randn(2, 3, 4, 5, generator=g),
    ]


def _fp32_bytes(tensors, n):
    return 2 * (n - 1) / n * 4 * sum(t.numel() for t in tensors)


def _squared_errors(tensors, codecs):
    return [
        float((t - decode(c.encode(t, seed=0), tuple(t.shape), seed=0)).pow(2).sum()) for t, c in zip(tensors, codecs)
    ]


@pytest.mark.parametrize("ratio", [4, 8, 9.5])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_plan_fits_the_budget_and_accounts_its_bytes(ratio, n):
    tensors = _tensors()
    uplink = 1e6
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=_fp32_bytes(tensors, n) / ratio / uplink)
    p = plan(tensors, spec, uplink_bytes_per_s=uplink, group_size=n)
    assert len(p) == len(tensors) and not p.over_budget
    assert p.bytes_per_sync == pytest.approx(sum(sent_bytes(c, t.shape, n) for c, t in zip(p, tensors)))
    assert p.bytes_per_sync <= p.budget_bytes == pytest.approx(_fp32_bytes(tensors, n) / ratio)
    assert p.bytes_per_sync > 0.7 * p.budget_bytes  # the budget is used, not wasted
    assert p[4].name in ("none", "fp16", "int8", "int4", "fp4")  # 1-D: elementwise only
    assert "MiB per sync" in p.note


def test_bits_go_where_the_energy_is():
    tensors = _tensors()
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=_fp32_bytes(tensors, 4) / 10 / 1e6)
    p = plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=4)
    assert p[0].name == "lowrank" and 2 <= p[0].rank <= 4  # rank-2 matrix: a low rank recovers it
    errors = _squared_errors(tensors, p)
    assert errors[0] < 1e-4 * float(tensors[0].pow(2).sum())
    # Same shape, 10^4 times the energy: more bytes and a smaller relative error (the plan
    # minimises the total squared error, so the weak tensor is compressed much harder).
    energy = [float(t.pow(2).sum()) for t in tensors]
    assert sent_bytes(p[2], tensors[2].shape, 4) > sent_bytes(p[3], tensors[3].shape, 4)
    assert errors[2] / energy[2] < 0.05 < errors[3] / energy[3]
    assert sum(errors) < 0.02 * sum(energy)


def test_more_budget_never_means_more_error():
    tensors = _tensors(1)
    previous = None
    for ratio in (64, 32, 16, 8, 4, 2, 0.99):
        spec = CompressionSpec(codec="adaptive", sync_time_budget_s=_fp32_bytes(tensors, 4) / ratio / 1e6)
        total = sum(_squared_errors(tensors, plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=4)))
        assert previous is None or total <= previous * 1.05
        previous = total
    assert previous == 0.0  # the fp32 bytes (plus the 1-byte headers) buy fp32 everywhere


def test_over_budget_takes_the_cheapest_and_says_so(caplog):
    tensors = _tensors()
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=1e-6)
    with caplog.at_level(logging.WARNING, logger="peer.sync.adaptive"):
        p = plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=4)
    assert p.over_budget and "OVER BUDGET" in p.note and "OVER BUDGET" in caplog.text
    assert p.bytes_per_sync > p.budget_bytes
    assert all(c.name in ("lowrank", "fp3") for c in p)
    # 16x fewer bytes than fp32 is below the floor (fp3, 3.1 bits) of these mostly full-rank tensors.
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=_fp32_bytes(tensors, 4) / 16 / 1e6)
    assert plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=4).over_budget


def test_plan_is_deterministic_and_a_lone_peer_sends_nothing():
    tensors = _tensors(2)
    spec = CompressionSpec(codec="adaptive", sync_time_budget_s=0.05)
    a = plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=3)
    b = plan([t.clone() for t in tensors], spec, uplink_bytes_per_s=1e6, group_size=3)
    assert list(a) == list(b)
    alone = plan(tensors, spec, uplink_bytes_per_s=1e6, group_size=1)
    assert [c.name for c in alone] == ["none"] * len(tensors) and alone.bytes_per_sync == 0.0
    with pytest.raises(ValueError, match="uplink_bytes_per_s"):
        plan(tensors, spec, uplink_bytes_per_s=0.0, group_size=2)
