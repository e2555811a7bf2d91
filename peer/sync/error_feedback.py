"""Error feedback: what a peer's Δ sent in one sync lost, carried into its next contribution.

Part of the peer's sync state, not of the wire: the codecs (:mod:`protocol.codecs`) only encode
and decode; what they dropped is kept here, staged while a sync runs and made current only once
it succeeded. In an eager or streaming sync the same residuals carry a piece's whole Δ when
the group's receipts skipped that piece (peer/sync/receipts.py: its owner lied), with any codec:
every peer then re-sends its own Δ of that piece in its next contribution, instead of losing the
round's work there. A blocking or delayed sync does not (``SyncRequest.carry_skipped``): its landing
keeps θ's own progress on those rows (``SyncReport.kept_rows``; peer/train/streaming.py ``land``,
peer/train/overlap.py ``keep_skipped_progress``), so the next Δ holds it; carrying it as well would
send it twice.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from protocol.manifest import CompressionSpec
from protocol.wire.pieces import Piece


def keeps_residuals(compression: CompressionSpec) -> bool:
    """Whether a run with ``compression`` carries its codec's error (a lossy codec with
    ``error_feedback`` on); otherwise residuals hold only the Δ of pieces the receipts skipped,
    and checkpoints hold none."""
    return compression.error_feedback and compression.codec != "none"


RESIDUAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``compression.residual_dtype`` → the dtype residuals are kept in."""


class ErrorFeedback:
    """Per-peer compression residuals e, one buffer per tensor (zeros until first committed).

    Error feedback (EF-SGD; SparseLoCo; docs/algorithms.md §3): a peer sends C(Δ + e) and keeps
    e ← (Δ + e) − C(Δ + e), so what compression drops in one round is sent in a later one and
    the running sum of decoded updates stays within one residual of the sum of Δ. Residuals are
    staged during a sync and made current by :meth:`commit` only once it succeeded;
    :meth:`rollback` keeps the previous residuals (the peer applied its own Δ).

    Args:
        shapes: one shape per tensor, in payload order.
        dtype: what the residuals are kept in (committed and staged): fp32, or bf16 for half the
            memory (each residual rounded to bf16's 8-bit mantissa when staged; the rounding error is
            not carried). :meth:`compensate` computes in fp32 either way.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32):
        self.shapes, self.dtype = [torch.Size(s) for s in shapes], dtype
        self._e: list[torch.Tensor | None] = [None] * len(self.shapes)
        self._staged: list[tuple[int, slice | None, torch.Tensor | None]] = []
        """(tensor, dim-0 rows, residual) per staged piece; None: a zero residual (nothing lost)."""

    def holds(self, index: int) -> bool:
        """Whether tensor ``index`` has a committed residual buffer (until then its residual is zero)."""
        return self._e[index] is not None

    def _view(self, index: int, rows: slice | None) -> torch.Tensor | None:
        e = self._e[index]
        return None if e is None else (e if rows is None else e[rows])

    def compensate(self, index: int, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``x + e[index][rows]`` as a new fp32 tensor (rows: a dim-0 slice of tensor ``index``)."""
        full = self.shapes[index]
        expected = full if rows is None else torch.empty(full, device="meta")[rows].shape
        if x.shape != expected:
            raise ValueError(
                f"tensor {index}{'' if rows is None else f' rows {rows}'}: shape {tuple(x.shape)}, "
                f"expected {tuple(expected)}"
            )
        e = self._view(index, rows)
        return x.detach().float().clone() if e is None else x.detach().float() + e.float()

    def stage(self, index: int, compensated: torch.Tensor, decoded: torch.Tensor, rows: slice | None = None) -> None:
        """Stage ``e[index][rows] = compensated − decoded``; current residuals are unchanged until commit.
        ``decoded is compensated`` (sent exactly: an exact codec, or an owner's own rows) stages a zero
        residual without a tensor of zeros, so a sync holds staged residuals only for what its codec
        dropped."""
        if decoded is compensated:
            self._staged.append((index, rows, None))
            return
        self._staged.append((index, rows, (compensated.detach().float() - decoded.detach().float()).to(self.dtype)))

    def commit(self) -> None:
        """Make the staged residuals current (the sync succeeded)."""
        for index, rows, residual in self._staged:
            if residual is None and self._e[index] is None:
                continue  # a zero residual where none is held yet
            buf = self._buffer(index)
            target = buf if rows is None else buf[rows]
            if residual is None:
                target.zero_()
            else:
                target.copy_(residual)
        self._staged.clear()

    def rollback(self) -> None:
        """Drop the staged residuals (the sync failed)."""
        self._staged.clear()

    def _buffer(self, index: int) -> torch.Tensor:
        buffer = self._e[index]
        if buffer is None:
            buffer = self._e[index] = torch.zeros(self.shapes[index], dtype=self.dtype)
        return buffer

    def state_tensors(self) -> list[torch.Tensor]:
        """The residual buffers (:attr:`dtype`, one per tensor), for checkpoints; loading copies into them."""
        return [self._buffer(i) for i in range(len(self.shapes))]

    def residuals(self) -> list[torch.Tensor] | None:
        """Copies of the committed residuals (:attr:`dtype`, one per tensor, zeros where none was committed
        yet), or None while nothing was ever committed. Staged residuals of a sync that has not
        completed are not included: a checkpoint holds what the next sync would add."""
        if all(e is None for e in self._e):
            return None
        return [
            torch.zeros(shape, dtype=self.dtype) if e is None else e.clone() for e, shape in zip(self._e, self.shapes)
        ]

    def load_residuals(self, residuals: Sequence[torch.Tensor]) -> None:
        """Make ``residuals`` (one per tensor, shaped like it, finite) the current residuals; drops
        anything staged.

        Raises:
            ValueError: wrong count, shape or non-finite values; the residuals are left unchanged.
        """
        if len(residuals) != len(self.shapes):
            raise ValueError(f"{len(residuals)} residual tensors, expected {len(self.shapes)}")
        for i, (r, shape) in enumerate(zip(residuals, self.shapes)):
            if r.shape != shape or not torch.isfinite(r).all():
                raise ValueError(
                    f"residual {i}: shape {tuple(r.shape)} or non-finite values, expected finite {tuple(shape)}"
                )
        self._e = [r.detach().to(self.dtype, copy=True) for r in residuals]
        self._staged.clear()


