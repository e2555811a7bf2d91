"""Device choice, MFU arithmetic and the micro-batch probe (peer/train/device.py)."""

import pytest
import torch

from peer.train import device as dev
from peer.train.device import (
    PEAK_TFLOPS,
    cap_memory,
    flops_per_token,
    mfu,
    peak_of,
    place,
    probe_micro_batch,
    resolve_device,
)
from protocol.errors import ConfigError


def test_cpu_and_auto_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_mps_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")


def test_auto_prefers_cuda_then_mps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_mps_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")
    assert resolve_device("mps") == torch.device("mps")


def test_cuda_when_there_is_none_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda")
    assert "--device cuda:" in str(info.value) and "--device cpu" in str(info.value)
    assert info.value.exit_code == 78


def test_a_device_index_past_the_last_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda:7")
    message = str(info.value)
    assert "cuda:7" in message and "1 CUDA device" in message and "cuda:0" in message


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:-1", "tpu", ""])
def test_unknown_values_are_named(monkeypatch, value):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as info:
        resolve_device(value)
    assert f"--device {value}" in str(info.value)


def test_mps_when_there_is_none(monkeypatch):
    monkeypatch.setattr(dev, "_mps_available", lambda: False)
    with pytest.raises(ConfigError, match="--device mps"):
        resolve_device("mps")


def test_place_on_cpu_is_fp32_eager_without_mfu():
    placement, notes = place("cpu", max_memory_gib=4.0)
    assert placement.device == torch.device("cpu")
    assert placement.precision.name == "fp32" and not placement.compile and placement.peak_tflops is None
    assert notes and "--max-memory 4 GiB is ignored on cpu" in notes[0]
    fields = placement.event_fields()
    assert fields["device"] == "cpu" and fields["precision"] == "fp32" and fields["compute_capability"] is None
    asked, _ = place("cpu", precision="bf16", compile=True, peak_tflops=2.0)
    assert asked.precision.name == "bf16" and asked.compile and asked.peak_tflops == 2.0


def test_cap_memory_without_a_cap_does_nothing():
    assert cap_memory(torch.device("cpu"), None) is None


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA GeForce RTX 3060", 51.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("NVIDIA GeForce RTX 3090", 71.0),
        ("Tesla T4", 65.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("Some Future Card", None),
    ],
)
def test_peak_table(name, peak):
    assert peak_of(name) == peak
    assert peak_of(name, 42.0) == 42.0  # --peak-tflops wins


def test_table_has_the_cards_the_issue_names():
    assert {"T4", "RTX 3060", "A10", "L4", "A100", "H100", "RTX 3090", "RTX 4090"} <= set(PEAK_TFLOPS)


def test_mfu_is_the_palm_count_over_the_peak():
    per_token = flops_per_token(params=124_000_000, embedding_params=38_000_000, layers=12, hidden=768, seq_len=1024)
    assert per_token == 6 * 86_000_000 + 12 * 12 * 768 * 1024
    assert mfu(100_000.0, per_token, 312.0) == pytest.approx(100_000 * per_token / 312e12)
    assert mfu(100_000.0, per_token, None) is None


def oom(*_):
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def card(capacity: float, limit: int):
    """try_step of a card where n sequences need n/capacity of the budget, and more than limit OOM."""
    tried = []

    def try_step(n: int) -> float:
        tried.append(n)
        if n > limit:
            oom()
        return n / capacity

    return try_step, tried


def test_probe_takes_the_whole_batch_when_it_fits():
    try_step, tried = card(capacity=100, limit=100)
    assert probe_micro_batch(try_step, upper=32) == 32 and tried == [32]


def test_probe_halves_past_oom_then_bisects_under_the_margin():
    try_step, tried = card(capacity=50, limit=48)  # 45 fits with a 10 % margin, 46..48 do not, 49+ OOM
    got = probe_micro_batch(try_step, upper=256)
    assert 40 <= got <= 45 and got / 50 <= 0.9
    assert tried[:3] == [256, 128, 64]


def test_probe_keeps_one_sequence_without_margin_and_fails_when_none_fits():
    try_step, _ = card(capacity=1.05, limit=1)
    assert probe_micro_batch(try_step, upper=8) == 1
    with pytest.raises(ConfigError, match="one sequence"):
        probe_micro_batch(oom, upper=8)
