"""Local checkpoints: one safetensors file per peer and run, written atomically.

The file holds φ, the outer momentum, θ and the AdamW moments as named tensors, and the peer's
position (round, cumulative inner step, steps done in the current round) as string metadata.
It is written to a temporary file in the same directory, fsynced, then renamed over the old
one, so a crash at any moment leaves either the old or the new checkpoint, never a torn file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from protocol.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"


@dataclass
class PeerState:
    """Everything a peer needs to resume. Tensors are fp32 CPU, in model.named_parameters order."""

    run_id: str
    round: int
    inner_step: int
    """Cumulative inner steps of φ's history (indexes the inner lr schedule)."""
    round_step: int
    """Inner steps already done in the current round (0 at a round boundary)."""
    round_tokens: int
    names: list[str]
    phi: list[torch.Tensor]
    momentum: list[torch.Tensor]
    theta: list[torch.Tensor]
    adam_exp_avg: list[torch.Tensor] | None = None
    adam_exp_avg_sq: list[torch.Tensor] | None = None
    adam_step: int = 0


def save_checkpoint(path: Path, state: PeerState) -> None:
    """Write ``state`` to ``path`` atomically.

    Raises:
        CheckpointError: the directory is not writable; any previous checkpoint is left intact.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for i, name in enumerate(state.names):
        tensors[f"phi.{name}"] = state.phi[i]
        tensors[f"momentum.{name}"] = state.momentum[i]
        tensors[f"theta.{name}"] = state.theta[i]
        if state.adam_exp_avg is not None and state.adam_exp_avg_sq is not None:
            tensors[f"adam_exp_avg.{name}"] = state.adam_exp_avg[i]
            tensors[f"adam_exp_avg_sq.{name}"] = state.adam_exp_avg_sq[i]
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
    metadata = {
        "format": FORMAT_VERSION, "run_id": state.run_id, "round": str(state.round),
        "inner_step": str(state.inner_step), "round_step": str(state.round_step),
        "round_tokens": str(state.round_tokens), "adam_step": str(state.adam_step),
        "names": ",".join(state.names),
    }
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror}; the previous one is intact") from exc
    finally:
        if tmp.exists():
            tmp.unlink()


def _remove_stale_temporaries(path: Path) -> None:
    """Delete what writes killed midway left beside ``path``: our ``.NAME.tmpPID`` files and the
    ``.tmpXXXXXX`` files safetensors writes before renaming. The directory belongs to this peer
    and run; the checkpoint itself is never touched."""
    for leftover in path.parent.iterdir():
        if leftover.name.startswith((f".{path.name}.tmp", ".tmp")) and leftover.is_file():
            try:
                leftover.unlink()
            except OSError:
                pass


def load_checkpoint(path: Path, *, run_id: str, names: list[str], shapes: list[torch.Size]) -> PeerState:
    """Read and check a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: unreadable, another run's, or tensors that do not match the model.
    """
    path = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable ({exc}); move it away to start fresh") from exc
    if metadata.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {metadata.get('format')!r}, expected {FORMAT_VERSION}")
    if metadata.get("run_id") != run_id:
        raise CheckpointError(f"checkpoint {path} belongs to run {metadata.get('run_id')}, not {run_id}")
    if metadata.get("names", "").split(",") != names:
        raise CheckpointError(f"checkpoint {path} was written for a different model; move it away to start fresh")

    def group(prefix: str, required: bool = True) -> list[torch.Tensor] | None:
        out = []
        for name, shape in zip(names, shapes):
            tensor = tensors.get(f"{prefix}.{name}")
            if tensor is None:
                if required:
                    raise CheckpointError(f"checkpoint {path} lacks tensor {prefix}.{name}")
                return None
            if tensor.shape != shape or not torch.isfinite(tensor).all():
                raise CheckpointError(f"checkpoint {path} tensor {prefix}.{name} has shape {tuple(tensor.shape)} "
                                      f"or non-finite values, expected finite {tuple(shape)}")
            out.append(tensor)
        return out

    try:
        position = {k: int(metadata[k]) for k in ("round", "inner_step", "round_step", "round_tokens", "adam_step")}
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has malformed metadata ({exc})") from exc
    return PeerState(run_id=run_id, names=names, phi=group("phi"), momentum=group("momentum"),
                     theta=group("theta"), adam_exp_avg=group("adam_exp_avg", False),
                     adam_exp_avg_sq=group("adam_exp_avg_sq", False), **position)


def export_phi(directory: Path, *, names: list[str], phi: list[torch.Tensor], run_id: str, round_: int) -> Path:
    """Write φ as ``phi-round-NNNNNN.safetensors`` in ``directory`` (named fp32 tensors; metadata
    run_id and round) for people who want the model; returns the path.

    Raises:
        CheckpointError: the file cannot be written.
    """
    path = Path(directory) / f"phi-round-{round_:06d}.safetensors"
    try:
        save_file({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in zip(names, phi, strict=True)},
                  str(path), metadata={"run_id": run_id, "round": str(round_)})
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror}") from exc
    return path