class SyncFeedback:
    """One sync's error-feedback hooks, :class:`peer.sync.allreduce.GroupAllreduce`'s ``compensate``
    and ``stage``, over a peer's :class:`ErrorFeedback` (thread-safe: encoders run in an executor).

    Args:
        ef: the peer's residuals, one per Δ tensor of its whole payload.
        index: per tensor of the sync's plan, its number in the whole payload (a fragment sync
            plans a subset of the tensors).
        shapes: the planned tensors' shapes.
        phi_from: the first planned tensor that is φ (NoLoCo; φ carries nothing), or None.
        feeds: carry the codec's error (:func:`keeps_residuals`); when False, a piece's residual is
            only ever the Δ the receipts skipped, spent (set to zero) by the next sync that sends it.
    """

    def __init__(
        self,
        ef: ErrorFeedback,
        index: Sequence[int],
        shapes: Sequence[torch.Size],
        phi_from: int | None,
        *,
        feeds: bool,
    ):
        self.ef, self.index, self.shapes, self.phi_from, self.feeds = ef, list(index), list(shapes), phi_from, feeds
        self._lock = threading.Lock()

    def _target(self, piece: Piece) -> tuple[int, slice | None] | None:
        """(residual number, dim-0 rows) of a Δ piece; None for a φ piece."""
        if self.phi_from is not None and piece.tensor >= self.phi_from:
            return None
        rows = None if len(self.shapes[piece.tensor]) == 0 else slice(piece.start, piece.stop)
        return self.index[piece.tensor], rows

    def compensate(self, piece: Piece, x: torch.Tensor) -> torch.Tensor:
        """``x + e`` for the piece (a new fp32 tensor), or ``x`` itself where nothing is carried."""
        target = self._target(piece)
        if target is None or not (self.feeds or self.ef.holds(target[0])):
            return x
        with self._lock:
            return self.ef.compensate(target[0], x, rows=target[1])

    def stage(self, piece: Piece, compensated: torch.Tensor, decoded: torch.Tensor | None) -> None:
        """Stage the piece's residual: ``compensated − decoded`` (with :attr:`feeds`; else zero), or
        all of ``compensated`` when ``decoded`` is None (the receipts skipped the piece: none of it
        was applied)."""
        target = self._target(piece)
        if target is None:
            return
        if decoded is None:
            decoded = torch.zeros_like(compensated)
        elif not self.feeds:
            if not self.ef.holds(target[0]):
                return  # a zero residual where none is held
            decoded = compensated
        with self._lock:
            self.ef.stage(target[0], compensated, decoded, rows=target[1])
