"""Issue 51, item 3: a pipeline reply that would make the caller's step non-finite is a failed call.

Before: a replica of stage 1 answered with a finite gradient of 3e38 (every value passes the wire's
finiteness check); stage 0's backward made its gradient norm inf, the step raised and the round
restarted, and nothing marked the replica: the next step's routing sent it micro-batches again. Now
the reply's gradients are taken apart from ``.grad`` first (peer/pipeline/peer.py
``StageInnerLoop._backward_next``); one that would make the step non-finite cools its replica down
in the router (peer/pipeline/routing.py), as a failed call does, and the micro-batch goes to the next
replica. Real parts: the stage-0 :class:`StageInnerLoop`, its :class:`PipelineLink` and
:class:`Router`, a real stage 1 computing the honest answers; only the libp2p exchange
(``call_with_retry``) is replaced, answering as the replica the router put first.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from peer.pipeline import peer as pipeline_peer
from peer.pipeline.peer import (
    MAX_POISONED_REPLIES,
    LoopThread,
    PipelineLink,
    micro_batch_id,
    split_micro_batch_id,
)
from peer.pipeline.stage_loop import StageInnerLoop
from peer.pipeline.stages import PipelineStage
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop
from peer.train.model import build_model
from protocol.errors import BadPayload
from protocol.presets import tiny_run
from protocol.wire.pipeline import StageReply, StageRequest

pytestmark = pytest.mark.timeout(120)

MANIFEST = tiny_run().replace(
    model={"num_layers": 2},
    pipeline={"stages": 2, "activation_dtype": "fp32"},
    inner_optimizer={"grad_clip_norm": 0.0},
    sync={"inner_steps": 4},
)
HUGE = 3e38
"""Finite in fp32 (the wire accepts it); its square is not."""


def _sampler() -> BatchSampler:
    stream = torch.randint(0, 259, (20_000,), generator=torch.Generator().manual_seed(1))
    return BatchSampler(stream, seq_len=MANIFEST.data.seq_len_tokens, batch_sequences=MANIFEST.batch_sequences, seed=3)


@pytest.fixture()
def loop_thread():
    loop = LoopThread("test-pipeline-loop")
    yield loop
    loop.stop()


def _stage_zero(loop_thread, monkeypatch, replies):
    """Stage 0 of a two-stage split of the tiny model, with a real link to replicas ``"r0"``, ``"r1"``;
    ``replies[peer](request, honest)`` answers a call the router sent to ``peer`` first."""
    full = build_model(MANIFEST.model)
    model = copy.deepcopy(full)
    last = PipelineStage(model, 2, 1)
    calls = []

    def honest(request) -> StageReply:
        x = request.activations.clone().requires_grad_(True)
        loss = last.loss(last(x), request.targets.to(torch.int64))
        loss.backward()
        return StageReply(
            request_id=request.request_id, grad=x.grad, loss=loss.detach().item(), tokens=request.targets.numel()
        )

    async def call_with_retry(p2p, replicas, protocol_name, request, limits, timeout_s, *, attempts=None):
        peer = list(replicas)[0]
        calls.append(peer)
        return replies[peer](request, honest), peer, []

    monkeypatch.setattr(pipeline_peer, "call_with_retry", call_with_retry)
    link = PipelineLink(
        None,
        loop_thread,
        MANIFEST,
        stage=0,
        vocab_size=259,
        next_replicas=lambda: ["r0", "r1"],
        own_replicas=lambda: ["me"],
        peer_id="me",
    )
    first = StageInnerLoop(
        PipelineStage(model, 2, 0), MANIFEST.inner_optimizer, _sampler(), link, stop=threading.Event()
    )
    return full, model, first, link, calls


def _poison(request, honest) -> StageReply:
    return StageReply(
        request_id=request.request_id,
        grad=torch.full_like(request.activations, HUGE),
        loss=1.0,
        tokens=request.targets.numel(),
    )


def test_a_reply_that_would_make_the_step_non_finite_cools_its_replica_and_the_step_goes_on(loop_thread, monkeypatch):
    # the router's first choice for the step's one micro-batch is the attacker
    probe = PipelineLink(
        None,
        loop_thread,
        MANIFEST,
        stage=0,
        vocab_size=259,
        next_replicas=lambda: [],
        own_replicas=lambda: ["me"],
        peer_id="me",
    )
    evil, good = probe.router.order(["r0", "r1"], step=0, micro_batch=0)
    full, model, first, link, calls = _stage_zero(
        loop_thread, monkeypatch, {evil: _poison, good: lambda request, honest: honest(request)}
    )
    expected = InnerLoop(full, MANIFEST.inner_optimizer, _sampler()).step(0)

    got = first.step(0)  # before: BadPayload (stage 0 gradient norm is inf), no replica cooled

    assert calls == [evil, good]  # refused, then served by the other replica
    assert link.poisoned == 1 and link.last_served_by == good
    assert link.router.order(["r0", "r1"], step=1, micro_batch=0) == [good]  # the attacker cools down
    # the refused reply left no trace: the step is the unsplit model's
    assert got.loss == pytest.approx(expected.loss, rel=1e-6) and got.tokens == expected.tokens
    after = dict(full.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, after[name].grad, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_when_every_reply_is_poisoned_the_step_fails_with_every_replica_cooled(loop_thread, monkeypatch):
    _, model, first, link, calls = _stage_zero(loop_thread, monkeypatch, {"r0": _poison, "r1": _poison})
    before = [p.detach().clone() for p in first.params]
    with pytest.raises(
        BadPayload,
        match=f"{MAX_POISONED_REPLIES} replies to micro-batch 0 of inner step 0 would make the step non-finite",
    ):
        first.step(0)
    assert len(calls) == MAX_POISONED_REPLIES and set(calls) == {"r0", "r1"}
    assert link.poisoned == MAX_POISONED_REPLIES
    assert all(p.grad is None for p in first.params)  # nothing of the refused replies kept
    assert all(torch.equal(p, q) for p, q in zip(first.params, before))  # no step taken


def test_a_middle_stage_refuses_a_poisoned_reply_from_the_stage_after_it(loop_thread, monkeypatch):
    """Stage 1 of 3 serves a request: its call to stage 2 gets the attacker's reply first. Before:
    stage 1's backward made its own gradient (and the one it answers with) non-finite, so it
    answered STAGE_ERROR and its caller cooled down stage 1, the honest replica, not the attacker."""
    manifest = MANIFEST.replace(model={"num_layers": 3}, pipeline={"stages": 3, "activation_dtype": "fp32"})
    model = build_model(manifest.model)
    stages = [PipelineStage(model, 3, k) for k in range(3)]
    calls = []

    def honest(request) -> StageReply:
        x = request.activations.clone().requires_grad_(True)
        loss = stages[2].loss(stages[2](x), request.targets.to(torch.int64))
        loss.backward()
        return StageReply(
            request_id=request.request_id, grad=x.grad, loss=loss.detach().item(), tokens=request.targets.numel()
        )

    probe = PipelineLink(
        None,
        loop_thread,
        manifest,
        stage=1,
        vocab_size=259,
        next_replicas=lambda: [],
        own_replicas=lambda: ["me"],
        peer_id="me",
    )
    batch = _sampler().next_batch()
    step, index = split_micro_batch_id(micro_batch_id(0, 0))
    evil, good = probe.router.order(["r0", "r1"], step=step, micro_batch=index)

    async def call_with_retry(p2p, replicas, protocol_name, request, limits, timeout_s, *, attempts=None):
        peer = list(replicas)[0]
        calls.append(peer)
        return (_poison(request, honest) if peer == evil else honest(request)), peer, []

    monkeypatch.setattr(pipeline_peer, "call_with_retry", call_with_retry)
    link = PipelineLink(
        None,
        loop_thread,
        manifest,
        stage=1,
        vocab_size=259,
        next_replicas=lambda: ["r0", "r1"],
        own_replicas=lambda: ["me"],
        peer_id="me",
    )
    middle = StageInnerLoop(stages[1], manifest.inner_optimizer, _sampler(), link, stop=threading.Event())
    with torch.no_grad():
        acts = stages[0](batch[:, :-1]).contiguous()
    request = StageRequest(
        request_id=7,
        micro_batch=micro_batch_id(0, 0),
        stage=1,
        activations=acts,
        targets=batch[:, 1:].to(torch.int32).contiguous(),
    )

    grad, loss, tokens = middle._serve(request, 0)  # before: BadPayload (non-finite gradient)

    assert calls == [evil, good] and link.poisoned == 1
    assert link.router.order(["r0", "r1"], step=1, micro_batch=0) == [good]
    assert bool(torch.isfinite(grad).all()) and grad.shape == acts.shape and tokens == request.targets.numel()
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in middle.params)
