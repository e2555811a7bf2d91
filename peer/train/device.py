"""Where this peer trains: the device from ``--device``, what it is (name, memory, compute
capability), its memory cap, the largest micro-batch that fits it, and its peak for MFU.

The device is a per-peer fact, never part of the run manifest: CPU and GPU peers train in one
swarm, and φ stays fp32 on the host whatever this module picks (docs/algorithms.md §8).

Only :func:`describe` and :func:`cap_memory` touch a CUDA context; :func:`resolve_device` asks only
how many devices exist, so it may run before the averager process is forked.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.train.precision import FP16, Precision, choose_precision
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)

GIB = 1024**3

PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "A100": 312.0,
    "A10": 125.0,
    "L4": 121.0,
    "T4": 65.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "RTX 3060": 51.0,
}
"""Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, matched as the longest key found in
the device name (docs/algorithms.md §8; vendors' data sheets). ``--peak-tflops`` covers other cards."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the ``started`` event and the progress line say about the device."""

    device: str
    """As torch names it: 'cpu', 'cuda:0', 'mps'."""
    name: str
    """'NVIDIA GeForce RTX 3060', or the CPU's architecture."""
    memory_gib: float | None
    """Total device memory in GiB (None on CPU and MPS: shared with the system)."""
    capability: tuple[int, int] | None
    """CUDA compute capability, e.g. (8, 6); None elsewhere."""

    @property
    def type(self) -> str:
        return torch.device(self.device).type


def resolve_devices(choice: str) -> list[torch.device]:
    """The devices ``--device`` names: one (see :func:`resolve_device`), a comma-separated list
    (``cuda:0,cuda:1``: one data-parallel rank per entry, peer/train/ddp.py; ``cpu,cpu`` runs two
    CPU ranks, for tests), or ``cuda:all`` (every visible CUDA card).

    Raises:
        ConfigError: as :func:`resolve_device` for any entry; a card listed twice; CUDA mixed with
            the CPU; more than one MPS device.
    """
    value = choice.strip().lower()
    if value == "cuda:all":
        resolve_device("cuda")  # the error when there is none
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if "," not in value:
        return [resolve_device(choice)]
    devices = [resolve_device(part) for part in value.split(",")]
    types = {d.type for d in devices}
    if len(types) > 1 or "mps" in types:
        raise ConfigError(
            f"--device {choice}: several devices must all be CUDA cards (cuda:0,cuda:1) or all CPU (cpu,cpu, for tests)"
        )
    cards = [d for d in devices if d.type == "cuda"]
    if len(set(cards)) != len(cards):
        raise ConfigError(f"--device {choice}: a card is listed twice; list each cuda:N once")
    return devices


def resolve_device(choice: str) -> torch.device:
    """The device ``--device`` names: 'auto' (CUDA, then MPS, then CPU), 'cpu', 'cuda', 'cuda:N', 'mps';
    for a list (:func:`resolve_devices`) the first one, rank 0's.

    Raises:
        ConfigError: an unknown value, or a device this machine does not have; the message names
            the value and what to use instead.
    """
    value = choice.strip().lower()
    if "," in value or value == "cuda:all":
        return resolve_devices(choice)[0]
    if value == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    if value == "mps":
        if not _mps_available():
            raise ConfigError(
                "--device mps: this machine has no Apple GPU that PyTorch can use; use --device auto or --device cpu"
            )
        return torch.device("mps")
    if value == "cuda" or value.startswith("cuda:"):
        index_text = value.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ConfigError(f"--device {choice}: expected cuda or cuda:N with N a device index, e.g. cuda:0")
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(
                f"--device {choice}: no CUDA GPU is visible to PyTorch {torch.__version__} ({build}); "
                f"use --device cpu, or install a CUDA build of torch and check nvidia-smi"
            )
        count, index = torch.cuda.device_count(), int(index_text)
        if index >= count:
            raise ConfigError(
                f"--device {choice}: this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1}); use one of them or --device auto"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"--device {choice}: must be auto, cpu, cuda, cuda:N or mps")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def describe(device: torch.device) -> DeviceInfo:
    """Name, memory and compute capability of ``device`` (initialises CUDA on a CUDA device)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(
            device=str(device),
            name=props.name,
            memory_gib=props.total_memory / GIB,
            capability=(props.major, props.minor),
        )
    if device.type == "mps":
        return DeviceInfo(device="mps", name="Apple GPU (MPS)", memory_gib=None, capability=None)
    return DeviceInfo(device="cpu", name=platform.machine() or "cpu", memory_gib=None, capability=None)


def cap_memory(device: torch.device, max_memory_gib: float | None) -> str | None:
    """Cap what this process may allocate on ``device`` at ``max_memory_gib`` GiB (a volunteer also
    games on that card); returns a note for the person when the cap cannot apply, else None.

    On CUDA this sets :func:`torch.cuda.set_per_process_memory_fraction`: allocations past it raise
    ``torch.OutOfMemoryError`` (which the inner loop answers by halving its micro-batch).
    """
    if max_memory_gib is None:
        return None
    if device.type != "cuda":
        return f"--max-memory {max_memory_gib:g} GiB is ignored on {device.type}: it caps GPU memory only"
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_memory_gib / total), device)
    if max_memory_gib > total:
        return f"--max-memory {max_memory_gib:g} GiB is more than this card has ({total:.1f} GiB): no cap"
    return None


def peak_of(name: str, override: float | None = None) -> float | None:
    """Dense bf16/fp16 peak of the device named ``name`` in TFLOP/s from :data:`PEAK_TFLOPS`, or
    ``override`` (``--peak-tflops``) when given; None when unknown (MFU is then not reported)."""
    if override is not None:
        return override
    found = [key for key in PEAK_TFLOPS if key.lower() in name.lower()]
    return PEAK_TFLOPS[max(found, key=len)] if found else None


def flops_per_token(*, params: int, embedding_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·layers·hidden·seq (PaLM arXiv 2204.02311 appendix B;
    torchtitan's count), N the parameters less the input embedding (a lookup, not a product)."""
    return 6.0 * (params - embedding_params) + 12.0 * layers * hidden * seq_len


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over ``peak`` TFLOP/s; None without a peak."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s * flops_token / (peak * 1e12)


def probe_micro_batch(try_step: Callable[[int], float], *, upper: int, margin: float = 0.1) -> int:
    """The largest micro-batch (sequences) up to ``upper`` that fits with ``margin`` to spare.

    ``try_step(n)`` runs one forward and backward of ``n`` sequences and returns the fraction of
    the memory budget it needed at its peak, or raises ``torch.OutOfMemoryError``. A size fits when
    it raises nothing and needed at most ``1 − margin``. Halves from ``upper`` to the first size
    that fits, then bisects towards the smallest one that did not (to within 1/8 of the size).

    Raises:
        ConfigError: not even one sequence fits (a smaller model, a larger ``--max-memory`` or
            ``--device cpu``).
    """

    def fits(n: int) -> bool:
        try:
            return try_step(n) <= 1.0 - margin
        except torch.OutOfMemoryError:
            return False

    hi, n = None, upper
    while not fits(n):
        if n == 1:
            # one sequence that does not OOM still trains, without the margin
            try:
                try_step(1)
            except torch.OutOfMemoryError:
                raise ConfigError(
                    "the model does not fit this device even at one sequence per micro-batch; "
                    "raise --max-memory, train a smaller run, or use --device cpu"
                ) from None
            return 1
        hi, n = n, n // 2
    lo = n
    while hi is not None and hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Placement:
    """Where and how this peer's inner loop runs: resolved once at start (:func:`place`)."""

    info: DeviceInfo
    precision: Precision
    compile: bool
    """Whether the forward runs through torch.compile."""
    micro_batch_sequences: int | None
    """Sequences per micro-batch as asked (None: the whole batch on CPU/MPS, probed on CUDA)."""
    peak_tflops: float | None
    """Dense bf16/fp16 peak for MFU (None: MFU not reported)."""
    memory_budget_gib: float | None = None
    """CUDA memory this peer may use, GiB: the card's, or less under ``--max-memory`` (None elsewhere)."""
    devices: tuple[str, ...] = ()
    """Every device of the peer when it trains on several (rank 0's first, peer/train/ddp.py); else ()."""
    max_memory_gib: float | None = None
    """``--max-memory``, GiB per card (each rank caps its own)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (``--activation-checkpointing``): about a third more compute for a fraction of the activation
    memory, for the larger presets on small cards."""

    @property
    def device(self) -> torch.device:
        return torch.device(self.info.device)

    def event_fields(self) -> dict:
        """The device part of the ``started`` event."""
        cap = self.info.capability
        return dict(
            device=",".join(self.devices) or self.info.device,
            ranks=max(1, len(self.devices)),
            device_name=self.info.name,
            device_memory_gib=None if self.info.memory_gib is None else round(self.info.memory_gib, 2),
            compute_capability=None if cap is None else f"{cap[0]}.{cap[1]}",
            precision=self.precision.name,
            compile=self.compile,
            peak_tflops=self.peak_tflops,
            activation_checkpointing=self.activation_checkpointing,
        )


def place(
    device: str = "auto",
    *,
    precision: str = "auto",
    compile: bool | None = None,
    micro_batch_sequences: int | None = None,
    max_memory_gib: float | None = None,
    peak_tflops: float | None = None,
    activation_checkpointing: bool = False,
) -> tuple[Placement, list[str]]:
    """Resolve ``--device`` and the settings that follow from it; returns the placement and notes
    for the person (settings that cannot apply here). Initialises CUDA on a CUDA device: call it
    after the averager process was forked.

    Args:
        device: one device, a comma-separated list or ``cuda:all`` (:func:`resolve_devices`); with
            several, the placement describes rank 0's and lists all in ``devices``.
        compile: None: on for CUDA, off elsewhere.
        max_memory_gib: cap on CUDA memory each card's process may use (ignored with a note elsewhere).
        peak_tflops: one card's dense bf16/fp16 peak, for cards the table does not know; with several
            devices the peer's peak (for MFU) is the sum over its cards.

    Raises:
        ConfigError: a device this machine lacks, or a precision its card cannot run.
    """
    torch_devices = resolve_devices(device)
    torch_device = torch_devices[0]
    infos = [describe(d) for d in torch_devices]
    info = infos[0]
    # one precision for every rank (a scaler on one rank only would let θ drift apart): fp16 if any card lacks bf16
    choices = [choose_precision(i.type, i.capability, precision) for i in infos]
    chosen = choices[0] if len({c.name for c in choices}) == 1 else FP16
    notes = [n for n in [cap_memory(torch_device, max_memory_gib)] if n]
    if info.type == "cuda":
        peaks = [p for p in (peak_of(i.name, peak_tflops) for i in infos) if p is not None]
        peak = sum(peaks) if len(peaks) == len(infos) else None
    else:
        peak = None if peak_tflops is None else peak_tflops * len(infos)
    budget = None
    if info.memory_gib is not None:
        budget = min(info.memory_gib, max_memory_gib) if max_memory_gib is not None else info.memory_gib
    devices = tuple(str(d) for d in torch_devices) if len(torch_devices) > 1 else ()
    return Placement(
        info=info,
        precision=chosen,
        compile=info.type == "cuda" if compile is None else compile,
        micro_batch_sequences=micro_batch_sequences,
        peak_tflops=peak,
        memory_budget_gib=budget,
        devices=devices,
        max_memory_gib=max_memory_gib,
        activation_checkpointing=activation_checkpointing,
    ), notes


def training_memory_bytes(
    *, params: int, layers: int, hidden: int, intermediate: int, vocab_size: int, micro_batch: int, seq_len: int
) -> tuple[float, float]:
    """Computed (not measured) device memory of one inner step under bf16 autocast with AdamW:
    ``(states, activations)`` in bytes.

    states = 16 bytes per parameter (fp32 weights, fp32 gradients, AdamW's two fp32 moments) plus
    4 for the trainer's copy of the model that evaluates φ; activations per token ≈ layers·(22·hidden
    + 8·intermediate) bytes kept for the backward (fp32 residual and norm inputs, bf16 projections
    and SwiGLU products; SDPA keeps no seq² scores) + 10·vocab (bf16 logits, their fp32 copy and its
    gradient). :func:`probe_micro_batch` measures the real figure on the card at start.
    """
    states = 20.0 * params
    per_token = layers * (22.0 * hidden + 8.0 * intermediate) + 10.0 * vocab_size
    return states, per_token * micro_batch * seq_len
