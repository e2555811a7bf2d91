"""An adopted state's loss check is the round's initial evaluation (issue #68 item 3): the catch-up
measured the adopted φ on this peer's validation windows (peer/round/catchup.py ``CatchUp.known_loss``),
so the round reports that value as its ``eval (initial)`` and evaluates that φ no second time."""

from __future__ import annotations

import threading

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.round import Trainer
from peer.state.download import DownloadedState, StateDownload
from peer.train.model import build_model
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import Events, corpus, evaluations, one_thread  # noqa: F401 (fixtures)


def trainer(corpus, manifest, *, peer, rounds, reporter):
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=InProcessSwarm(peer, InProcessHub()),
        transport=InProcessTransport(peer),
        config=TrainerConfig(max_rounds=rounds, checkpoint_path=None, eval_every_rounds=0),
        reporter=reporter,
        stop_event=threading.Event(),
    )


@pytest.mark.usefixtures("one_thread")
def test_an_adopted_states_checked_loss_is_the_initial_evaluation_without_a_second_one(corpus, evaluations):
    manifest = tiny_run()
    swarm_peer = trainer(corpus, manifest, peer="a", rounds=1, reporter=Events())
    swarm_peer.run()  # one round trained: its φ is the swarm's state of round 1
    theirs = DownloadedState(
        round=1,
        inner_step=manifest.sync.inner_steps,
        phi=[f.clone() for f in swarm_peer.phi],
        outer_state=[t.clone() for t in swarm_peer.outer.state_tensors()],
    )

    reporter = Events()
    t = trainer(corpus, manifest, peer="b", rounds=2, reporter=reporter)
    targets = [(1, "cd" * 16, ["a"])]
    t.catchup.resync_target = lambda: targets.pop() if targets else None
    t.transport.download_state = lambda donors, digest, timeout_s: StateDownload(
        state=theirs, chunks_by_donor={"a": 1}, failed={}, bytes_received=0
    )
    at_first_step: list[int] = []
    step = t.inner.step

    def first_step(lr_step):
        if not at_first_step:
            at_first_step.append(len(evaluations))
        return step(lr_step)

    t.inner.step = first_step
    del evaluations[:]
    summary = t.run()

    (adopted,) = reporter.of("adopted_state")
    assert adopted["round"] == 1
    # the check: this peer's own φ_0 and the downloaded φ; nothing else before the first inner step
    assert at_first_step == [2]
    (initial,) = [e for e in reporter.of("eval") if e["when"] == "initial"]
    checked = t.publisher.phi_loss(theirs.phi)  # the downloaded φ on the same windows, afresh
    assert initial["round"] == 1 and initial["loss"] == pytest.approx(checked, rel=1e-6)
    assert summary.initial_eval_loss == initial["loss"]
    assert reporter.index("adopted_state") < reporter.index("eval", when="initial") < reporter.index("round")
    status = [e["message"] for e in reporter.of("status")]
    assert any(
        m.endswith("φ's validation loss of that round is known (the checkpoint's or the catch-up's)") for m in status
    )
    # the two checks, then the final evaluation after round 2 and the afresh one above: no initial one
    assert len(evaluations) == 4


@pytest.mark.usefixtures("one_thread")
def test_a_phi_changed_since_the_check_is_evaluated_again(corpus):
    """Only the very tensors measured reuse the loss: φ replaced since (a landing, a restore) is
    evaluated, as are other tensors holding the same shapes."""
    reporter = Events()
    t = trainer(corpus, tiny_run(), peer="b", rounds=1, reporter=reporter)
    c = t.catchup
    loss, whose = c.reference_loss(0)
    assert whose == "this peer's" and c.known_loss(list(t.phi)) == loss
    assert c.known_loss([f.clone() for f in t.phi]) is None
    with t.state.lock:
        t.state.install_all([*(f + 1.0 for f in t.phi), *t.outer.state_tensors()])
    assert c.known_loss(list(t.phi)) is None
    assert c.reference_loss(0)[0] != loss
    assert torch.isfinite(torch.tensor(c.reference_loss(0)[0]))
