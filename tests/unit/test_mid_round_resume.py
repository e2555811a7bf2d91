"""A stop inside a round and the restart (peer/round/checkpointing.py): the checkpoint holds the inner
step k, θ, AdamW's state and the data position; the restart trains the round's last H − k steps at the
lr schedule's same steps and ends the round where an uninterrupted peer ends it, bit for bit; when
the swarm went further in that round meanwhile, it goes to the swarm's step. Real Trainers of the
tiny run over the in-process transport, alone."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.round import Trainer
from peer.state.checkpoint import load_checkpoint, save_checkpoint
from peer.train.model import build_model
from protocol.manifest import RunManifest
from protocol.presets import tiny_run
from protocol.records import ProgressRecord
from tests.unit.sim_fixtures import Events, corpus, evaluations, one_thread  # noqa: F401 (fixtures)

H, K = 8, 3
"""The round's inner steps, and the step the stop comes after."""


class StopAt(Events):
    """Keeps every event; sets ``stop`` once inner step ``at`` of a round is done (as a signal
    during that step would: the loop finishes the step, then stops)."""

    def __init__(self, stop: threading.Event, at: int):
        super().__init__()
        self.stop, self.at = stop, at

    def step(self, *, round_, step, steps, loss, tokens_per_s):
        if step == self.at:
            self.stop.set()


@pytest.fixture(scope="module")
def manifest() -> RunManifest:
    return tiny_run().replace(sync={"inner_steps": H})


def make(corpus, manifest, *, path=None, hub=None, reporter=None, stop=None, rounds=1) -> Trainer:
    hub = hub or InProcessHub()
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=InProcessSwarm("a", hub),
        transport=InProcessTransport("a"),
        config=TrainerConfig(max_rounds=rounds, checkpoint_path=path),
        reporter=reporter or Events(),
        stop_event=stop or threading.Event(),
    )


def lr_steps_of(t: Trainer) -> list[int]:
    """The ``inner_step`` each inner step of ``t`` is given (what indexes the lr schedule), as it runs."""
    seen: list[int] = []
    step = t.inner.step

    def recording(inner_step, **kwargs):
        seen.append(inner_step)
        return step(inner_step, **kwargs)

    t.inner.step = recording  # type: ignore[method-assign]
    return seen


def stopped_at_k(corpus, manifest, path) -> Trainer:
    """A peer stopped after inner step K of round 0, its checkpoint written to ``path``."""
    stop = threading.Event()
    t = make(corpus, manifest, path=path, reporter=StopAt(stop, K), stop=stop)
    summary = t.run()
    assert summary.interrupted and (t.pos.round, t.pos.step) == (0, K)
    t.save()
    return t


def test_a_stop_mid_round_resumes_at_its_step_and_ends_the_round_as_if_never_stopped(corpus, manifest, tmp_path):
    whole = make(corpus, manifest)
    whole_lr = lr_steps_of(whole)
    whole.run()
    assert whole_lr == list(range(H))

    path = tmp_path / "checkpoint.safetensors"
    stopped = stopped_at_k(corpus, manifest, path)
    saved = load_checkpoint(path, run_id=manifest.run_id, names=stopped.names, shapes=stopped.shapes)
    assert (saved.round, saved.round_step, saved.inner_step, saved.adam_step) == (0, K, K, K)
    assert saved.data is not None and saved.data.batches_drawn == K
    adam = stopped.inner.state_dict()
    assert adam is not None

    reporter = Events()
    again = make(corpus, manifest, path=path, reporter=reporter)
    again_lr = lr_steps_of(again)
    restored: list[dict] = []  # AdamW's state as restored (copies: the steps after change it in place)

    def emit(event, **fields):
        Events.emit(reporter, event, **fields)
        if event == "resumed":
            state = again.inner.state_dict()
            restored.append({k: v if k == "step" else [t.clone() for t in v] for k, v in state.items()})

    reporter.emit = emit  # type: ignore[method-assign]
    again.run()

    resumed = reporter.of("resumed")[0]
    assert (resumed["round"], resumed["round_step"], resumed["batches_drawn"]) == (0, K, K)
    assert restored[0]["step"] == adam["step"] == K  # AdamW's bias correction goes on from step K
    for name in ("exp_avg", "exp_avg_sq"):
        for got, want in zip(restored[0][name], adam[name], strict=True):
            assert torch.equal(got, want), name
    assert again_lr == list(range(K, H))  # the round's last H − K steps, at the schedule's same steps
    assert [e["round"] for e in reporter.of("round")] == [1]
    assert again.inner.sampler.batches_drawn == H  # no batch replayed, none skipped
    for got, want in zip(again.phi, whole.phi, strict=True):  # the round ends where it would have
        assert torch.equal(got, want)
    assert any(not torch.equal(a, b) for a, b in zip(again.phi, stopped.phi))  # and it did train


