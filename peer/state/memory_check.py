"""Whether a run's model fits this machine: the need (peer/state/memory_need.py) against the host's
available RAM and the card's free memory, refused in one line that names both figures needed, the
free memory and what to do (issue #67, item 5). ``peer doctor`` reports it as a check; ``peer join``
refuses before it builds the model (host) and before the model moves to its card (GPU), exit 78.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peer.state.memory_need import GIB, GPU, HOST, MemoryNeed, memory_need
from peer.train.device import resolve_device
from protocol.errors import ConfigError
from protocol.manifest import RunManifest


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """RAM the kernel can give new allocations without swapping (``MemAvailable``), bytes; None
    where ``meminfo`` is missing or lacks it (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_free_bytes(device) -> int | None:
    """Free memory of CUDA ``device`` (``torch.cuda.mem_get_info``), bytes; None on other devices.
    Creates a CUDA context: ``peer join`` calls it only once its averager process is forked."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def shortfall(
    need: MemoryNeed, *, host_free: int | None, gpu_free: int | None = None, device: str = "the card"
) -> str | None:
    """The refusal line when ``need`` does not fit (one line: both figures needed, the free memory,
    what to do), or None when it fits or nothing is known of the free memory.

    Args:
        host_free: available host RAM, bytes (:func:`host_available_bytes`); None: not checked.
        gpu_free: free memory of the card, bytes (:func:`gpu_free_bytes`); None: not checked.
        device: the card's name for the message (``cuda:0``).
    """
    host_short = host_free is not None and need.host_bytes > host_free
    gpu_short = need.device_type == "cuda" and gpu_free is not None and need.gpu_bytes > gpu_free
    if not (host_short or gpu_short):
        return None
    needs = f"{need.host_bytes / GIB:.1f} GiB of host RAM"
    needs += f" and {need.gpu_bytes / GIB:.1f} GiB of GPU memory on {device}" if need.device_type == "cuda" else ""
    free = []
    if host_free is not None:
        free.append(f"{host_free / GIB:.1f} GiB of RAM available")
    if need.device_type == "cuda" and gpu_free is not None:
        free.append(f"{gpu_free / GIB:.1f} GiB free on {device}")
    fixes = ["join a smaller run (e.g. --preset default)"]
    activations = sum(b.bytes for b in need.buffers if b.name.startswith("activations"))
    if activations > 0.2 * need.peak_bytes(GPU if need.device_type == "cuda" else HOST):
        fixes.append("a smaller --micro-batch (or --activation-checkpointing)")
    fixes.append("close other programs" if host_short else "stop other programs using the card")
    if gpu_short:
        fixes.append("use a card with more free memory (--device cuda:N)")
    return (
        f"not enough memory for run {need.run!r} ({need.parameters:,} parameters) on this "
        f"{'CUDA' if need.device_type == 'cuda' else need.device_type.upper()} peer: it needs {needs}, "
        f"this machine has {' and '.join(free)}: " + ", or ".join(fixes)
    )


class MemoryShort(ConfigError):
    """The run's model does not fit this machine's free memory (exit 78, as a configuration error:
    restarting as it is will not help)."""


def check_memory(
    need: MemoryNeed, *, host_free: int | None, gpu_free: int | None = None, device: str = "the card"
) -> None:
    """Refuse to train when ``need`` does not fit (see :func:`shortfall`).

    Raises:
        MemoryShort: the host's available RAM or the card's free memory is below the need; the
            message is :func:`shortfall`'s one line. Nothing is allocated or changed.
    """
    line = shortfall(need, host_free=host_free, gpu_free=gpu_free, device=device)
    if line is not None:
        raise MemoryShort(line)


def check_join(manifest: RunManifest, device: Any, *, host_free: int | None = None) -> MemoryNeed:
    """``peer join``'s check before it builds the model: the need on the device ``--device`` names
    (``device``: the join's DeviceConfig, read for ``device``, ``precision``,
    ``micro_batch_sequences`` and ``activation_checkpointing``) against the host's available RAM
    (``host_free``, bytes; None: read now). Touches no CUDA context (the averager is forked later).

    Returns:
        The need, for :func:`check_card` once the card is placed.

    Raises:
        MemoryShort: the host lacks the RAM (the line names the GPU need too).
        ConfigError: ``--device`` names a device this machine lacks.
    """
    need = memory_need(
        manifest,
        device_type=resolve_device(device.device).type,
        precision=None if device.precision == "auto" else device.precision,
        micro_batch_sequences=device.micro_batch_sequences,
        activation_checkpointing=device.activation_checkpointing,
    )
    check_memory(need, host_free=host_available_bytes() if host_free is None else host_free)
    return need


def check_card(need: MemoryNeed, device: Any, *, gpu_free: int | None = None) -> None:
    """``peer join``'s check once its card is placed (the CUDA context exists): the need against the
    card's free memory (``gpu_free``, bytes; None: ``torch.cuda.mem_get_info`` now). Not the host's
    again: the peer holds part of its need there by now (checked by :func:`check_join`). Nothing on
    a CPU or MPS peer.

    Raises:
        MemoryShort: as :func:`check_memory`.
    """
    if need.device_type != "cuda":
        return
    free = gpu_free_bytes(device) if gpu_free is None else gpu_free
    check_memory(need, host_free=None, gpu_free=free, device=str(device))
