"""Local checkpoints: one safetensors file per peer and run, written atomically.

Format 2 holds, as named tensors: φ, the outer state, θ and the AdamW moments (``phi.<name>``,
``momentum.<name>``, ``theta.<name>``, ``adam_exp_avg[_sq].<name>``), the error-feedback residuals
(``residual.<name>``, only when the run's codec keeps them) and the data sampler's generator state
(``data.rng``, uint8); as string metadata: the position (round, cumulative inner step, steps and
tokens done in the current round), AdamW's step, the sampler's seed and batches drawn. Nothing is
pickled. A format 1 file (before residuals and data position) still loads, with a note of what
it lacked. The file is written tensor by tensor from the tensors as the peer holds them
(peer/state/safetensors_stream.py: at most one tensor's copy at a time, none for host fp32 tensors)
in a private directory beside it, fsynced, then renamed over the old one, so a crash at any moment
leaves either the old or the new checkpoint, never a torn file.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from peer.net.lifetime import yield_to_training
from peer.state.safetensors_stream import save_atomically
from peer.train.data import BatchSampler, SamplerState
from peer.train.outer import first_non_finite
from protocol.errors import CheckpointError, HelperDied

logger = logging.getLogger(__name__)

FORMAT_VERSION = "2"
_OLDER_FORMATS = {
    "1": "it holds no data position and no error-feedback residuals: resuming φ, the outer state and "
    "AdamW; this peer samples its shard from its seed again and its residuals start from zero",
}
"""Formats that still load: what each lacks and what the peer does instead."""


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
    residuals: list[torch.Tensor] | None = None
    """Error-feedback residuals, one per parameter (None: the codec keeps none, or none yet)."""
    data: SamplerState | None = None
    """Where this peer's data sampler stands (None: not saved; format 1)."""
    vouchers: dict[str, int] | None = None
    """This peer's ledger of vouchers (peer/state/vouching.py: peer id → round first seen in a completed
    group); None: not saved (older files)."""
    phi_eval: tuple[str, float] | None = None
    """(hex digest of the state snapshot of φ and the outer state, validation loss of φ in nats/token):
    the last evaluation of this φ, when the peer had one (peer/round/publishing.py ``measured_phi``);
    None: none, or not saved (older files)."""
    upgrade_note: str | None = None
    """Set by :func:`load_checkpoint` for an older format: what the file lacked, for a warning."""


@dataclass(frozen=True)
class CheckpointFile:
    """A checkpoint encoded for writing: its named tensors and string metadata. A tensor is either
    a copy made by :func:`encode_checkpoint` or one the caller holds (any device, any float dtype;
    :func:`write_checkpoint` writes it as fp32, one tensor's copy at a time at most), which the
    caller leaves unchanged while it is written: until the write's ``released`` event for those
    named in ``live``, until the write ends for the others."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    live: frozenset[str] = frozenset()
    """Names of ``tensors`` that are the trainer's own and that it changes again once they are
    written: written first, then :func:`write_checkpoint`'s ``released`` is set."""


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32).contiguous().clone()


def encode_checkpoint(state: PeerState, *, private: Collection[str] = (), live: Collection[str] = ()) -> CheckpointFile:
    """``state`` as the file's named tensors and string metadata: the groups named in ``private``
    or ``live`` referenced as they are, every other copied now (fp32 CPU, contiguous: a model-sized
    copy each, for a caller that changes them before the write ends), the data position's
    generator state always copied (bytes).

    Args:
        private: the groups of ``state`` (e.g. ``"phi"``, ``"momentum"``, ``"residual"``) that
            nothing changes while the file is written (a state snapshot's, peer/state/snapshot.py;
            residuals fetched from the averager; anything while the trainer is stopped).
        live: the groups (``"theta"``, ``"adam_exp_avg"``, ``"adam_exp_avg_sq"``) that the trainer
            leaves unchanged only until :func:`write_checkpoint`'s ``released`` is set: written
            first.

    Raises:
        CheckpointError: φ or the outer state holds NaN or inf (issue #51: a poisoned φ must never
            outlive a restart); nothing is encoded, the previous checkpoint file is left as it is.
    """
    bad = first_non_finite([*state.phi, *state.momentum])
    if bad is not None:
        k = bad if bad < len(state.phi) else bad - len(state.phi)
        what = f"{'φ' if bad < len(state.phi) else 'the outer state'} ({state.names[k] if k < len(state.names) else k})"
        raise CheckpointError(
            f"refusing to write a checkpoint of round {state.round}: {what} holds NaN or inf; "
            "the previous checkpoint is kept"
        )
    groups = {"phi": state.phi, "momentum": state.momentum, "theta": state.theta, "residual": state.residuals}
    if state.adam_exp_avg is not None and state.adam_exp_avg_sq is not None:
        groups.update(adam_exp_avg=state.adam_exp_avg, adam_exp_avg_sq=state.adam_exp_avg_sq)
    tensors = {
        f"{prefix}.{name}": t.detach() if prefix in private or prefix in live else _host_copy(t)
        for prefix, group in groups.items()
        if group is not None
        for name, t in zip(state.names, group, strict=True)
    }
    metadata = {
        "format": FORMAT_VERSION,
        "run_id": state.run_id,
        "round": str(state.round),
        "inner_step": str(state.inner_step),
        "round_step": str(state.round_step),
        "round_tokens": str(state.round_tokens),
        "adam_step": str(state.adam_step),
        "names": ",".join(state.names),
    }
    if state.vouchers is not None:
        metadata["vouchers"] = json.dumps(state.vouchers, sort_keys=True)
    if state.phi_eval is not None:
        metadata.update(phi_eval_digest=state.phi_eval[0], phi_eval_loss=repr(float(state.phi_eval[1])))
    if state.data is not None:
        tensors["data.rng"] = state.data.rng.detach().to("cpu").contiguous().clone()
        metadata.update(data_seed=str(state.data.seed), batches_drawn=str(state.data.batches_drawn))
        if state.data.shard >= 0:  # a sharded corpus's position (peer/shards/stream.py)
            metadata.update(data_shard=str(state.data.shard), data_shard_offset=str(state.data.shard_offset))
    return CheckpointFile(
        tensors=tensors, metadata=metadata, live=frozenset(k for k in tensors if k.split(".", 1)[0] in live)
    )


