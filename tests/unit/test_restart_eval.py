"""A restart trains at once (issue #53 item 4): on the host, the initial evaluation of φ runs alongside
the first inner steps (peer/round/publishing.py ``Publisher.eval_phi_alongside``), reported with the
round and loss of the φ the peer started from, before the round's end; a status line says where
training starts."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.round import Trainer
from peer.round.catchup import phi_loss
from peer.state.checkpoint import load_checkpoint, save_checkpoint
from peer.train.model import build_model
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import Events, corpus, one_thread  # noqa: F401 (fixtures)


def trainer(corpus, manifest, *, rounds, checkpoint, reporter, stop=None):
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=InProcessSwarm("a", InProcessHub()),
        transport=InProcessTransport("a"),
        config=TrainerConfig(max_rounds=rounds, checkpoint_path=checkpoint, eval_every_rounds=0),
        reporter=reporter,
        stop_event=stop or threading.Event(),
    )


@pytest.mark.usefixtures("one_thread")
def test_a_restart_evaluates_the_phi_it_resumed_from_alongside_and_reports_it_before_the_round_ends(corpus, tmp_path):
    manifest, path = tiny_run(), tmp_path / "checkpoint.safetensors"
    first = trainer(corpus, manifest, rounds=1, checkpoint=path, reporter=Events())
    first.run()
    first.save()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=first.names, shapes=first.shapes)
    expected = phi_loss(build_model(manifest.model, corpus.tokenizer), first.publisher.val_windows, saved.phi)
    # the checkpoint keeps the final evaluation's loss (a restart would report it, not evaluate):
    # taken out here, so that this restart has none and evaluates alongside
    assert saved.phi_eval is not None and saved.phi_eval[1] == pytest.approx(expected, rel=1e-6)
    save_checkpoint(path, dataclasses.replace(saved, phi_eval=None))

    reporter = Events()
    again = trainer(corpus, manifest, rounds=2, checkpoint=path, reporter=reporter)
    summary = again.run()
    status = [e["message"] for e in reporter.of("status")]
    assert "training from round 1, inner step 0 of 5; evaluating φ of that round alongside" in status
    (initial,) = [e for e in reporter.of("eval") if e["when"] == "initial"]
    assert initial["round"] == 1 and initial["loss"] == pytest.approx(expected, rel=1e-6)
    assert summary.initial_eval_loss == initial["loss"]
    assert reporter.index("resumed") < reporter.index("eval", when="initial") < reporter.index("round")
    assert again.publisher.last_eval[0] >= 1  # the records carried it (then the final one)


@pytest.mark.usefixtures("one_thread")
def test_a_stop_in_the_first_round_still_reports_the_initial_evaluation(corpus, tmp_path):
    stop = threading.Event()
    reporter = Events()
    t = trainer(corpus, tiny_run(), rounds=3, checkpoint=None, reporter=reporter, stop=stop)
    step = t.inner.step

    def step_then_stop(lr_step):
        result = step(lr_step)
        stop.set()
        return result

    t.inner.step = step_then_stop
    summary = t.run()
    assert summary.interrupted and not reporter.of("round")
    (initial,) = reporter.of("eval")
    assert initial["when"] == "initial" and initial["round"] == 0
    assert summary.initial_eval_loss == initial["loss"]


@pytest.mark.usefixtures("one_thread")
def test_the_loss_check_of_an_adoption_waits_for_the_evaluation_alongside(corpus):
    reporter = Events()
    t = trainer(corpus, tiny_run(), rounds=1, checkpoint=None, reporter=reporter)
    p = t.publisher
    phi0 = [f.clone() for f in t.phi]
    p.eval_phi_alongside("initial")
    with torch.no_grad():  # φ moves on while it runs: the evaluation is of the φ it copied
        for f in t.phi:
            f.add_(1.0)
    moved = p.phi_loss(list(t.phi))  # reports the evaluation alongside first, then computes its own
    (initial,) = reporter.of("eval")
    fresh = build_model(tiny_run().model, corpus.tokenizer)
    assert initial["loss"] == pytest.approx(phi_loss(fresh, p.val_windows, phi0), rel=1e-6)
    assert moved == pytest.approx(phi_loss(fresh, p.val_windows, list(t.phi)), rel=1e-6)
    assert p.finish_eval() is None  # nothing pending any more
