import math

import pytest

from peer.train.inner import lr_at

KW = dict(lr=1e-3, warmup_steps=10, schedule="cosine", decay_steps=110, min_lr_ratio=0.1)


def test_warmup_then_cosine_to_floor():
    assert lr_at(0, **KW) == pytest.approx(1e-4)
    assert lr_at(9, **KW) == pytest.approx(1e-3)
    assert lr_at(10, **KW) == pytest.approx(1e-3)
    assert lr_at(60, **KW) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lr_at(110, **KW) == pytest.approx(1e-4)
    assert lr_at(10_000, **KW) == pytest.approx(1e-4)


def test_a_joiner_does_not_restart_warmup():
    # A joiner adopting round 3 with H = 20 continues at cumulative step 60: mid-decay, not warm-up.
    assert lr_at(60, **KW) == pytest.approx(5.5e-4)
    assert lr_at(60, **KW) > 5 * lr_at(0, **KW)


def test_constant_schedule():
    kw = dict(KW, schedule="constant")
    assert lr_at(5, **kw) == pytest.approx(6e-4)
    assert lr_at(500, **kw) == pytest.approx(1e-3)


def test_inner_loop_state_dict_round_trips_adamw_and_continues_identically():
    import copy

    import torch

    from peer.train.data import BatchSampler
    from peer.train.inner import InnerLoop
    from peer.train.model import build_model
    from protocol.presets import tiny_run

    m = tiny_run()
    stream = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))

    def loop(model):
        sampler = BatchSampler(stream, seq_len=m.data.seq_len_tokens, batch_sequences=m.batch_sequences, seed=1)
        return InnerLoop(model, m.inner_optimizer, sampler)

    a = loop(build_model(m.model))
    assert a.state_dict() is None  # before the first step
    for k in range(3):
        a.step(k)
    state = a.state_dict()
    assert state["step"] == 3 and len(state["exp_avg"]) == len(a.params)
    b = loop(copy.deepcopy(a.model))
    b.sampler = a.sampler = BatchSampler(
        stream, seq_len=m.data.seq_len_tokens, batch_sequences=m.batch_sequences, seed=2
    )
    b.load_state_dict(state)
    assert b.state_dict()["exp_avg"][0] is not state["exp_avg"][0]  # copied, not shared
    batch = a.sampler.next_batch()
    for inner in (a, b):
        inner.sampler = type("Fixed", (), {"next_batch": lambda self: batch})()
        inner.step(3)
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)  # same moments, same step count: the same update, bit for bit
    b.load_state_dict(None)
    assert b.state_dict() is None
