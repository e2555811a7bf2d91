"""A peer serving one pipeline stage (issue #19): the stage's inner loop and its link to the others.

DiLoCoX (arXiv 2506.21263) splits the model into stages and keeps each stage's inner and outer
optimizer state with the peers that serve it; SWARM (arXiv 2301.11913) carries each micro-batch's
whole stage input in its request, so any replica of the next stage can serve it and a dead one
costs a retry. Here:

- **stage 0** reads data: each inner step runs its batch through its own stage in micro-batches,
  sends each micro-batch's activations (and targets) to a replica of stage 1 chosen by the
  router (peer/pipeline/routing.py), gets the gradient w.r.t. them back, finishes its backward
  and steps its AdamW;
- **a stage k > 0** serves calls (peer/pipeline/rpc.py ``StageServer``): the requests are queued
  and worked in the trainer thread by :meth:`StageInnerLoop.step`, which runs the stage's forward
  (and, unless it is the last stage, calls stage k + 1 in turn), its backward, answers, and steps
  its AdamW when its callers move to their next step (the step travels in the micro-batch id,
  :func:`micro_batch_id`). Requests that arrive while the round loop syncs wait in the queue (the
  caller's deadline is ``pipeline.call_timeout_s``; past it the caller retries another replica).

Each stage is a swarm of its own for the round loop (peer/round/): its progress records, group
matchmaking, state download and checkpoint live under :func:`stage_key` (the run id for stage 0,
so `peer status` and the monitor see the peers that read data), so the outer sync averages a
stage's pseudo-gradients among that stage's replicas only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from peer.pipeline.routing import Router
from peer.pipeline.rpc import StageServer, call_with_retry
from peer.sync.membership import SwarmView
from protocol.errors import NetworkError, NoReplica, StageCallFailed
from protocol.manifest import RunManifest
from protocol.wire.pipeline import DTYPE_BY_NAME, StageLimits, StageReply, StageRequest

logger = logging.getLogger(__name__)

REPLICAS_REFRESH_S = 2.0
"""How long a stage-0 or middle-stage peer reuses its list of the next stage's live replicas (s)."""

INDEX_BITS = 16
"""A micro-batch's id on the wire is (the stage-0 caller's cumulative inner step << INDEX_BITS) |
its index within that step across the stage-0 replicas: the stages after 0 step, and end their
rounds, as their callers do (:class:`StageInnerLoop`)."""


def micro_batch_id(step: int, index: int) -> int:
    """The wire id of micro-batch ``index`` (< 2**INDEX_BITS) of cumulative inner step ``step``."""
    if not 0 <= index < 1 << INDEX_BITS:
        raise ValueError(f"micro-batch index {index}: must be in [0, {1 << INDEX_BITS})")
    return (step << INDEX_BITS) | index


def split_micro_batch_id(micro_batch: int) -> tuple[int, int]:
    """(step, index) of a wire micro-batch id (:func:`micro_batch_id`)."""
    return micro_batch >> INDEX_BITS, micro_batch & ((1 << INDEX_BITS) - 1)


PAUSE_RETRY_S = 1.0
"""Seconds between tries while the next stage has no live replica (the pipeline pauses)."""

COOLDOWN_S = 5.0
"""Seconds a replica whose call failed is skipped (peer/pipeline/routing.py): long enough not to
retry a dead peer on every micro-batch, short enough that one still starting is not shunned."""

MAX_POISONED_REPLIES = 3
"""Replies to one micro-batch that would make this stage's step non-finite (issue #51: a finite
3e38 gradient) before the step fails: each one's replica counts a failed call and cools down, and
the micro-batch goes to the next replica."""

CALLERS_ROUND_REFRESH_S = 1.0
"""How long a stage after 0 reuses its reading of the stage-0 peers' round (s)."""


def stage_key(run_id: str, stage: int) -> str:
    """The key a stage's replicas use in place of the run id for progress records, group
    matchmaking and state download: the run id itself for stage 0, ``<run id>_stage<k>`` after."""
    return run_id if stage == 0 else f"{run_id}_stage{stage}"


def stage_protocol(run_id: str, stage: int) -> str:
    """The libp2p protocol on which stage ``stage`` serves calls."""
    return f"/locoswarm/{run_id}/stage/{stage}"


