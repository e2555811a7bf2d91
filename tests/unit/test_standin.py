"""lab/standin.py: the rig's compute stand-in blocks without CPU, changes θ deterministically and
honours the inner-loop interface (issue #54 item 1)."""

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from lab.standin import (
    CHUNKS,
    EVAL_LOSS,
    StandInConfig,
    StandInLoop,
    factory,
    first_step_event,
    install,
    meta_copy,
    standin_evaluate,
)
from peer.config import TrainerConfig
from peer.round import Trainer
from peer.state import memory_check
from peer.state.checkpoint import load_checkpoint
from peer.state.memory_check import MemoryShort
from peer.train.data import BatchSampler
from peer.train.inner import InnerLoop
from peer.train.model import build_model
from protocol.errors import ConfigError
from protocol.presets import llama_125m_run, tiny_run
from tests.unit.sim_fixtures import Events, corpus, one_thread  # noqa: F401 (fixtures)

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


def test_peers_deltas_have_about_the_same_norm_and_direction():
    # an honest stand-in swarm must not look like an attack to the peers' screening (norms, cosines)
    start = theta(loop(seed=1))
    deltas = []
    for seed in range(1, 9):
        inner = loop(seed=seed)
        for step in range(CHUNKS):
            inner.step(step)
        deltas.append(torch.cat([(a - b).view(-1) for a, b in zip(start, theta(inner))]))
    norms = torch.stack([d.norm() for d in deltas])
    assert norms.max() / norms.min() < 1.3
    cosines = [torch.nn.functional.cosine_similarity(deltas[0], d, dim=0).item() for d in deltas[1:]]
    assert min(cosines) > 0.5 and max(cosines) < 0.99  # alike, not equal (honest whole-Δ cosines: 0.5 to 0.95)


def test_a_step_changes_only_its_slice_of_each_tensor():
    inner = loop()
    before = theta(inner)
    inner.step(CHUNKS + 2)  # slice 2
    for old, new in zip(before, theta(inner)):
        changed = (old.view(-1) != new.view(-1)).nonzero().view(-1)
        n = old.numel()
        assert changed.numel() > 0
        assert changed.min() >= 2 * n // CHUNKS and changed.max() < 3 * n // CHUNKS


def test_no_gradients_and_no_adamw_moments_are_held():
    inner = loop()
    for step in range(3):
        inner.step(step)
    assert all(p.grad is None for p in inner.params)
    assert len(inner.optimizer.state) == 0  # AdamW never allocated its moments
    assert inner.adam_step == 3
    assert inner.state_dict() is None  # a checkpoint holds no moments, as a real loop's before a step
    restored = loop()
    restored.load_state_dict({"step": 7, "exp_avg": [], "exp_avg_sq": []})
    assert restored.adam_step == 7
    restored.reset_optimizer()
    assert restored.adam_step == 0 and restored.state_dict() is None
    assert inner.settle() == []


def test_the_evaluation_copy_holds_no_storage():
    m = model()
    copied = meta_copy(m)
    assert all(p.device.type == "meta" for p in [*copied.parameters(), *copied.buffers()])
    assert [p.shape for p in copied.parameters()] == [p.shape for p in m.parameters()]
    assert all(p.device.type == "cpu" for p in m.parameters())  # the original is untouched
    with torch.no_grad():
        for p, q in zip(copied.parameters(), m.parameters()):
            p.copy_(q)  # what the publisher and the loss check do to it


def test_the_stand_in_evaluation_waits_a_forward_pass_without_cpu():
    evaluate = standin_evaluate(lambda: 3000.0)
    windows = torch.zeros(4, 501, dtype=torch.int64)  # 2000 tokens: 2000 / 3 / 3000 s
    cpu, wall = time.thread_time(), time.perf_counter()
    assert evaluate(meta_copy(model()), windows) == EVAL_LOSS
    assert time.thread_time() - cpu < 0.1
    assert time.perf_counter() - wall >= 2000 / 3 / 3000 * 0.9


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


