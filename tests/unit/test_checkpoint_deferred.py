"""A round's checkpoint writes θ and AdamW's moments first, from the tensors as held, in the writer's
thread (peer/round/checkpointing.py ``Checkpointing.save``, peer/state/checkpoint.py
``write_checkpoint``) while the next inner step's forward and backward passes run; that step's
update waits until they are in the file (``InnerLoop.hold_updates``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import peer.state.safetensors_stream as stream
from peer.round import Trainer
from peer.state.checkpoint import PeerState, encode_checkpoint, load_checkpoint, write_checkpoint
from protocol.errors import CheckpointError
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
    """Make the checkpoint writer's first tensor (θ's first) wait until the returned ``gate`` is
    set; ``reached`` is set once the write is waiting there."""
    gate, reached, real_write = threading.Event(), threading.Event(), stream._write_one

    def slow_write(f, t):
        if not reached.is_set():
            reached.set()
            assert gate.wait(60)
        real_write(f, t)

    monkeypatch.setattr(stream, "_write_one", slow_write)
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

    probes: list[Probe] = []
    gate, _ = gate_the_copy(monkeypatch)  # the writer's first tensor waits until the test opens the gate
    hold = t.inner.hold_updates
    monkeypatch.setattr(t.inner, "hold_updates", lambda until: (probes.append(Probe(until)), hold(probes[-1])))
    t.save(background=True)
    assert len(probes) == 1, "an idle writer writes θ first: the next update is held"

    stepped = threading.Thread(target=t.inner.step, args=(2,))
    stepped.start()
    assert probes[0].reached.wait(60)  # forward and backward done, the update waits
    assert all(torch.equal(p, q) for p, q in zip(t.params, theta))  # θ untouched while it is being written
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


def test_a_busy_writer_skips_this_rounds_checkpoint_and_the_next_round_end_writes_it(corpus, tmp_path):
    manifest = tiny_run().replace(sync={"overlap": "delayed"})
    path = tmp_path / "checkpoint.safetensors"
    t = make_trainer(corpus, manifest, "a", Records(), Transport("a"), rounds=2, checkpoint=path)
    t.inner.step(0)
    busy = threading.Event()
    t.checkpoints.writer.submit_call(lambda: busy.wait(60))  # a slow disk still writing the last one
    t.checkpoints.every_s = 1000.0
    assert t.checkpoints.due(100.0)
    assert t.save(background=True) is None
    assert t.inner._hold is None and t.state.copying is None  # nothing waits for a write under way
    t.inner.step(1)  # changes θ at once: nothing of it is held
    busy.set()
    t.checkpoints.writer.flush()
    assert not path.exists()
    assert t.checkpoints.due(100.5), "the skipped checkpoint is written at the next round's end"
    theta, _, _ = state_of(t)
    assert t.save(background=True) == str(path)
    t.inner.step(2)
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


def test_live_tensors_are_written_first_and_released_before_the_rest(tmp_path, monkeypatch):
    theta = [torch.ones(3, 2), torch.zeros(4)]
    state = small_state(theta)
    file = encode_checkpoint(state, private=("phi", "momentum"), live=("theta",))
    assert file.live == {"theta.a", "theta.b"}
    assert file.tensors["theta.a"].data_ptr() == theta[0].data_ptr()  # referenced, not copied
    assert file.tensors["phi.a"].data_ptr() == state.phi[0].data_ptr()
    released, seen, real_write = threading.Event(), [], stream._write_one

    def watched(f, t):
        seen.append((t.data_ptr(), released.is_set()))
        real_write(f, t)
        if len(seen) == 2:
            theta[0].add_(5.0)  # the trainer moves on once θ is written

    monkeypatch.setattr(stream, "_write_one", watched)
    write_checkpoint(tmp_path / "c.safetensors", file, released=released)
    assert released.is_set()
    assert seen[:2] == [(theta[0].data_ptr(), False), (theta[1].data_ptr(), False)]  # θ first, held
    assert all(was_released for _, was_released in seen[2:])  # the rest after the trainer was released
    saved = load_checkpoint(tmp_path / "c.safetensors", run_id="r", names=["a", "b"], shapes=[(3, 2), (4,)])
    assert torch.equal(saved.theta[0], torch.ones(3, 2))  # as it was when written, not as changed after


def test_a_failed_write_still_releases_the_trainer(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    released = threading.Event()
    file = encode_checkpoint(small_state([torch.ones(3, 2), torch.zeros(4)]), live=("theta",))
    with pytest.raises(CheckpointError, match="previous one is intact"):
        write_checkpoint(tmp_path / "file" / "c.safetensors", file, released=released)
    assert released.is_set()


def test_private_tensors_are_referenced_whatever_they_are_and_written_as_fp32(tmp_path):
    residuals = [torch.full((3, 2), 0.5), torch.full((8,), 0.25)[::2]]  # the second: not contiguous
    state = small_state([torch.ones(3, 2), torch.zeros(4)], residuals=residuals)
    state.phi[1] = state.phi[1].to(torch.float16)  # any float dtype: written as fp32
    file = encode_checkpoint(state, private=("residual", "phi"))
    assert file.tensors["residual.a"] is not None and file.tensors["residual.a"].data_ptr() == residuals[0].data_ptr()
    assert file.tensors["residual.b"].data_ptr() == residuals[1].data_ptr()  # referenced: converted as written
    assert file.tensors["momentum.a"].data_ptr() != state.momentum[0].data_ptr()  # not private: copied
    write_checkpoint(tmp_path / "c.safetensors", file)
    saved = load_checkpoint(tmp_path / "c.safetensors", run_id="r", names=["a", "b"], shapes=[(3, 2), (4,)])
    assert saved.residuals is not None and torch.equal(saved.residuals[1], torch.full((4,), 0.25))
    assert saved.phi[1].dtype == torch.float32 and torch.equal(saved.phi[1], torch.zeros(4))
