"""A CUDA peer and a CPU peer train in one swarm and hold the same φ after every round (issue #14
item 11): φ and the outer step stay fp32 on the host whatever device θ trained on. Needs a CUDA
card, so it runs where one is (a lent GPU), and skips on CI's CPU machines, saying so."""

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.harness import make_manifest, phi_file, write_manifest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card: one peer trains on it"),
]


def test_a_cuda_peer_and_a_cpu_peer_hold_identical_phi_after_each_round(procs, tmp_path):
    manifest = make_manifest()
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    devices = {"gpu": "cuda", "cpu": "cpu"}
    peers = [
        procs.peer(
            name,
            "--initial-peers",
            addr,
            "--max-rounds",
            "3",
            "--wait-for-peers",
            "2",
            "--export-phi-every",
            "1",
            "--device",
            device,
        )
        for name, device in devices.items()
    ]
    for p in peers:
        assert p.wait(300) == 0, p.tail()
    started = {p.name: p.of("started")[0] for p in peers}
    assert str(started["gpu"]["device"]).startswith("cuda") and str(started["cpu"]["device"]) == "cpu", started
    for p in peers:
        assert [e["group_size"] for e in p.of("round")] == [2, 2, 2], [e.get("note") for e in p.of("round")]
    for round_ in (1, 2, 3):
        gpu, cpu = (load_file(str(phi_file(tmp_path, name, manifest.run_id, round_))) for name in devices)
        assert gpu.keys() == cpu.keys()
        for key in gpu:  # the same mean applied to the same φ on the host: bit-identical
            assert torch.equal(gpu[key], cpu[key]), (round_, key)
