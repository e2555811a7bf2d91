"""Precision per card: every (device, compute capability, request) combination."""

import itertools

import pytest
import torch

from peer.train.precision import BF16, CHOICES, FP16, FP32, autocast, choose_precision
from protocol.errors import ConfigError

CAPABILITIES = [(3, 7), (5, 2), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]


@pytest.mark.parametrize("capability,requested", list(itertools.product(CAPABILITIES, CHOICES)))
def test_cuda_cards(capability, requested):
    ampere_or_later = capability >= (8, 0)
    if requested == "bf16" and not ampere_or_later:
        with pytest.raises(ConfigError, match="--precision bf16"):
            choose_precision("cuda", capability, requested)
        return
    got = choose_precision("cuda", capability, requested)
    expected = {"auto": BF16 if ampere_or_later else FP16, "fp32": FP32, "bf16": BF16, "fp16": FP16}[requested]
    assert got == expected


def test_pre_ampere_error_says_what_to_use_instead():
    with pytest.raises(ConfigError) as info:
        choose_precision("cuda", (7, 5), "bf16")
    assert "7.5" in str(info.value) and "--precision fp16" in str(info.value)


@pytest.mark.parametrize("device_type", ["cpu", "mps"])
@pytest.mark.parametrize("requested", CHOICES)
def test_cpu_and_mps_default_to_fp32_and_honour_a_request(device_type, requested):
    got = choose_precision(device_type, None, requested)
    assert got == {"auto": FP32, "fp32": FP32, "bf16": BF16, "fp16": FP16}[requested]


def test_fp16_alone_needs_a_scaler_and_fp32_has_no_autocast():
    assert FP16.grad_scaler and not BF16.grad_scaler and not FP32.grad_scaler
    assert FP32.autocast_dtype is None
    assert (BF16.autocast_dtype, FP16.autocast_dtype) == (torch.bfloat16, torch.float16)


@pytest.mark.parametrize(
    "device_type,capability,requested",
    [("cpu", None, "fp8"), ("cuda", (8, 0), "half"), ("xla", None, "auto"), ("cuda", None, "auto")],
)
def test_bad_values_name_themselves(device_type, capability, requested):
    with pytest.raises(ConfigError) as info:
        choose_precision(device_type, capability, requested)
    assert requested in str(info.value) or device_type in str(info.value) or "capability" in str(info.value)


def test_autocast_runs_products_in_the_chosen_dtype_on_cpu():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for precision, dtype in ((FP32, torch.float32), (BF16, torch.bfloat16), (FP16, torch.float16)):
        with autocast("cpu", precision):
            assert (a @ b).dtype == dtype
