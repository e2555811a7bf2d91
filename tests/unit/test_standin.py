"""lab/standin.py: the rig's compute stand-in blocks without CPU, changes θ deterministically and
honours the inner-loop interface (issue #54 item 1)."""

import json
import os
import threading
import time

import pytest
import torch

from lab.standin import CHUNKS, StandInConfig, StandInLoop, factory, first_step_event, install
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop
from protocol.errors import ConfigError
from protocol.presets import llama_125m_run, tiny_run

SPEC = tiny_run().inner_optimizer


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))


def sampler(seed: int = 1) -> BatchSampler:
    stream = torch.arange(1000, dtype=torch.int16) % 50
    return BatchSampler(stream, seq_len=8, batch_sequences=4, seed=seed)


def loop(seed: int = 1, step_s: float = 0.01, **kw) -> StandInLoop:
    return StandInLoop(model(), SPEC, sampler(seed), step_s=step_s, **kw)


def theta(inner: InnerLoop) -> list[torch.Tensor]:
    return [p.detach().clone() for p in inner.params]


def test_a_step_waits_without_using_the_threads_cpu():
    inner = loop(step_s=0.5)
    cpu = time.thread_time()
    result = inner.step(0)
    used = time.thread_time() - cpu
    assert used < 0.1  # CPU seconds of this thread, over a 0.5 s step: the wait itself takes none
    assert result.tokens == 4 * 8 and result.micro_batch == 4
    assert inner.sampler.batches_drawn == 1  # the data position advances as in training


def test_theta_changes_deterministically_and_differs_between_peers():
    a, b, other = loop(seed=1), loop(seed=1), loop(seed=2)
    start = theta(a)
    for step in range(3):
        for inner in (a, b, other):
            inner.step(step)
    after = theta(a)
    assert all(torch.equal(x, y) for x, y in zip(after, theta(b)))  # same peer seed: bit-identical
    assert not all(torch.equal(x, y) for x, y in zip(after, theta(other)))  # another peer's Δ differs
    assert not all(torch.equal(x, y) for x, y in zip(after, start))


def test_a_step_changes_only_its_slice_of_each_tensor():
    inner = loop()
    before = theta(inner)
    inner.step(CHUNKS + 2)  # slice 2
    for old, new in zip(before, theta(inner)):
        changed = (old.view(-1) != new.view(-1)).nonzero().view(-1)
        n = old.numel()
        assert changed.numel() > 0
        assert changed.min() >= 2 * n // CHUNKS and changed.max() < 3 * n // CHUNKS


def test_optimizer_state_round_trips_like_the_real_loops():
    inner = loop()
    assert inner.state_dict() is None  # before the first step, as AdamW
    inner.step(0)
    inner.step(1)
    state = inner.state_dict()
    assert state is not None and state["step"] == 2
    assert [m.shape for m in state["exp_avg"]] == [p.shape for p in inner.params]
    restored = loop()
    restored.load_state_dict(state)
    assert restored.state_dict()["step"] == 2
    restored.step(2)
    assert restored.state_dict()["step"] == 3
    restored.reset_optimizer()
    assert restored.state_dict() is None
    assert inner.settle() == []


def test_a_held_step_waits_for_the_copy_before_changing_theta():
    inner = loop()
    copied = threading.Event()
    inner.hold_updates(copied)
    before = theta(inner)
    worker = threading.Thread(target=inner.step, args=(0,))
    worker.start()
    worker.join(2.0)  # the 0.01 s step would be long done were it not held
    assert worker.is_alive()
    assert all(torch.equal(x, y) for x, y in zip(before, theta(inner)))
    copied.set()
    worker.join(10.0)
    assert not worker.is_alive()
    assert not all(torch.equal(x, y) for x, y in zip(before, theta(inner)))


def test_the_first_step_is_reported_once():
    seen: list[int] = []
    inner = loop(on_first_step=seen.append)
    inner.step(7)
    inner.step(8)
    assert seen == [7]


def test_the_first_step_event_is_one_json_line():
    read, write = os.pipe()
    try:
        first_step_event(5, fd=write)
        line = os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.close(write)
    assert line.endswith("\n")
    event = json.loads(line)
    assert event["event"] == "standin_first_step" and event["inner_step"] == 5


def test_step_time_from_a_cards_tokens_per_second():
    batch = llama_125m_run().inner_optimizer.batch_size_tokens
    config = StandInConfig(tokens_per_s=383781.8)
    assert config.step_seconds(batch) == pytest.approx(65536 / 383781.8)
    assert StandInConfig(step_s=0.25).step_seconds(batch) == 0.25
    made = factory(StandInConfig(tokens_per_s=3200.0))(model(), SPEC, sampler())
    assert isinstance(made, StandInLoop) and made.step_s == pytest.approx(32 / 3200.0)


def test_the_environment_round_trips_and_bad_values_are_named():
    config = StandInConfig(step_s=0.17)
    assert StandInConfig.from_env(config.to_env()) == config
    assert StandInConfig.from_env({"LOCOSWARM_STANDIN_TOKENS_PER_S": "383781.8"}).tokens_per_s == 383781.8
    with pytest.raises(ConfigError, match="'fast'"):
        StandInConfig.from_env({"LOCOSWARM_STANDIN_STEP_S": "fast"})
    with pytest.raises(ConfigError, match="step_s = -1.0"):
        StandInConfig.from_env({"LOCOSWARM_STANDIN_STEP_S": "-1"})
    with pytest.raises(ConfigError, match="exactly one"):
        StandInConfig.from_env({})
    with pytest.raises(ValueError, match="step_s = 0"):
        loop(step_s=0)


def test_install_replaces_the_engines_inner_loop_factory(monkeypatch):
    import peer.round.engine as engine

    monkeypatch.setattr(engine, "make_inner_loop", engine.make_inner_loop)  # restored after the test
    install(StandInConfig(step_s=0.01), on_first_step=None)
    built = engine.make_inner_loop(model(), SPEC, sampler(), None)
    assert isinstance(built, StandInLoop) and built.step_s == 0.01