def restore_seams(monkeypatch):
    """Undo :func:`install`'s rebinding of the product's seams after the test."""
    import peer.round.catchup as catchup
    import peer.round.engine as engine
    import peer.round.publishing as publishing

    monkeypatch.setattr(engine, "make_inner_loop", engine.make_inner_loop)
    monkeypatch.setattr(catchup, "evaluate", catchup.evaluate)
    monkeypatch.setattr(publishing, "evaluate", publishing.evaluate)
    monkeypatch.setattr(publishing, "copy", publishing.copy)
    monkeypatch.setattr(memory_check, "check_join", memory_check.check_join)


def test_install_replaces_the_engines_inner_loop_factory(monkeypatch):
    import peer.round.engine as engine
    import peer.round.publishing as publishing

    restore_seams(monkeypatch)
    install(StandInConfig(step_s=0.01), on_first_step=None)
    built = engine.make_inner_loop(model(), SPEC, sampler(), None)
    assert isinstance(built, StandInLoop) and built.step_s == 0.01
    assert publishing.evaluate(model(), torch.zeros(2, 9, dtype=torch.int64)) == EVAL_LOSS
    assert next(publishing.copy.deepcopy(model()).parameters()).device.type == "meta"


def test_a_stand_in_peer_is_sized_as_a_gpu_hosts_host_not_a_cpu_peers_activations(monkeypatch):
    """llama-125m's whole batch in one micro-batch needs about 105 GiB on a CPU peer (activations):
    the rig's stand-in holds none, so ``peer join`` under it checks a GPU host's host need."""
    restore_seams(monkeypatch)
    device = SimpleNamespace(device="cpu", precision="auto", micro_batch_sequences=None, activation_checkpointing=False)
    with pytest.raises(MemoryShort):
        memory_check.check_join(llama_125m_run(), device, host_free=24 * 2**30)
    install(StandInConfig(step_s=0.01), on_first_step=None)
    need = memory_check.check_join(llama_125m_run(), device, host_free=24 * 2**30)
    assert need.device_type == "cuda" and need.host_bytes < 8 * 2**30
    with pytest.raises(MemoryShort):
        memory_check.check_join(llama_125m_run(), device, host_free=2**30)


def test_stand_in_peers_run_the_products_round(monkeypatch, tmp_path, corpus):
    """Two stand-in peers through the product's round engine (Trainer) over the in-memory
    transport: they average, their φ ends equal, moved by the outer step from its start, their
    checkpoints load and hold no AdamW moments, and φ was evaluated by the stand-in."""
    restore_seams(monkeypatch)
    firsts: list[int] = []
    install(StandInConfig(step_s=0.002), on_first_step=firsts.append)
    manifest = tiny_run().replace(sync={"inner_steps": 4})
    records, group = InProcessHub(), InProcessHub(2)
    trainers, reporters = [], []
    for name in ("a", "b"):
        reporters.append(Events())
        trainers.append(
            Trainer(
                manifest=manifest,
                model=build_model(manifest.model, corpus.tokenizer),
                corpus=corpus,
                swarm=InProcessSwarm(name, records),
                transport=InProcessTransport(name, group),
                config=TrainerConfig(max_rounds=2, checkpoint_path=tmp_path / f"{name}.ckpt"),
                reporter=reporters[-1],
                stop_event=threading.Event(),
            )
        )
    start = [f.clone() for f in trainers[0].state.phi]
    errors: list[BaseException] = []

    def run(t):
        try:
            t.run()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert all(isinstance(t.inner, StandInLoop) for t in trainers)
    assert sorted(firsts) == [0, 0]
    a, b = (t.state.phi for t in trainers)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # one group: the same mean
    assert not all(torch.equal(x, y) for x, y in zip(a, start))  # the outer step moved φ
    for r in reporters:
        rounds = r.of("round")
        assert [e["round"] for e in rounds] == [1, 2]
        assert all(e["group_size"] == 2 and e["bytes_sent"] > 0 for e in rounds)
        assert all(e["loss"] == EVAL_LOSS for e in r.of("eval"))
    for t, name in zip(trainers, ("a", "b")):
        assert t.publisher.eval_model is not None
        assert next(t.publisher.eval_model.parameters()).device.type == "meta"
        saved = load_checkpoint(
            tmp_path / f"{name}.ckpt", run_id=manifest.run_id, names=t.state.names, shapes=t.state.shapes
        )
        assert saved.round == 2 and saved.adam_exp_avg is None
        assert all(torch.equal(x, y) for x, y in zip(saved.phi, t.state.phi))
