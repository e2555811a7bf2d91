"""A round's checkpoint copies θ and AdamW's moments in the writer's thread (peer/round/checkpointing.py
``Trainer.save``, peer/state/checkpoint.py ``copy_live``) while the next inner step's forward and
backward passes run; that step's update waits for the copy (``InnerLoop.hold_updates``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peer.round import Trainer
from peer.state.checkpoint import (
    CheckpointFile,
    PeerState,
    copy_live,
    encode_checkpoint,
    load_checkpoint,
    write_checkpoint,
)
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import Records, Transport, make_trainer


class Probe:
    """Wraps the event an update waits for: says when the update reached it."""

    def __init__(self, event: threading.Event):
        self.event, self.reached = event, threading.Event()

    def wait(self, timeout=None):
        self.reached.set()
        return self.event.wait(timeout)

    def set(self):
        self.event.set()

    def is_set(self):
        return self.event.is_set()


def gate_the_copy(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the checkpoint writer's copy of θ and the moments wait until the returned ``gate`` is
    set; ``reached`` is set once the copy is waiting there."""
    gate, reached, real_copy = threading.Event(), threading.Event(), copy_live

    def slow_copy(file):
        reached.set()
        assert gate.wait(60)
        return real_copy(file)

    monkeypatch.setattr("peer.round.checkpointing.copy_live", slow_copy)
    return gate, reached


