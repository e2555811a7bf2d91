"""Mixed precision chosen per card: which autocast dtype the inner loop runs under, and whether it
needs a gradient scaler (docs/algorithms.md §8).

Master weights, gradients, AdamW state, φ and the outer step stay fp32 whatever is chosen here:
autocast only changes the dtype of the forward's matrix products.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from protocol.errors import ConfigError

CHOICES = ("auto", "fp32", "bf16", "fp16")
"""Values of ``peer join --precision``."""

BF16_MIN_CAPABILITY = (8, 0)
"""Compute capability from which CUDA cards run bf16 natively (Ampere: A100, RTX 30 and later)."""


@dataclass(frozen=True)
class Precision:
    """How the inner loop's forward and backward run.

    ``name`` is 'fp32', 'bf16' or 'fp16'; ``autocast_dtype`` the dtype of
    :func:`torch.autocast` (None: no autocast, plain fp32); ``grad_scaler`` whether the loss is
    scaled (fp16's narrow exponent range underflows small gradients without it).
    """

    name: str
    autocast_dtype: torch.dtype | None
    grad_scaler: bool


FP32 = Precision("fp32", None, False)
BF16 = Precision("bf16", torch.bfloat16, False)
FP16 = Precision("fp16", torch.float16, True)
_BY_NAME = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


def choose_precision(device_type: str, capability: tuple[int, int] | None, requested: str = "auto") -> Precision:
    """The precision a peer trains in on this device.

    ``auto``: bf16 autocast on CUDA capability ≥ 8.0, fp16 autocast with a gradient scaler on older
    CUDA cards, fp32 on CPU and MPS (MPS autocast is young; ask for it explicitly). An explicit
    choice is honoured where the device can run it: bf16 is refused on CUDA cards below 8.0 (the
    most reported crash of volunteer clients on pre-Ampere GPUs); bf16 and fp16 autocast on the CPU
    run (slowly, unless the CPU has bf16/AMX units).

    Args:
        device_type: ``torch.device.type``: 'cuda', 'cpu' or 'mps'.
        capability: CUDA compute capability (major, minor); None for other devices.
        requested: one of :data:`CHOICES`.

    Raises:
        ConfigError: an unknown value, an unknown device type, or bf16 on a CUDA card below 8.0.
    """
    if requested not in CHOICES:
        raise ConfigError(f"--precision {requested!r}: must be one of {', '.join(CHOICES)}")
    if device_type not in ("cuda", "cpu", "mps"):
        raise ConfigError(f"device type {device_type!r}: locoswarm trains on cuda, mps or cpu")
    if device_type == "cuda":
        if capability is None:
            raise ConfigError("a CUDA device without a compute capability: cannot choose its precision")
        native_bf16 = tuple(capability) >= BF16_MIN_CAPABILITY
        if requested == "auto":
            return BF16 if native_bf16 else FP16
        if requested == "bf16" and not native_bf16:
            raise ConfigError(
                f"--precision bf16: this card (compute capability {capability[0]}.{capability[1]}) "
                f"has no bf16 support; use --precision fp16 (or auto, which picks it)"
            )
        return _BY_NAME[requested]
    if requested == "auto":
        return FP32
    return _BY_NAME[requested]


def autocast(device_type: str, precision: Precision) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device_type`` (a no-op for fp32)."""
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=precision.autocast_dtype)