def publish(hub: InProcessHub, peer: str, step: int) -> None:
    """``peer``'s progress record: at inner ``step`` of round 0."""
    hub.publish(
        peer, ProgressRecord(round=0, inner_step=step, train_loss=1.0, tokens_per_s=1.0, group_size=1, bytes_sent=0)
    )


def test_a_restart_goes_to_the_inner_step_the_swarm_reached_in_its_round_never_back(corpus, manifest, tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    stopped_at_k(corpus, manifest, path)
    for swarm_step, expected in ((6, 6), (K, K), (1, K)):
        hub, reporter = InProcessHub(), Events()
        publish(hub, "b", swarm_step)
        t = make(corpus, manifest, path=path, hub=hub, reporter=reporter)
        t.checkpoints.restore()
        tokens = t.pos.tokens
        assert t.checkpoints.join_swarm_step(t.swarm) == expected - K
        assert (t.pos.round, t.pos.step, t.state.inner_step) == (0, expected, expected)
        assert t.pos.tokens == tokens > 0  # Δ still weighs the K steps trained
        said = [e["message"] for e in reporter.of("status") if "joining it there" in e["message"]]
        line = (
            f"the swarm went on to inner step 6 of {H} of round 0 meanwhile: joining it there from step {K}, "
            "to sync with it at the round's end"
        )
        assert said == ([line] if expected > K else [])


def test_only_a_restored_peer_where_its_checkpoint_left_it_joins_the_swarms_step(corpus, manifest, tmp_path):
    hub = InProcessHub()
    publish(hub, "b", 6)
    fresh = make(corpus, manifest, hub=hub)  # nothing restored: a joiner's start is catch-up's
    assert fresh.checkpoints.join_swarm_step(fresh.swarm) == 0 and fresh.pos.step == 0

    path = tmp_path / "checkpoint.safetensors"
    stopped_at_k(corpus, manifest, path)
    moved = make(corpus, manifest, path=path, hub=hub)
    moved.checkpoints.restore()
    moved.pos.step = 5  # an adoption put it elsewhere (catchup.py): it stays there
    assert moved.checkpoints.join_swarm_step(moved.swarm) == 0 and moved.pos.step == 5


def test_a_restart_reports_the_loss_its_checkpoint_recorded_and_evaluates_that_phi_no_second_time(
    corpus, manifest, tmp_path, evaluations
):
    """The stop's checkpoint keeps the loss of its φ as measured before (with the snapshot's digest);
    the restart's initial evaluation is that loss, so its first steps do not share the cores with an
    evaluation (issue #68 item 3). A recorded loss whose digest is not the restored state's is not used."""
    path = tmp_path / "checkpoint.safetensors"
    stop = threading.Event()
    first = StopAt(stop, K)
    t = make(corpus, manifest, path=path, reporter=first, stop=stop)
    t.run()
    t.save()
    (measured,) = [e["loss"] for e in first.of("eval") if e["when"] == "initial"]
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    assert saved.phi_eval is not None and saved.phi_eval[1] == measured

    del evaluations[:]
    reporter = Events()
    again = make(corpus, manifest, path=path, reporter=reporter)
    again.run()  # round 0's last H − K steps, then the final evaluation of round 1's φ
    (initial,) = [e for e in reporter.of("eval") if e["when"] == "initial"]
    assert initial["loss"] == measured and initial["round"] == 0
    assert len(evaluations) == 1 and [e["when"] for e in reporter.of("eval")] == ["initial", "final"]
    assert any(
        m.endswith("(the checkpoint's or the catch-up's)") for m in (e["message"] for e in reporter.of("status"))
    )

    save_checkpoint(path, dataclasses.replace(saved, phi_eval=("00" * 16, measured)))  # another state's
    del evaluations[:]
    reporter = Events()
    make(corpus, manifest, path=path, reporter=reporter).run()
    (initial,) = [e for e in reporter.of("eval") if e["when"] == "initial"]
    assert len(evaluations) == 2 and initial["loss"] == pytest.approx(measured, rel=1e-5)  # evaluated afresh