def state_of(t: Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    adam = t.inner.state_dict()
    return (
        [p.detach().clone() for p in t.params],
        [m.clone() for m in adam["exp_avg"]],
        [v.clone() for v in adam["exp_avg_sq"]],
    )


def test_the_next_update_waits_for_the_checkpoints_copy(corpus, tmp_path, monkeypatch):
    manifest = tiny_run().replace(sync={"overlap": "delayed"})
    path = tmp_path / "checkpoint.safetensors"
    t = make_trainer(corpus, manifest, "a", Records(), Transport("a"), rounds=2, checkpoint=path)
    for step in range(2):
        t.inner.step(step)
    theta, m1, m2 = state_of(t)

    gate, probes = threading.Event(), []
    real_copy = copy_live

    def slow_copy(file):  # the writer's copy cannot start until the test opens the gate
        assert gate.wait(60)
        return real_copy(file)

    monkeypatch.setattr("peer.round.checkpointing.copy_live", slow_copy)
    hold = t.inner.hold_updates
    monkeypatch.setattr(t.inner, "hold_updates", lambda until: (probes.append(Probe(until)), hold(probes[-1])))
    t.save(background=True)
    assert len(probes) == 1, "an idle writer takes the copy: the next update is held"

    stepped = threading.Thread(target=t.inner.step, args=(2,))
    stepped.start()
    assert probes[0].reached.wait(60)  # forward and backward done, the update waits
    assert all(torch.equal(p, q) for p, q in zip(t.params, theta))  # θ untouched while the copy is pending
    gate.set()
    stepped.join(60)
    assert not stepped.is_alive()
    t.checkpoints.writer.flush()

    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    for got, want in [(saved.theta, theta), (saved.adam_exp_avg, m1), (saved.adam_exp_avg_sq, m2)]:
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert saved.adam_step == 2
    assert any(not torch.equal(p, q) for p, q in zip(t.params, theta))  # the held step did update θ


def test_setting_theta_waits_for_the_copy_too(corpus, tmp_path, monkeypatch):
    manifest = tiny_run().replace(sync={"overlap": "delayed"})
    path = tmp_path / "checkpoint.safetensors"
    t = make_trainer(corpus, manifest, "a", Records(), Transport("a"), rounds=2, checkpoint=path)
    t.inner.step(0)
    theta, _, _ = state_of(t)
    gate, reached = gate_the_copy(monkeypatch)
    t.save(background=True)
    assert reached.wait(60)
    moved = threading.Thread(target=t.state.set_theta, args=([f + 1.0 for f in t.phi],))  # as an adoption does
    moved.start()
    moved.join(0.5)
    assert moved.is_alive(), "θ was overwritten before the checkpoint copied it"
    gate.set()
    moved.join(60)
    t.checkpoints.writer.flush()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    assert all(torch.equal(a, b) for a, b in zip(saved.theta, theta, strict=True))


def test_a_streaming_landing_waits_for_the_copy_too(corpus, tmp_path, monkeypatch):
    """With streaming the checkpoint's copy is deferred as well: a fragment's landing, whose merge
    writes θ_p between inner steps, waits for it, so the checkpoint holds θ as it was."""
    from tests.unit.test_round_overlap import Group
    from tests.unit.test_round_streaming import FragmentTransport, streaming

    path = tmp_path / "checkpoint.safetensors"
    t = make_trainer(
        corpus, streaming(tau=1), "a", Records(), FragmentTransport("a", Group(1)), rounds=2, checkpoint=path
    )
    for step in range(3):
        t.inner.step(step)
    t.schedule.start_fragment_sync(1, 0)
    while not t.schedule.background.done:  # its mean is there: the landing below waits for nothing but the copy
        time.sleep(0.01)
    theta, _, _ = state_of(t)
    gate, reached = gate_the_copy(monkeypatch)
    t.save(background=True)
    assert t.state.copying is not None, "streaming defers the copy to the writer's thread"
    assert reached.wait(60)
    landing = threading.Thread(target=t.schedule.land_fragment)
    landing.start()
    landing.join(0.5)
    assert landing.is_alive(), "a landing merged into θ before the checkpoint copied it"
    gate.set()
    landing.join(60)
    assert not landing.is_alive() and t.schedule.flight is None
    t.checkpoints.writer.flush()
    saved = load_checkpoint(path, run_id=t.m.run_id, names=t.names, shapes=t.shapes)
    assert all(torch.equal(a, b) for a, b in zip(saved.theta, theta, strict=True))


def test_a_busy_writer_means_a_copy_on_the_training_thread(corpus, tmp_path):
    manifest = tiny_run().replace(sync={"overlap": "delayed"})
    path = tmp_path / "checkpoint.safetensors"
    t = make_trainer(corpus, manifest, "a", Records(), Transport("a"), rounds=2, checkpoint=path)
    t.inner.step(0)
    theta, _, _ = state_of(t)
    busy = threading.Event()
    t.checkpoints.writer.submit_call(lambda: busy.wait(60))  # a slow disk still writing the last one
    t.save(background=True)
    assert t.inner._hold is None and t.state.copying is None  # nothing waits for a write under way
    t.inner.step(1)  # changes θ at once; the checkpoint has its own copy already
    busy.set()
    t.checkpoints.writer.flush()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    assert all(torch.equal(a, b) for a, b in zip(saved.theta, theta, strict=True))


def small_state(theta: list[torch.Tensor], **extra) -> PeerState:
    """A two-tensor peer state at round 1 whose φ and momentum are copies of ``theta``."""
    return PeerState(
        run_id="r",
        round=1,
        inner_step=4,
        round_step=0,
        round_tokens=0,
        names=["a", "b"],
        phi=[t.clone() for t in theta],
        momentum=[t.clone() for t in theta],
        theta=theta,
        **extra,
    )


def test_live_tensors_are_copied_before_writing_and_never_written_as_they_are(tmp_path):
    theta = [torch.ones(3, 2), torch.zeros(4)]
    state = small_state(theta)
    file = encode_checkpoint(state, live=("theta",))
    assert file.live == {"theta.a", "theta.b"}
    assert file.tensors["theta.a"].data_ptr() == theta[0].data_ptr()  # referenced, not copied
    with pytest.raises(ValueError, match="copy_live"):
        write_checkpoint(tmp_path / "c.safetensors", file)
    assert not (tmp_path / "c.safetensors").exists()
    copied = copy_live(file)
    theta[0].add_(5.0)  # the trainer moves on
    assert isinstance(copied, CheckpointFile) and not copied.live
    assert torch.equal(copied.tensors["theta.a"], torch.ones(3, 2))
    assert copied.tensors["phi.a"] is file.tensors["phi.a"]  # copies already: shared
    write_checkpoint(tmp_path / "c.safetensors", copied)
    saved = load_checkpoint(tmp_path / "c.safetensors", run_id="r", names=["a", "b"], shapes=[(3, 2), (4,)])
    assert torch.equal(saved.theta[0], torch.ones(3, 2))
    assert copy_live(copied) is copied


def test_private_tensors_are_written_as_they_are_unless_they_are_not_plain_host_fp32(tmp_path):
    residuals = [torch.full((3, 2), 0.5), torch.full((8,), 0.25)[::2]]  # the second: not contiguous
    state = small_state([torch.ones(3, 2), torch.zeros(4)], residuals=residuals)
    file = encode_checkpoint(state, private=("residual",))
    assert file.tensors["residual.a"] is residuals[0]  # the averager's copy: no second one
    assert file.tensors["residual.b"].data_ptr() != residuals[1].data_ptr()  # copied: made contiguous
    assert file.tensors["phi.a"].data_ptr() != state.phi[0].data_ptr()  # not private: copied
    write_checkpoint(tmp_path / "c.safetensors", file)
    saved = load_checkpoint(tmp_path / "c.safetensors", run_id="r", names=["a", "b"], shapes=[(3, 2), (4,)])
    assert saved.residuals is not None and torch.equal(saved.residuals[1], torch.full((4,), 0.25))
