"""Error feedback: the compression residuals a peer carries from one sync to the next.

Part of the peer's sync state, not of the wire: the codecs (:mod:`protocol.codecs`) only encode
and decode; what they dropped is kept here, staged while a sync runs and made current only once
it succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ErrorFeedback:
    """Per-peer compression residuals e, one fp32 buffer per tensor (zeros until first committed).

    Error feedback (EF-SGD; SparseLoCo; docs/algorithms.md §3): a peer sends C(Δ + e) and keeps
    e ← (Δ + e) − C(Δ + e), so what compression drops in one round is sent in a later one and
    the running sum of decoded updates stays within one residual of the sum of Δ. Residuals are
    staged during a sync and made current by :meth:`commit` only once it succeeded;
    :meth:`rollback` keeps the previous residuals (the peer applied its own Δ).

    Args:
        shapes: one shape per tensor, in payload order.
    """

    def __init__(self, shapes: Sequence[Sequence[int]]):
        self.shapes = [torch.Size(s) for s in shapes]
        self._e: list[torch.Tensor | None] = [None] * len(self.shapes)
        self._staged: list[tuple[int, slice | None, torch.Tensor]] = []

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
        return x.detach().float().clone() if e is None else x.detach().float() + e

    def stage(self, index: int, compensated: torch.Tensor, decoded: torch.Tensor, rows: slice | None = None) -> None:
        """Stage ``e[index][rows] = compensated − decoded``; current residuals are unchanged until commit."""
        self._staged.append((index, rows, compensated.detach().float() - decoded.detach().float()))

    def commit(self) -> None:
        """Make the staged residuals current (the sync succeeded)."""
        for index, rows, residual in self._staged:
            buf = self._buffer(index)
            (buf if rows is None else buf[rows]).copy_(residual)
        self._staged.clear()

    def rollback(self) -> None:
        """Drop the staged residuals (the sync failed)."""
        self._staged.clear()

    def _buffer(self, index: int) -> torch.Tensor:
        buffer = self._e[index]
        if buffer is None:
            buffer = self._e[index] = torch.zeros(self.shapes[index], dtype=torch.float32)
        return buffer

    def state_tensors(self) -> list[torch.Tensor]:
        """The residual buffers (fp32, one per tensor), for checkpoints; loading copies into them."""
        return [self._buffer(i) for i in range(len(self.shapes))]

    def residuals(self) -> list[torch.Tensor] | None:
        """Copies of the committed residuals (fp32, one per tensor, zeros where none was committed
        yet), or None while nothing was ever committed. Staged residuals of a sync that has not
        completed are not included: a checkpoint holds what the next sync would add."""
        if all(e is None for e in self._e):
            return None
        return [torch.zeros(shape) if e is None else e.clone() for e, shape in zip(self._e, self.shapes)]

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
        self._e = [r.detach().to(torch.float32).clone() for r in residuals]
        self._staged.clear()