def write_checkpoint(path: Path, file: CheckpointFile, *, released: threading.Event | None = None) -> None:
    """Write an encoded checkpoint to ``path`` atomically (a private temporary file beside it,
    fsync, rename, fsync of the directory), tensor by tensor from the tensors as ``file`` holds
    them: the process holds at most one tensor's copy more while it writes (none for contiguous
    fp32 host tensors; peer/state/safetensors_stream.py).

    Args:
        released: set once ``file.live``'s tensors are in the file (they are written first), so
            the trainer may change them again; set in any case, failure included, before this
            returns or raises.

    Raises:
        CheckpointError: the directory is not writable; any previous checkpoint is left intact.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path.parent)
        save_atomically(path, file.tensors, file.metadata, first=file.live, released=released)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror}; the previous one is intact") from exc
    finally:
        if released is not None:
            released.set()


def save_checkpoint(path: Path, state: PeerState) -> None:
    """Write ``state`` to ``path`` atomically, in format :data:`FORMAT_VERSION`.

    Raises:
        CheckpointError: the directory is not writable; any previous checkpoint is left intact.
    """
    write_checkpoint(path, encode_checkpoint(state, private=_GROUPS))


_GROUPS = ("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq", "residual")
"""Every tensor group of a checkpoint (:func:`encode_checkpoint`'s ``private``: all referenced)."""


class CheckpointWriter:
    """Writes encoded checkpoints (and φ exports) in one background thread, in order, so the round
    loop does not wait for the disk (a checkpoint of a 125M-parameter peer is ~2.5 GB).

    Not thread-safe itself: one thread (the round loop) calls every method. A write that failed
    raises its CheckpointError from a later :meth:`submit` or from :meth:`flush`, on the caller's
    thread. At most two writes are queued; a third waits for the oldest.
    """

    def __init__(self) -> None:
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="locoswarm-checkpoint", initializer=yield_to_training
        )
        self._pending: list = []

    def submit(self, path: Path, file: CheckpointFile) -> None:
        """Write ``file`` to ``path`` in the background, after the writes queued before it.

        Raises:
            CheckpointError: an earlier background write failed (this one is not started).
        """
        self.submit_call(lambda: write_checkpoint(path, file))

    def submit_call(self, call: Callable[[], object]) -> None:
        """Run ``call`` (a write into the peer's run directory, e.g. :func:`export_phi` of a copy of
        φ) in the background thread, after the writes queued before it: one thread writes there,
        so :func:`write_checkpoint`'s removal of what killed writes left never meets a write under way.

        Raises:
            CheckpointError: an earlier background write failed (this one is not started).
        """
        self._reap(keep=1)
        self._pending.append(self._pool.submit(call))

    def idle(self) -> bool:
        """Whether every queued write has finished (a call submitted now starts at once)."""
        return all(f.done() for f in self._pending)

    def flush(self) -> None:
        """Wait for every queued write.

        Raises:
            CheckpointError: one failed (the checkpoint before it is intact); the rest are still
                waited for by the next call.
        """
        self._reap(keep=0)

    def _reap(self, *, keep: int) -> None:
        """Take the results of the finished writes, oldest first, and wait while more than ``keep``
        are queued; the first failure raises."""
        while self._pending and (self._pending[0].done() or len(self._pending) > keep):
            self._pending.pop(0).result()


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete what writes killed midway left in ``directory``: the private ``.NAME.tmpPID``
    directories (and files, from older versions) of processes no longer alive, and the bare
    ``.tmpXXXXXX`` files older versions let safetensors write beside the checkpoint. A live
    process's write under way (another peer of the same process included) is never touched; the
    checkpoint itself never is."""
    for leftover in directory.iterdir():
        name = leftover.name
        if not name.startswith("."):
            continue
        head, sep, pid = name.rpartition(".tmp")
        if sep and head and pid.isdigit():
            if _alive(int(pid)):
                continue
        elif not (name.startswith(".tmp") and leftover.is_file()):
            continue  # no write of this version leaves a bare .tmpXXXXXX: an older version's leftover
        try:
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether a process with this id exists (ours counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def move_aside(path: Path, *, now: datetime | None = None) -> Path:
    """Rename a checkpoint this peer will not use (unreadable, another run's, another model's) to
    ``<name>.corrupt-<UTC time>`` beside it, so the next write cannot overwrite what may be a
    volunteer's only copy (issue #68, item 7). Never overwrites a file: a name already taken gets
    ``-1``, ``-2``, ... appended; nothing is deleted.

    Args:
        path: the checkpoint file.
        now: the time the name carries (default: now).

    Returns:
        Where the file now is.

    Raises:
        CheckpointError: it could not be renamed (the message says why); it is left where it was.
    """
    path = Path(path)
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1000):
        target = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n else ""))
        try:
            os.link(path, target)  # fails on an existing name, unlike a rename
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise CheckpointError(f"cannot move checkpoint {path} aside: {exc.strerror or exc}") from exc
            if target.exists():  # a file system without hard links: look before the rename
                continue
            try:
                os.rename(path, target)
            except OSError as again:
                raise CheckpointError(f"cannot move checkpoint {path} aside: {again.strerror or again}") from again
            return target
        try:
            path.unlink()
        except OSError as exc:
            raise CheckpointError(f"moved checkpoint {path} to {target} but cannot remove it: {exc.strerror}") from exc
        return target
    raise CheckpointError(f"cannot move checkpoint {path} aside: 1000 names beside it are taken")


def load_checkpoint(path: Path, *, run_id: str, names: list[str], shapes: list[torch.Size]) -> PeerState:
    """Read and check a checkpoint written by :func:`save_checkpoint` (this format or an older one
    that still loads; then :attr:`PeerState.upgrade_note` says what it lacked).

    Raises:
        CheckpointError: unreadable, of an unknown format, another run's, or tensors that do not
            match the model (wrong shape, non-finite, or an optional group only partly present).
    """
    path = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable ({exc})") from exc
    version = metadata.get("format")
    if version != FORMAT_VERSION and version not in _OLDER_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} has format {version!r}, expected {FORMAT_VERSION} (or {', '.join(_OLDER_FORMATS)})"
        )
    if metadata.get("run_id") != run_id:
        raise CheckpointError(f"checkpoint {path} belongs to run {metadata.get('run_id')}, not {run_id}")
    if metadata.get("names", "").split(",") != names:
        raise CheckpointError(f"checkpoint {path} was written for a different model")

    def refuse(key: str, tensor: torch.Tensor, shape: torch.Size) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} tensor {key} has shape {tuple(tensor.shape)} "
            f"or non-finite values, expected finite {tuple(shape)}"
        )

    checked: list[tuple[str, torch.Tensor, torch.Size]] = []
    """Every tensor a group took, for one finiteness test of them all (:func:`finite_or_refuse`)."""

    def group(prefix: str) -> list[torch.Tensor]:
        found = []
        for name, shape in zip(names, shapes):
            key = f"{prefix}.{name}"
            tensor = tensors.get(key)
            if tensor is None:
                raise CheckpointError(f"checkpoint {path} lacks tensor {key}")
            if tensor.shape != shape:
                raise refuse(key, tensor, shape)
            checked.append((key, tensor, shape))
            found.append(tensor)
        return found

    def finite_or_refuse() -> None:
        # one reduction per tensor and one host read for them all (peer/train/outer.py), not a
        # boolean copy of each: the first read of a file's pages, most of a restart's restore time
        bad = first_non_finite([t for _, t, _ in checked])
        if bad is not None:
            raise refuse(*checked[bad])

    def optional_group(prefix: str) -> list[torch.Tensor] | None:
        """None when the checkpoint holds none of ``prefix``'s tensors."""
        return None if all(tensors.get(f"{prefix}.{name}") is None for name in names) else group(prefix)

    try:
        position = {k: int(metadata[k]) for k in ("round", "inner_step", "round_step", "round_tokens", "adam_step")}
        rng = tensors.get("data.rng")
        data = (
            None
            if rng is None
            else SamplerState(
                seed=int(metadata["data_seed"]),
                batches_drawn=int(metadata["batches_drawn"]),
                rng=rng,
                shard=int(metadata.get("data_shard", -1)),
                shard_offset=int(metadata.get("data_shard_offset", 0)),
            )
        )
        vouchers = _vouchers(metadata.get("vouchers"))
        phi_eval = _phi_eval(metadata.get("phi_eval_digest"), metadata.get("phi_eval_loss"))
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has malformed metadata ({exc})") from exc
    if rng is not None and (rng.dtype != torch.uint8 or rng.dim() != 1):
        raise CheckpointError(
            f"checkpoint {path} tensor data.rng is {rng.dtype} {tuple(rng.shape)}, expected 1-D uint8"
        )
    phi, momentum, theta = group("phi"), group("momentum"), group("theta")
    adam_exp_avg, adam_exp_avg_sq = optional_group("adam_exp_avg"), optional_group("adam_exp_avg_sq")
    residuals = optional_group("residual")
    finite_or_refuse()
    return PeerState(
        run_id=run_id,
        names=names,
        phi=phi,
        momentum=momentum,
        theta=theta,
        adam_exp_avg=adam_exp_avg,
        adam_exp_avg_sq=adam_exp_avg_sq,
        residuals=residuals,
        data=data,
        vouchers=vouchers,
        phi_eval=phi_eval,
        **position,
        upgrade_note=None
        if version == FORMAT_VERSION
        else f"checkpoint {path} is of format {version}: {_OLDER_FORMATS[version]}",
    )


