"""The inner loop of a pipelined peer (peer/pipeline/peer.py, issue #19), two stages in one process:
stage 0's step through stage 1 equals one AdamW step of the unsplit model, and stage 1 steps and
ends its rounds as its callers do. The link between them is an in-process stand-in for the libp2p
calls (tests/integration/test_pipeline_swarm.py runs the real ones)."""

from __future__ import annotations

import concurrent.futures
import copy
import queue
import threading

import pytest
import torch

from peer.pipeline.peer import micro_batch_id, split_micro_batch_id, stage_key
from peer.pipeline.stage_loop import StageInnerLoop
from peer.pipeline.stages import PipelineStage
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop
from peer.train.model import build_model
from protocol.presets import tiny_run
from protocol.wire.pipeline import StageReply, StageRequest

H = 4
MANIFEST = tiny_run().replace(
    model={"num_layers": 2},
    pipeline={"stages": 2, "activation_dtype": "fp32"},
    inner_optimizer={"grad_clip_norm": 0.0},
    sync={"inner_steps": H},
)


class Link:
    """Stage 0's calls go straight into stage 1's request queue; the answer is awaited as the
    StageServer's handle awaits it."""

    def __init__(self, following: Link | None = None):
        self.m, self.wire, self.server = MANIFEST, torch.float32, object()
        self.requests: queue.Queue = queue.Queue()
        self.following = following
        self.calls: list[int] = []

    def sender_index(self) -> int:
        return 0

    def callers_round(self):
        return None  # no records: only requests pace stage 1 here

    def call_next(self, activations, targets, *, step, index, stop):
        future: concurrent.futures.Future = concurrent.futures.Future()
        mb = micro_batch_id(step, index)
        self.calls.append(mb)
        self.following.requests.put(
            (StageRequest(request_id=1, micro_batch=mb, stage=1, activations=activations, targets=targets), future)
        )
        grad, loss, tokens = future.result(30)
        return StageReply(request_id=1, grad=grad, loss=loss, tokens=tokens)


def _sampler(seed: int = 3) -> BatchSampler:
    stream = torch.randint(0, 259, (20_000,), generator=torch.Generator().manual_seed(1))
    return BatchSampler(
        stream, seq_len=MANIFEST.data.seq_len_tokens, batch_sequences=MANIFEST.batch_sequences, seed=seed
    )


def _pipeline(micro_batch: int | None = None):
    full = build_model(MANIFEST.model)
    model = copy.deepcopy(full)
    stop = threading.Event()
    link1 = Link()
    link0 = Link(following=link1)
    loops = [
        StageInnerLoop(
            PipelineStage(model, 2, 0),
            MANIFEST.inner_optimizer,
            _sampler(),
            link0,
            stop=stop,
            micro_batch_sequences=micro_batch,
        ),
        StageInnerLoop(PipelineStage(model, 2, 1), MANIFEST.inner_optimizer, _sampler(), link1, stop=stop),
    ]
    return full, model, loops, stop


def _serve_in_thread(loop: StageInnerLoop, inner_step: int):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", loop.step(inner_step)))
    thread.start()
    return thread, box


@pytest.mark.parametrize("micro_batch", [None, 3])
def test_a_step_through_two_stages_equals_one_step_of_the_unsplit_model(micro_batch):
    full, model, (first, second), stop = _pipeline(micro_batch)
    reference = InnerLoop(full, MANIFEST.inner_optimizer, _sampler())
    expected = reference.step(0)

    thread, box = _serve_in_thread(second, 0)
    got = first.step(0)
    stop.set()  # no later step comes: stage 1 closes this one when told to stop
    thread.join(30)
    served = box["result"]
    assert got.tokens == expected.tokens == served.tokens
    assert got.loss == pytest.approx(expected.loss, rel=1e-6)
    assert served.loss == pytest.approx(expected.loss, rel=1e-6) and not served.ends_round
    # the gradients each stage stepped on (left in .grad) are the unsplit batch's, to 1e-6; the
    # parameters after AdamW's first step agree to 1e-5 (its g/|g| amplifies rounding where |g| ~ eps)
    after = dict(full.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, after[name].grad, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(p, after[name], rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    chunks = -(-MANIFEST.batch_sequences // (micro_batch or MANIFEST.batch_sequences))
    assert [split_micro_batch_id(mb) for mb in first.link.calls] == [(0, i) for i in range(chunks)]


def test_stage_one_steps_when_its_callers_do_and_ends_the_round_with_theirs():
    _, _, (first, second), stop = _pipeline()
    thread, box = _serve_in_thread(second, 0)
    first.step(H - 1)  # the last step of the callers' round 0
    first_call = threading.Thread(target=lambda: first.step(H))  # round 1's first step closes it
    first_call.start()
    thread.join(30)
    assert box["result"].ends_round and box["result"].tokens > 0
    # the request that closed round 0 is served first in the next step
    thread, box = _serve_in_thread(second, H)
    first_call.join(30)
    stop.set()
    thread.join(30)
    assert box["result"].tokens > 0 and not box["result"].ends_round


def test_stage_keys_and_micro_batch_ids():
    assert stage_key("abc", 0) == "abc" and stage_key("abc", 2) == "abc_stage2"
    assert split_micro_batch_id(micro_batch_id(12345, 7)) == (12345, 7)
    with pytest.raises(ValueError, match=r"micro-batch index 65536"):
        micro_batch_id(1, 1 << 16)


def test_a_call_with_no_live_replica_pauses_the_pipeline_and_says_so():
    from peer.pipeline.peer import PipelineLink
    from protocol.errors import StageCallFailed

    said = []
    stop = threading.Event()
    link = PipelineLink(
        None,
        None,
        MANIFEST,
        stage=0,
        vocab_size=259,
        next_replicas=lambda: [],
        own_replicas=lambda: ["me"],
        peer_id="me",
        on_pause=said.append,
    )
    threading.Timer(1.5, stop.set).start()
    acts = torch.zeros(2, 4, MANIFEST.model.hidden_size)
    with pytest.raises(StageCallFailed, match=r"stopped while stage 1 had no live replica"):
        link.call_next(acts, torch.zeros(2, 4, dtype=torch.int32), step=0, index=0, stop=stop)
    # said once, however long the pause
    assert len(said) == 1 and "stage 1 has no live replica" in said[0] and "pipeline pauses" in said[0]


def test_stage_one_ends_its_round_on_the_callers_records_when_no_request_comes():
    _, _, (_, second), stop = _pipeline()
    clock = {"round": 0}
    second.link.callers_round = lambda: clock["round"]
    thread, box = _serve_in_thread(second, 0)
    threading.Timer(1.0, lambda: clock.update(round=1)).start()  # the stage-0 peers published round 1
    thread.join(30)
    stop.set()
    assert box["result"].ends_round and box["result"].tokens == 0