def stage_limits(manifest: RunManifest, vocab_size: int) -> StageLimits:
    """What a stage call of ``manifest``'s run may carry (protocol/wire/pipeline.py)."""
    return StageLimits(
        max_batch_sequences=manifest.batch_sequences,
        max_seq_len_tokens=manifest.data.seq_len_tokens,
        hidden_size=manifest.model.hidden_size,
        vocab_size=vocab_size,
        stages=manifest.pipeline.stages,
    )


class LoopThread:
    """An asyncio event loop in a daemon thread, for the stage calls and the stage server of a
    peer whose round loop runs in the main thread."""

    def __init__(self, name: str = "pipeline-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float | None = None):
        """Run ``coro`` on the loop and wait for its result (raises what it raises; TimeoutError
        after ``timeout_s``, the coroutine then cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (at most ~10 s)."""

        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0) if tasks else None

        if self.loop.is_running():
            try:
                self.run(drain(), timeout_s=6.0)
            except Exception as exc:
                logger.debug("draining the pipeline loop: %r", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


class PipelineLink:
    """This peer's connections to the other stages: the server of its own stage (k > 0) and the
    calls to the next stage (k < S − 1).

    Args:
        p2p: a hivemind ``P2P`` usable from ``loop`` (the DHT's daemon, replicated into this process).
        loop: the event loop thread that owns ``p2p``.
        manifest: the run (``pipeline`` section, batch and model sizes).
        stage: the stage this peer serves.
        vocab_size: the tokenizer's ids (targets are checked against it).
        next_replicas: () → peer ids (base58) of the next stage's live replicas; unused on the last stage.
        own_replicas: () → peer ids of this stage's live replicas, this peer included (its index among
            them picks its slot of the 'random' routing's permutation, as NoLoCo's does).
        callers_rounds: () → the rounds the live stage-0 peers last published (the pipeline's round
            clock, :meth:`callers_round`); unused on stage 0.
        peer_id: this peer's id (base58).
        on_pause: called with a one-line message when the next stage has no live replica (the
            pipeline pauses), and with None when it resumes.
    """

    def __init__(
        self,
        p2p,
        loop: LoopThread,
        manifest: RunManifest,
        *,
        stage: int,
        vocab_size: int,
        next_replicas: Callable[[], Sequence[str]],
        own_replicas: Callable[[], Sequence[str]],
        peer_id: str,
        callers_rounds: Callable[[], Sequence[int]] = lambda: (),
        on_pause: Callable[[str | None], None] = lambda message: None,
    ):
        self.p2p, self.loop, self.m, self.stage = p2p, loop, manifest, stage
        self.S = manifest.pipeline.stages
        self.limits = stage_limits(manifest, vocab_size)
        self.wire = DTYPE_BY_NAME[manifest.pipeline.activation_dtype]
        self.timeout_s = manifest.pipeline.call_timeout_s
        self.peer_id = peer_id
        self._next_replicas, self._own_replicas, self._on_pause = next_replicas, own_replicas, on_pause
        self._callers_rounds = callers_rounds
        self._callers: tuple[float, int | None] = (-math.inf, None)
        self._replicas: tuple[float, list[str]] = (-math.inf, [])
        self._sender: tuple[float, int] = (-math.inf, 0)
        self.router = (
            Router(manifest.pipeline.routing, run_id=manifest.run_id, stage=stage + 1, cooldown_s=COOLDOWN_S)
            if stage < self.S - 1
            else None
        )
        self.requests: queue.Queue[tuple[StageRequest, concurrent.futures.Future]] = queue.Queue()
        self.server: StageServer | None = None
        self.poisoned = 0
        """Replies refused after they arrived because they would make this stage's step non-finite
        (:meth:`reject_last`); each cooled its replica down."""
        self.last_served_by: str | None = None
        """The replica whose reply :meth:`call_next` returned last."""
        self._paused = False

    # ---- serving (stage k > 0) ---------------------------------------------------------------
    def serve(self) -> None:
        """Register the stage server (stage k > 0); requests then wait in :attr:`requests`.

        Raises:
            NetworkError: the daemon refused the handler.
        """
        if self.stage == 0:
            return

        async def handle(request: StageRequest):
            future: concurrent.futures.Future = concurrent.futures.Future()
            self.requests.put((request, future))
            return await asyncio.wrap_future(future)

        async def start():
            return await StageServer(
                self.p2p,
                stage_protocol(self.m.run_id, self.stage),
                handle,
                self.limits,
                max_streams_per_peer=8,
                timeout_s=max(self.timeout_s, 60.0),
                stage=self.stage,
            ).start()

        try:
            self.server = self.loop.run(start(), timeout_s=30.0)
        except Exception as exc:
            raise NetworkError(f"could not serve stage {self.stage} on this peer's libp2p daemon: {exc}") from exc

    def close(self) -> None:
        """Stop serving; requests still queued are answered with an error (their callers retry)."""
        if self.server is not None:
            try:
                self.loop.run(self.server.stop(), timeout_s=10.0)
            except Exception as exc:  # the daemon may be gone already
                logger.debug("stopping the stage server: %r", exc)
            self.server = None
        try:  # the replica's control connection to the daemon (the daemon itself is the DHT's)
            self.loop.run(self.p2p.shutdown(), timeout_s=5.0)
        except Exception as exc:
            logger.debug("closing the libp2p replica: %r", exc)
        while True:
            try:
                _, future = self.requests.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(NetworkError("this replica is stopping"))

    def callers_round(self) -> int | None:
        """The round most live stage-0 peers are in (ties: the later), read at most every
        :data:`CALLERS_ROUND_REFRESH_S`; None while none is known."""
        at, value = self._callers
        if time.monotonic() - at > CALLERS_ROUND_REFRESH_S:
            rounds = list(self._callers_rounds())
            value = max(set(rounds), key=lambda r: (rounds.count(r), r)) if rounds else None
            self._callers = (time.monotonic(), value)
        return value

    # ---- calling the next stage -----------------------------------------------------------------
    def _replica_list(self) -> list[str]:
        at, replicas = self._replicas
        if time.monotonic() - at > REPLICAS_REFRESH_S or not replicas:
            replicas = sorted(set(self._next_replicas()) - {self.peer_id})
            self._replicas = (time.monotonic(), replicas)
        return replicas

    def sender_index(self) -> int:
        """This peer's index among its stage's live replicas (sorted ids), refreshed every few s."""
        at, index = self._sender
        if time.monotonic() - at > REPLICAS_REFRESH_S:
            ids = sorted(set(self._own_replicas()) | {self.peer_id})
            index = ids.index(self.peer_id)
            self._sender = (time.monotonic(), index)
        return index

    def call_next(
        self, activations: torch.Tensor, targets: torch.Tensor, *, step: int, index: int, stop: threading.Event
    ) -> StageReply:
        """The next stage's answer for one micro-batch: retried on the replicas in the router's order,
        and, while none answers, again every :data:`PAUSE_RETRY_S` until one does or ``stop`` is set.

        Args:
            activations: (B, T, hidden) in the wire dtype, on the host.
            targets: (B, T) int32 token ids.
            step: the stage-0 caller's cumulative inner step (seeds 'random' routing; paces the
                stages after).
            index: the micro-batch's index within the step across the stage-0 replicas.

        Raises:
            StageCallFailed: ``stop`` was set before any replica answered.
        """
        assert self.router is not None, "the last stage calls no next stage"
        micro_batch = micro_batch_id(step, index)
        request = StageRequest(
            request_id=random.getrandbits(63),
            micro_batch=micro_batch,
            stage=self.stage + 1,
            activations=activations,
            targets=targets,
        )
        while True:
            replicas = self._replica_list()
            try:
                order = self.router.order(replicas, step=step, micro_batch=index)
            except NoReplica:
                # all cooling down after failed calls: a cooldown is a preference, try them again
                order = random.sample(replicas, len(replicas))
            if not order:
                self._pause(
                    f"stage {self.stage + 1} has no live replica ({NoReplica(self.stage + 1)}): "
                    "the pipeline pauses until one joins"
                )
                self._replicas = (-math.inf, [])
                if stop.wait(PAUSE_RETRY_S):
                    raise StageCallFailed(f"stopped while stage {self.stage + 1} had no live replica")
                continue
            first = order[0]
            self.router.started(first)
            start = time.monotonic()
            try:
                reply, served_by, failures = self.loop.run(
                    call_with_retry(
                        self.p2p,
                        order,
                        stage_protocol(self.m.run_id, self.stage + 1),
                        request,
                        self.limits,
                        self.timeout_s,
                        attempts=min(len(order), 3),
                    )
                )
            except StageCallFailed as exc:
                self.router.failed(first, "no answer")
                for peer, reason in exc.failures[1:]:
                    self.router.failed(str(peer), reason)
                self._pause(f"no replica of stage {self.stage + 1} answered: the pipeline pauses and retries ({exc})")
                self._replicas = (-math.inf, [])
                if stop.wait(PAUSE_RETRY_S):
                    raise
                continue
            failed = {str(peer) for peer, _ in failures}
            if first in failed:
                self.router.failed(first, "no answer")
            else:
                self.router.finished(first, time.monotonic() - start)
            for peer, reason in failures:
                if str(peer) != first:
                    self.router.failed(str(peer), reason)
            if failures:
                logger.info(
                    "micro-batch %d of step %d: %d replica(s) of stage %d failed, %s served it",
                    index,
                    step,
                    len(failures),
                    self.stage + 1,
                    served_by,
                )
            self._resume()
            self.last_served_by = str(served_by)
            return reply

    def reject_last(self, reason: str) -> None:
        """The reply :meth:`call_next` returned last would make this stage's step non-finite (a
        well-formed, finite, but huge gradient): its replica's call counts as failed and it
        cools down (peer/pipeline/routing.py), so the caller's retry goes to another replica."""
        assert self.router is not None, "the last stage calls no next stage"
        peer, self.last_served_by = self.last_served_by, None
        if peer is None:
            return
        self.poisoned += 1
        self.router.failed(peer, reason)
        logger.warning(
            "stage %d replica %s answered with a reply this stage cannot step on (%s): skipped for %.0f s",
            self.stage + 1,
            peer,
            reason,
            COOLDOWN_S,
        )

    def _pause(self, message: str) -> None:
        if not self._paused:
            self._paused = True
            self._on_pause(message)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._on_pause(None)


def pipeline_link(
    dht, loop: LoopThread, manifest: RunManifest, stage: int, vocab_size: int, swarm, signer, reporter
) -> PipelineLink:
    """The link of a peer serving ``stage``: the DHT's libp2p daemon replicated into this process,
    this stage's replicas from ``swarm`` (its SwarmView) and the next stage's from their progress
    records; a pause or resume of the pipeline is reported on ``reporter``.

    Raises:
        NetworkError: the daemon could not be reached from this process within 30 s.
    """
    try:
        p2p = loop.run(dht.replicate_p2p(), timeout_s=30.0)
    except Exception as exc:
        raise NetworkError(f"could not reach this peer's libp2p daemon for the pipeline calls: {exc}") from exc
    S = manifest.pipeline.stages
    following = callers = None
    if stage > 0:
        callers = (
            swarm
            if stage == 0
            else SwarmView(
                dht,
                run_id=stage_key(manifest.run_id, 0),
                signer=signer,
                record_ttl_s=swarm.record_ttl_s,
                max_sync_s=swarm.max_sync_s,
            )
        )
    if stage < S - 1:
        following = SwarmView(
            dht,
            run_id=stage_key(manifest.run_id, stage + 1),
            signer=signer,
            record_ttl_s=swarm.record_ttl_s,
            max_sync_s=swarm.max_sync_s,
        )

    def on_pause(message: str | None) -> None:
        if message is None:
            reporter.emit("status", message=f"stage {stage + 1} answers again: the pipeline resumes")
        else:
            reporter.emit("warning", message=message)

    return PipelineLink(
        p2p,
        loop,
        manifest,
        stage=stage,
        vocab_size=vocab_size,
        next_replicas=lambda: [r.peer_id for r in following.live()] if following is not None else [],
        own_replicas=lambda: [r.peer_id for r in swarm.live()],
        peer_id=swarm.peer_id,
        callers_rounds=lambda: [r.record.round for r in callers.live()] if callers is not None else [],
        on_pause=on_pause,
    )