def _vouchers(text: str | None) -> dict[str, int] | None:
    """The ``vouchers`` metadata: JSON object peer id → round >= 0, or None when absent.

    Raises:
        ValueError: not such an object.
    """
    if text is None:
        return None
    value = json.loads(text)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items()
    ):
        raise ValueError("vouchers: expected a JSON object of peer id -> round >= 0")
    return value


def _phi_eval(digest: str | None, loss: str | None) -> tuple[str, float] | None:
    """The ``phi_eval_digest`` and ``phi_eval_loss`` metadata: (a snapshot's hex digest, a finite loss
    >= 0), or None when absent.

    Raises:
        ValueError: one without the other, or either malformed.
    """
    if digest is None and loss is None:
        return None
    if digest is None or loss is None:
        raise ValueError("phi_eval_digest and phi_eval_loss: expected both or neither")
    value = float(loss)
    if not 0 < len(digest) <= 128 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"phi_eval_digest: expected hex digits, got {digest[:140]!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"phi_eval_loss: expected a finite loss >= 0, got {loss[:40]!r}")
    return digest, value


def fetch_residuals(fetch: Callable[[], list[torch.Tensor] | None]) -> tuple[list[torch.Tensor] | None, str | None]:
    """The error-feedback residuals for a checkpoint from ``fetch`` (NetworkTransport's, which asks the
    averager process), and None or a warning saying the checkpoint lacks them (it did not answer)."""
    try:
        return fetch(), None
    except (OSError, HelperDied) as exc:  # TimeoutError included
        return None, (
            f"this checkpoint lacks the error-feedback residuals: the averager process did not hand them over ({exc!r})"
        )


