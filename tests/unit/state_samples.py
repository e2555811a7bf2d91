"""A small state for the state-transfer tests: every kind of tensor (2-d, 1-d, 0-d, empty, 3-d),
φ then the outer momentum, cut into small chunks."""

from __future__ import annotations

import torch

from peer.state.snapshot import StateSnapshot, make_snapshot

BASE = [torch.Size([40, 16]), torch.Size([16]), torch.Size([]), torch.Size([0, 3]), torch.Size([9, 2, 3])]
SHAPES = BASE * 2  # φ, then outer momentum
CHUNK = 64
RUN = "run0"
META = {"run_id": RUN, "round": 12, "inner_step": 600}


def sample_tensors(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def sample_snapshot(meta=META, tensors=None) -> StateSnapshot:
    return make_snapshot(meta, tensors if tensors is not None else sample_tensors(), chunk_elements=CHUNK)
