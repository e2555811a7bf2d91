"""The inner loop of a peer serving one pipeline stage (issue #19): stage 0 drives each batch's
micro-batches through the next stages, a stage k > 0 works the calls its server queued; both
step their AdamW as the round loop drives any :class:`~peer.train.inner.InnerLoop`. The link to
the other stages is peer/pipeline/peer.py's :class:`~peer.pipeline.peer.PipelineLink`."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from peer.pipeline.peer import MAX_POISONED_REPLIES, PipelineLink, split_micro_batch_id
from peer.pipeline.stages import PipelineStage
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop, StepResult
from protocol.errors import BadPayload, StageCallFailed
from protocol.wire.pipeline import StageReply, StageRequest


class StageInnerLoop(InnerLoop):
    """The inner loop of a peer serving one pipeline stage; the round loop drives it as it drives an
    :class:`InnerLoop` (same AdamW, lr schedule by cumulative inner step, checkpointable state).

    Stage 0: :meth:`step` draws a batch from ``sampler`` and runs it through the pipeline.
    Stage k > 0 (``paced_by_callers``): :meth:`step` works queued requests of one caller step (the
    step in the micro-batch id, :func:`micro_batch_id`; a late request of an earlier step joins the
    current one) and steps on the mean gradient over the sequences it served when a request of a
    later step arrives; when that request is of the callers' next round (step // H), the result
    says ``ends_round`` and the round loop syncs this stage, as the callers just did. Its loss is
    the mean of the losses it computed or was told by the stages after it. It registers its stage
    server at its first step, so no call waits on a peer still catching up.

    Args:
        stage: this peer's :class:`PipelineStage` (fp32, on ``device``).
        link: its :class:`PipelineLink`.
        stop: set when the peer stops; a step waiting for requests or for a paused pipeline returns
            then, with what it did so far (``tokens`` 0 when nothing).
        Others: as :class:`InnerLoop` (fp32 only: no autocast, no compile).

    Raises (from :meth:`step`):
        BadPayload: the gradient is not finite; θ unchanged by the step.
    """

    def __init__(
        self,
        stage: PipelineStage,
        spec,
        sampler: BatchSampler,
        link: PipelineLink,
        *,
        stop: threading.Event,
        device: torch.device | None = None,
        micro_batch_sequences: int | None = None,
    ):
        super().__init__(stage, spec, sampler, device=device, micro_batch_sequences=micro_batch_sequences)
        self.stage, self.link, self.stop = stage, link, stop
        self.batch_sequences = sampler.batch_sequences
        self.H = link.m.sync.inner_steps
        self.paced_by_callers = not stage.is_first
        # (not InnerLoop's _pending, the steps settle() reads: a stage never steps with wait=False)
        self._held: tuple[StageRequest, concurrent.futures.Future] | None = None
        """The request that closed the last step (of a later caller step): the first of the next."""
        self._caller_step: int | None = None

    @classmethod
    def for_placement(
        cls,
        model: PipelineStage,
        spec,
        sampler: BatchSampler,
        placement=None,
        *,
        link: PipelineLink,
        stop: threading.Event,
    ) -> StageInnerLoop:
        """The loop on ``placement``'s device (one device; the CPU without a placement), with its
        micro-batch; the round loop's ``make_inner`` (peer/round/)."""
        return cls(
            model,
            spec,
            sampler,
            link,
            stop=stop,
            device=placement.device if placement is not None else None,
            micro_batch_sequences=placement.micro_batch_sequences if placement is not None else None,
        )

    def step(self, inner_step: int, *, wait: bool = True) -> StepResult:
        """One AdamW step of this stage at cumulative inner step ``inner_step`` (see the class);
        ``wait`` is InnerLoop's, ignored: a stage reads its loss at once."""
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ends_round = False
        if self.stage.is_first:
            loss, tokens, rows = self._drive(inner_step)
        else:
            if self.link.server is None:
                self.link.serve()
            loss, tokens, rows, ends_round = self._serve_step(inner_step)
        if rows == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(
                loss=0.0, tokens=0, seconds=time.perf_counter() - start, micro_batch=0, ends_round=ends_round
            )
        # clipped per stage (no stage sees the others' gradients); without clipping still checked
        clip = self.spec.grad_clip_norm if self.spec.grad_clip_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if not math.isfinite(norm.item()):
            self.optimizer.zero_grad(set_to_none=True)
            raise BadPayload(f"stage {self.stage.index} gradient norm is {norm.item()} at inner step {inner_step}")
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(inner_step)
        self.optimizer.step()
        return StepResult(
            loss=loss,
            tokens=tokens,
            seconds=time.perf_counter() - start,
            micro_batch=min(self.micro_batch_sequences or self.batch_sequences, self.batch_sequences),
            ends_round=ends_round,
        )

    def _drive(self, inner_step: int) -> tuple[float, int, int]:
        """Stage 0: the step's batch through the pipeline; returns (mean loss, tokens, rows)."""
        batch = self.sampler.next_batch()
        rows = batch.shape[0]
        chunks = batch.split(self.micro_batch_sequences or rows)
        sender = self.link.sender_index()
        loss_sum = tokens = 0.0
        for m, chunk in enumerate(chunks):
            inputs, targets = chunk[:, :-1].to(self.device), chunk[:, 1:]
            out = self.model(inputs)
            acts, ids = out.detach().to("cpu", self.link.wire).contiguous(), targets.to(torch.int32).contiguous()
            try:
                reply, _ = self._backward_next(
                    out,
                    None,
                    functools.partial(
                        self.link.call_next, acts, ids, step=inner_step, index=sender * len(chunks) + m, stop=self.stop
                    ),
                    weight=chunk.shape[0] / rows,
                    what=f"micro-batch {m} of inner step {inner_step}",
                )
            except StageCallFailed:
                if self.stop.is_set():
                    return 0.0, 0, 0  # stopped while paused: no step
                raise
            del out  # its graph (kept for a retry) goes before the next micro-batch's forward
            loss_sum += reply.loss * reply.tokens
            tokens += reply.tokens
        if not math.isfinite(loss_sum):
            self.optimizer.zero_grad(set_to_none=True)
            raise BadPayload(f"training loss is {loss_sum} at inner step {inner_step}")
        return loss_sum / max(tokens, 1), int(tokens), rows

    def _serve_step(self, inner_step: int) -> tuple[float, int, int, bool]:
        """Stage k > 0: work the requests of one caller step; returns (mean loss, tokens, rows,
        whether the callers' round ended). ``.grad`` holds the mean gradient over the rows served.
        A request whose caller left is skipped; one this stage cannot serve is answered STAGE_ERROR."""
        loss_sum, tokens, rows = 0.0, 0, 0
        last_served = time.monotonic()
        while True:
            item, self._held = self._held, None
            if item is None:
                try:
                    item = self.link.requests.get(timeout=0.2)
                except queue.Empty:
                    if self.stop.is_set():
                        break
                    # No request: the stage-0 peers' records say whether their round ended (a replica
                    # the routing passed over, or the run's last round, gets no request to say so).
                    callers = self.link.callers_round()
                    if callers is not None:
                        if self._caller_step is None:
                            self._caller_step = callers * self.H
                        elif callers > self._caller_step // self.H and time.monotonic() - last_served > 0.5:
                            self._caller_step = callers * self.H
                            if rows:
                                self._average_over(rows)
                            return loss_sum / max(tokens, 1), tokens, rows, True
                    continue
            request, future = item
            step, _ = split_micro_batch_id(request.micro_batch)
            if self._caller_step is None:
                self._caller_step = step
            if step > self._caller_step:
                new_round = step // self.H > self._caller_step // self.H
                self._caller_step = step
                if rows or new_round:
                    self._held = item
                    if rows:
                        self._average_over(rows)
                    return loss_sum / max(tokens, 1), tokens, rows, new_round
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up (and retried elsewhere)
            try:
                grad, loss, n = self._serve(request, inner_step)
            except Exception as exc:  # answered as a STAGE_ERROR; the caller retries another replica
                future.set_exception(exc)
                continue
            future.set_result((grad, loss, n))
            last_served = time.monotonic()
            loss_sum += loss * n
            tokens += n
            rows += request.activations.shape[0]
        if rows:
            self._average_over(rows)
        return loss_sum / max(tokens, 1), tokens, rows, False

    def _backward_next(
        self, out: torch.Tensor, x: torch.Tensor | None, call: Callable[[], StageReply], *, weight: float, what: str
    ) -> tuple[StageReply, torch.Tensor | None]:
        """Backward of ``out`` with the gradient the next stage answers (``call()``), times ``weight``,
        added to ``.grad``; returns the reply and the gradient w.r.t. ``x`` (None without ``x``).

        A reply passes the wire's checks when its values are finite, yet a finite gradient can be
        huge (3e38): its backward would make this stage's gradient norm, and so its step,
        non-finite. So the reply's gradients are taken apart from ``.grad`` first, and added only
        when the sum keeps the norm (and the gradient w.r.t. ``x``) finite; else the
        reply's replica counts a failed call and cools down (``PipelineLink.reject_last``) and the
        micro-batch goes to the next replica, at most :data:`MAX_POISONED_REPLIES` times.

        Raises:
            BadPayload: every try was refused; ``.grad`` is as before.
            StageCallFailed: from ``call``.
        """
        params = [p for p in self.params if p.requires_grad]
        inputs = [*params] if x is None else [x, *params]
        problem = ""
        for _ in range(MAX_POISONED_REPLIES):
            reply = call()
            grads = list(
                torch.autograd.grad(
                    out, inputs, reply.grad.to(self.device, out.dtype) * weight, retain_graph=True, allow_unused=True
                )
            )
            x_grad = grads.pop(0) if x is not None else None
            summed = [p.grad if g is None else g if p.grad is None else g.add_(p.grad) for p, g in zip(params, grads)]
            norm = torch.nn.utils.get_total_norm([g for g in summed if g is not None] or [torch.zeros(())])
            if not math.isfinite(norm.item()):
                problem = f"gradient norm would be {norm.item()}"
            elif x_grad is not None and not bool(torch.isfinite(x_grad).all()):
                problem = "the gradient w.r.t. this stage's input would be non-finite"
            else:
                for p, g, new in zip(params, summed, grads):
                    if new is not None:
                        p.grad = g
                return reply, x_grad
            self.link.reject_last(f"{what}: {problem}")
        raise BadPayload(
            f"stage {self.stage.index}: {MAX_POISONED_REPLIES} replies to {what} would make the step "
            f"non-finite (last: {problem})"
        )

    def _average_over(self, rows: int) -> None:
        """Turn ``.grad`` (each micro-batch's weighted by rows / batch_sequences) into the mean over ``rows``."""
        if rows != self.batch_sequences:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.batch_sequences / rows)

    def _serve(self, request: StageRequest, inner_step: int) -> tuple[torch.Tensor, float, int]:
        """One request: forward, (the next stages,) backward into ``.grad`` weighted by the request's
        share of a batch; the gradient w.r.t. the request's activations (its own micro-batch mean
        loss), in the request's dtype, on the host."""
        acts = request.activations
        share = acts.shape[0] / self.batch_sequences
        x = acts.to(self.device).detach().requires_grad_(True)
        out = self.model(x)
        if self.stage.is_last:
            targets = request.targets.to(self.device, torch.int64)
            loss = self.stage.loss(out, targets)
            if not torch.isfinite(loss):
                raise BadPayload(f"stage {self.stage.index}: loss {loss.item()} on micro-batch {request.micro_batch}")
            (loss * share).backward()
            value, n = float(loss.item()), int(targets.numel())
            x_grad = x.grad
        else:
            step, index = split_micro_batch_id(request.micro_batch)
            sent = out.detach().to("cpu", self.link.wire).contiguous()
            reply, x_grad = self._backward_next(
                out,
                x,
                functools.partial(self.link.call_next, sent, request.targets, step=step, index=index, stop=self.stop),
                weight=share,
                what=f"micro-batch {request.micro_batch}",
            )
            value, n = reply.loss, reply.tokens
        assert x_grad is not None  # x requires grad and fed this stage's backward
        grad = (x_grad / share).to("cpu", acts.dtype).contiguous()
        if not torch.isfinite(grad).all():
            raise BadPayload(f"stage {self.stage.index}: non-finite gradient on micro-batch {request.micro_batch}")
        return grad, value, n