def restore_extras(
    state: PeerState, *, load_residuals: Callable[[list[torch.Tensor]], int], sampler: BatchSampler
) -> tuple[int, list[str]]:
    """Give what a loaded checkpoint holds beyond the trainer's own tensors to its owners: the
    residuals to ``load_residuals`` (NetworkTransport's, into the averager process), the data
    position to ``sampler``.

    Returns:
        The number of residual tensors taken, and warnings for what could not be restored (each
        then starts afresh: residuals from zero, the sampler from its seed) or the file lacked.
    """
    taken, problems = 0, [state.upgrade_note] if state.upgrade_note else []
    try:
        taken = load_residuals(state.residuals) if state.residuals is not None else 0
    except (ValueError, OSError) as exc:
        problems.append(f"error-feedback residuals not restored, they start from zero: {exc!r}")
    try:
        if state.data is not None:
            sampler.load_state(state.data)
    except ValueError as exc:
        problems.append(f"data position not restored, this peer samples its shard from its seed again: {exc}")
    return taken, problems


def export_phi(directory: Path, *, names: list[str], phi: list[torch.Tensor], run_id: str, round_: int) -> Path:
    """Write φ as ``phi-round-NNNNNN.safetensors`` in ``directory`` (named fp32 tensors; metadata
    run_id and round) for people who want the model; returns the path.

    Raises:
        CheckpointError: the file cannot be written.
    """
    path = Path(directory) / f"phi-round-{round_:06d}.safetensors"
    try:
        save_atomically(
            path, {n: t.detach() for n, t in zip(names, phi, strict=True)}, {"run_id": run_id, "round": str(round_)}
        )
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    return path
