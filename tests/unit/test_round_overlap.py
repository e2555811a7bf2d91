"""The round loop with sync.overlap (peer/round/, peer/sync/background.py), two real Trainers in
threads over an in-memory transport: identical φ, a groupmate dying during a background sync, and
a checkpoint taken with a sync in flight (a restart drops that sync)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.reporting import Reporter
from peer.round import Trainer
from peer.state.checkpoint import load_checkpoint
from peer.train.model import build_model
from protocol.errors import AllreduceFailed, GroupNotFound, HelperDied
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)

Records = Group = InProcessHub
"""The swarm's records (a DHT in a dict) and each round's group: ``Records(ghosts=...)``, ``Group(members,
matchmaking_s=...)`` (lab/inprocess.py); a state is downloaded from a provider its peer registered."""
Swarm, Transport = InProcessSwarm, InProcessTransport


class Events(Reporter):
    def __init__(self, on_event=None):
        super().__init__()
        self.events, self.on_event = [], on_event

    def emit(self, event, **fields):
        self.events.append({"event": event, **fields})
        if self.on_event is not None:
            self.on_event(event, fields)

    def of(self, kind):
        return [e for e in self.events if e["event"] == kind]


def make_trainer(corpus, manifest, peer_id, records, transport, *, rounds, checkpoint=None, reporter=None, stop=None):
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=Swarm(peer_id, records),
        transport=transport,
        config=TrainerConfig(max_rounds=rounds, checkpoint_path=checkpoint),
        reporter=reporter or Events(),
        stop_event=stop or threading.Event(),
    )


def run_in_threads(trainers):
    errors = []

    def run(t):
        try:
            t.run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)


def run_pair_with_identical_state(corpus, manifest, *, rounds: int) -> list[Trainer]:
    """Trainers "a" and "b" of ``manifest`` in one group of two, run for ``rounds`` in threads; checks
    that their φ and outer state end finite and bit-identical, with equal digests."""
    records, group = Records(), Group(2)
    trainers = [make_trainer(corpus, manifest, p, records, Transport(p, group), rounds=rounds) for p in ("a", "b")]
    run_in_threads(trainers)
    a, b = trainers
    for x, y in zip([*a.phi, *a.outer.state_tensors()], [*b.phi, *b.outer.state_tensors()]):
        assert torch.isfinite(x).all() and torch.equal(x, y)
    assert a.state_digest == b.state_digest
    return trainers


def calling_threads(monkeypatch, cls, name: str) -> list[str]:
    """The names of the threads that call ``cls.name`` from now on, in call order (the method still runs)."""
    threads, method = [], getattr(cls, name)

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)
    return threads


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_two_peers_overlap_their_syncs_and_hold_identical_phi(corpus, overlap, tmp_path, monkeypatch):
    from peer.train.outer import DiLoCo

    applied_in = calling_threads(monkeypatch, DiLoCo, "apply")
    previewed_in = calling_threads(monkeypatch, DiLoCo, "preview")
    manifest = tiny_run().replace(sync={"overlap": overlap})
    records, group = Records(), Group(2)
    trainers = [
        make_trainer(
            corpus,
            manifest,
            p,
            records,
            Transport(p, group),
            rounds=3,
            # a directory each, as real peers have: a write clears the directory's temporaries
            checkpoint=tmp_path / p / f"{p}.safetensors",
        )
        for p in ("a", "b")
    ]
    phi0 = [f.clone() for f in trainers[0].phi]
    run_in_threads(trainers)
    a, b = trainers
    for x, y in zip(a.phi, b.phi):
        assert torch.isfinite(x).all() and torch.equal(x, y)  # bit-identical after the last sync landed
    assert any(not torch.equal(x, y) for x, y in zip(a.phi, phi0))
    for t in trainers:
        # every sync ran in the background thread, one per round, in order
        assert [r for r, _ in t.transport.calls] == [0, 1, 2]
        assert [e["round"] for e in t.reporter.of("sync")] == [0, 1, 2]
        assert all(name.startswith("locoswarm-sync") for _, name in t.transport.calls)
        # a background sync may wait for a late groupmate for about a round's inner steps
        assert all(b > 0 for b in t.transport.budgets)
        rounds = t.reporter.of("round")
        assert [e["round"] for e in rounds] == [1, 2, 3]
        assert [e["group_size"] for e in rounds] == [1, 2, 2]  # round 1 reports no landed sync yet
        assert t.summary.final_eval_loss < t.summary.initial_eval_loss
        assert [p.detach() for p in t.params] and all(torch.equal(p.detach(), f) for p, f in zip(t.params, t.phi))
        # the checkpoint's φ and outer state are the snapshot's copies of them: the live values
        t.save()  # as `peer join` does after run(): the last sync landed after round 3's checkpoint
        saved = load_checkpoint(
            tmp_path / t.peer_id / f"{t.peer_id}.safetensors", run_id=manifest.run_id, names=t.names, shapes=t.shapes
        )
        assert saved.round == 3 and all(torch.equal(x, y) for x, y in zip(saved.phi, t.phi))
        assert all(torch.equal(x, y) for x, y in zip(saved.momentum, t.outer.state_tensors()))
        assert any(bool(m.abs().sum() > 0) for m in saved.momentum)
    assert a.state_digest == b.state_digest
    # each landing installed the outer step its sync's thread prepared; only the last sync, waited
    # for when training ends, was applied on the training thread
    prepared = [n for n in applied_in if n.startswith("locoswarm-sync")]
    assert len(prepared) == 6
    assert len([n for n in applied_in if not n.startswith("locoswarm-sync")]) == 2
    # eager's start point for each round after a sync is DiLoCo.preview, on the training thread,
    # once per sync and peer; delayed never previews
    assert len(previewed_in) == (6 if overlap == "eager" else 0)
    assert not any(n.startswith("locoswarm-sync") for n in previewed_in)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_overlap_from_round_k_syncs_blocking_before_round_k_then_in_the_background(corpus, overlap, monkeypatch):
    """``sync.overlap_from_round`` K = 2: rounds 0 and 1 sync on the training thread and report
    their own group at once; round 2's sync is the first in the background (round 3's end lands
    it: round 2's end reports none), eager previews only from then on, and φ stays bit-identical."""
    from peer.train.outer import DiLoCo

    previewed = calling_threads(monkeypatch, DiLoCo, "preview")
    manifest = tiny_run().replace(sync={"overlap": overlap, "overlap_from_round": 2})
    trainers = run_pair_with_identical_state(corpus, manifest, rounds=4)
    for t in trainers:
        assert [r for r, _ in t.transport.calls] == [0, 1, 2, 3]
        in_background = [name.startswith("locoswarm-sync") for _, name in t.transport.calls]
        assert in_background == [False, False, True, True]
        # a blocking sync has no inner steps to wait through; a background one may wait about a round's
        assert [b > 0 for b in t.transport.budgets] == in_background
        assert [e["round"] for e in t.reporter.of("sync")] == [0, 1, 2, 3]
        rounds = t.reporter.of("round")
        assert [e["round"] for e in rounds] == [1, 2, 3, 4]
        assert [e["group_size"] for e in rounds] == [2, 2, 1, 2]  # round 2's sync lands at round 3's end
        assert t.summary.final_eval_loss < t.summary.initial_eval_loss
        assert all(torch.equal(p.detach(), f) for p, f in zip(t.params, t.phi))
    # eager: one preview per peer at the end of rounds 2 and 3 (the overlapped ones), none before
    assert len(previewed) == (4 if overlap == "eager" else 0)


def test_eager_with_outer_momentum_starts_each_peer_from_its_own_state_on_identical_phi(corpus, monkeypatch):
    """Eager with Nesterov momentum (the eager paper's per-worker outer state, peer/train/overlap.py
    ``EagerState``): every round after the first starts each peer from φ plus its own offset, the
    two peers' starts differ (their own Δ), while φ and the outer momentum stay bit-identical."""
    from peer.train.overlap import EagerState

    starts, start = {}, EagerState.start

    def recorded_start(self, outer, phi, delta, *, share):
        out = start(self, outer, phi, delta, share=share)
        starts.setdefault(id(self), []).append(
            ([p.clone() for p in phi], [t.clone() for t in out], [o.clone() for o in self.offset])
        )
        return out

    monkeypatch.setattr(EagerState, "start", recorded_start)
    manifest = tiny_run().replace(
        sync={"overlap": "eager"}, outer_optimizer={"lr": 0.7, "momentum": 0.9, "nesterov": True}
    )
    trainers = a, b = run_pair_with_identical_state(corpus, manifest, rounds=3)
    assert any(bool(m.abs().sum() > 0) for m in a.outer.state_tensors())
    runs = [starts[id(t.schedule.eager)] for t in trainers]
    assert [len(r) for r in runs] == [3, 3]  # one eager start per round end, on the training thread
    for phi, out, offset in runs[0] + runs[1]:
        for p, x, o in zip(phi, out, offset):
            assert torch.equal(x, p + o)
    # the same φ at round 2's end, different own offsets: each peer's own part of its outer state
    assert all(torch.equal(x, y) for x, y in zip(runs[0][1][0], runs[1][1][0]))
    assert any(not torch.equal(x, y) for x, y in zip(runs[0][1][2], runs[1][1][2]))
    assert a.schedule.eager.offset is None and b.schedule.eager.offset is None  # training ended from φ: reset


def test_groupmate_dying_during_a_background_sync_applies_the_own_step(corpus):
    """The groupmate is live when the round ends, then its all-reduce fails: the survivor keeps
    training, applies its own payload a round late (as a failed blocking sync does), φ finite."""
    manifest = tiny_run().replace(sync={"overlap": "delayed"})

    def die(round_, should_stop):
        time.sleep(0.05)
        raise AllreduceFailed(f"round {round_} all-reduce failed: groupmate ghost stopped answering")

    reporter = Events()
    t = make_trainer(
        corpus, manifest, "a", Records(ghosts=("ghost",)), Transport("a", fail=die), rounds=3, reporter=reporter
    )
    phi0 = [f.clone() for f in t.phi]
    t.run()
    rounds = reporter.of("round")
    assert [e["round"] for e in rounds] == [1, 2, 3]
    assert len(t.transport.calls) == 3  # it kept trying its (expected) group every round
    assert all(math.isfinite(e["train_loss"]) for e in rounds)
    assert all(torch.isfinite(f).all() for f in t.phi)
    assert any(not torch.equal(x, y) for x, y in zip(t.phi, phi0))  # the own steps were applied
    assert t.summary.final_eval_loss < t.summary.initial_eval_loss


def test_checkpoint_with_a_sync_in_flight_holds_the_last_applied_phi_and_a_restart_drops_it(corpus, tmp_path):
    manifest = tiny_run().replace(sync={"overlap": "delayed"})
    path = tmp_path / "checkpoint.safetensors"
    stop = threading.Event()
    hung = threading.Event()

    def hang(round_, should_stop):  # the groupmate never answers: the sync stays in flight
        hung.set()
        while not should_stop():
            time.sleep(0.02)
        raise GroupNotFound(f"round {round_} sync cancelled by shutdown")

    def stop_after_first_round(event, fields):
        if event == "round" and fields["round"] == 1:
            stop.set()  # as a SIGINT during round 1's inner steps

    t = make_trainer(
        corpus,
        manifest,
        "a",
        Records(ghosts=("ghost",)),
        Transport("a", fail=hang),
        rounds=5,
        checkpoint=path,
        reporter=Events(stop_after_first_round),
        stop=stop,
    )
    phi0 = [f.clone() for f in t.phi]
    summary = t.run()
    assert summary.interrupted and hung.is_set()
    theta = [p.detach().clone() for p in t.params]
    t.save()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    assert saved.round == 1
    for a, b in zip(saved.phi, phi0):  # round 0's mean never landed: φ is the last applied one (φ_0)
        assert torch.equal(a, b)
    for a, b in zip(saved.theta, theta):  # θ carries round 0's own progress (delayed: φ − Δ_0)
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(saved.theta, phi0))

    # The restart: nothing in flight; it resumes at round 1 from φ_0 and θ, and trains alone.
    reporter = Events()
    again = make_trainer(corpus, manifest, "a", Records(), Transport("a"), rounds=3, checkpoint=path, reporter=reporter)
    resumed_phi = []
    reporter.on_event = lambda event, fields: event == "resumed" and resumed_phi.append([f.clone() for f in again.phi])
    again.run()
    assert reporter.of("resumed")[0]["round"] == 1
    assert all(torch.equal(a, b) for a, b in zip(resumed_phi[0], phi0))
    assert [e["round"] for e in reporter.of("round")] == [2, 3]
    assert again.transport.calls == []  # alone: its own step, no sync
    assert all(torch.isfinite(f).all() for f in again.phi)
    assert any(not torch.equal(a, b) for a, b in zip(again.phi, phi0))


def die_with_the_averager(round_, should_stop):
    """A transport's ``fail``: the averager process is gone (what LocoAverager's waits raise)."""
    raise HelperDied("this peer's averager process (pid 1) died with exit code -9")


def check_averager_death(corpus, manifest, path, transport, resumed_transport, expected: tuple[int, int]) -> None:
    """A peer of ``manifest`` alone with a ghost groupmate, whose ``transport`` fails with
    :func:`die_with_the_averager`: the loop stops as on a signal at ``expected`` (round, step), the
    error in the summary's ``fatal`` and no mean applied; its checkpoint holds that position and the training
    done, and a restart over ``resumed_transport`` resumes there and trains on."""
    reporter = Events()
    t = make_trainer(
        corpus, manifest, "a", Records(ghosts=("ghost",)), transport, rounds=5, checkpoint=path, reporter=reporter
    )
    phi0 = [f.clone() for f in t.phi]
    summary = t.run()
    assert summary.interrupted and isinstance(summary.fatal, HelperDied) and t.stop_event.is_set()
    assert (t.pos.round, t.pos.step) == expected
    assert [e["round"] for e in reporter.of("round")] == list(range(1, expected[0] + 1))
    assert all(torch.equal(a, b) for a, b in zip(t.phi, phi0))  # nothing of the dead sync applied
    t.save()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    assert (saved.round, saved.round_step) == expected
    assert any(not torch.equal(a, b) for a, b in zip(saved.theta, phi0))  # the training done is kept

    reporter = Events()
    again = make_trainer(
        corpus, manifest, "a", Records(), resumed_transport, rounds=expected[0] + 2, checkpoint=path, reporter=reporter
    )
    resumed = again.run()
    assert reporter.of("resumed")[0]["round"] == expected[0] and resumed.fatal is None
    assert [e["round"] for e in reporter.of("round")] == [expected[0] + 1, expected[0] + 2]


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_an_averager_that_dies_stops_the_loop_and_leaves_a_checkpoint_to_resume_from(corpus, tmp_path, overlap):
    """The averager process dies during round 0's sync (blocking: the loop waits on it; delayed: in
    the background thread, seen at round 1's landing)."""
    manifest = tiny_run().replace(sync={"overlap": overlap})
    check_averager_death(
        corpus,
        manifest,
        tmp_path / "checkpoint.safetensors",
        Transport("a", fail=die_with_the_averager),
        Transport("a"),
        expected=(0 if overlap == "none" else 1, manifest.sync.inner_steps),
    )


def slowed(trainer, seconds):
    """Make ``trainer``'s inner steps ``seconds`` longer (a slower machine)."""
    step = trainer.inner.step

    def slow_step(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    trainer.inner.step = slow_step


@pytest.mark.parametrize("groupmates_step_s", [0.02, 0.03])
def test_a_peer_joining_while_a_sync_is_in_flight_gets_in_step(corpus, groupmates_step_s):
    """The joiner's first download lacks the mean then in flight; it syncs its first round with the
    others, adopts their next state while keeping that sync, and from then holds their φ exactly.
    Also when the joiner is the faster machine: with overlap nothing holds it back at a round's end,
    so it reaches each round's end before its groupmates publish theirs, and it must wait for
    their records (they averaged with it from another state) to notice that it is a mean off.
    Every step is slowed (the tiny model's take milliseconds): rounds then last about a second,
    as a joiner's record reads (twice a second) assume, instead of a sixth of one."""
    manifest = tiny_run().replace(sync={"overlap": "delayed", "inner_steps": 30})
    records, group, trainers = Records(), Group(matchmaking_s=5.0), {}
    first = [make_trainer(corpus, manifest, p, records, Transport(p, group), rounds=10) for p in ("a", "b")]
    for t in first:
        slowed(t, groupmates_step_s)
    trainers.update({t.peer_id: t for t in first})
    joined, late_built = threading.Event(), threading.Event()

    def hold_until_the_joiner_is_built(event, fields):
        # the joiner comes while a sync is in flight, whatever the time its construction takes
        if event == "round" and fields["round"] == 2:
            joined.set()
            late_built.wait(60)

    first[0].reporter.on_event = hold_until_the_joiner_is_built
    threads = [threading.Thread(target=t.run) for t in first]
    for th in threads:
        th.start()
    assert joined.wait(120)
    late = make_trainer(corpus, manifest, "c", records, Transport("c", group), rounds=10)
    slowed(late, 0.02)
    late_built.set()
    late.run()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads)
    adopted = late.reporter.of("adopted_state")
    assert adopted and adopted[0]["round"] >= 2
    # in step after its second download: two rounds in a row with the whole group and no download
    # between (without keeping the sync in flight it would download every round, a mean behind)
    history = "\n".join(
        f"{t.peer_id}: "
        + ", ".join(
            f"{e['event']} {e.get('round')} {e.get('group_size')} {e.get('agreeing')} {e.get('note') or ''}"
            for e in t.reporter.events
            if e["event"] in ("round", "adopted_state")
        )
        for t in (*first, late)
    )
    kinds = [
        (e["event"], e.get("group_size")) for e in late.reporter.events if e["event"] in ("round", "adopted_state")
    ]
    assert any(a == b == ("round", 3) for a, b in zip(kinds, kinds[1:])), history
    assert any(e["group_size"] == 3 for e in late.reporter.of("round"))
    for t in first:
        for x, y in zip(t.phi, late.phi):  # all finished round 10 together, the last mean landed
            assert torch.isfinite(x).all() and torch.equal(x, y), history


def test_a_faster_peer_trains_while_its_sync_waits_for_a_slower_groupmate(corpus):
    """With overlap a peer faster than its groupmate takes more inner steps (at the round's last lr)
    instead of idling until the groupmate's contribution lands, at most 2·H a round; both still
    hold bit-identical φ, and the slow peer's rounds stay H steps."""
    H = 10
    manifest = tiny_run().replace(sync={"overlap": "delayed", "inner_steps": H})
    records, group = Records(), Group(2)
    fast, slow = (make_trainer(corpus, manifest, p, records, Transport(p, group), rounds=5) for p in ("fast", "slow"))
    slowed(slow, 0.03)
    slowed(fast, 0.005)
    lr_steps = []
    step = fast.inner.step

    def recorded_step(lr_step):
        lr_steps.append((fast.pos.round, fast.pos.step, lr_step))
        return step(lr_step)

    fast.inner.step = recorded_step
    run_in_threads([fast, slow])
    batch = manifest.inner_optimizer.batch_size_tokens
    fast_steps = [e["tokens"] // batch for e in fast.reporter.of("round")]
    assert [e["tokens"] // batch for e in slow.reporter.of("round")] == [H] * 5
    assert fast_steps[0] == H and max(fast_steps[1:]) > H and max(fast_steps) <= 2 * H, fast_steps
    # every extra step used the round's last lr index; the regular ones their own
    assert all(lr == r * H + min(s, H - 1) for r, s, lr in lr_steps)
    for x, y in zip(fast.phi, slow.phi):
        assert torch.equal(x, y)


def test_the_wait_budget_is_the_inner_step_time_until_the_mean_is_needed():
    from peer.progress import RoundProgress
    from peer.round.syncing import wait_budget_s

    done = RoundProgress()
    assert wait_budget_s(done, 20) == 0.0  # nothing timed yet: never past the manifest's bound
    for _ in range(10):
        done.record(loss=1.0, tokens=256, seconds=0.2)
    assert wait_budget_s(done, 20) == pytest.approx(20 * 0.2)  # delayed/eager: a round of H = 20
    assert wait_budget_s(done, 5) == pytest.approx(5 * 0.2)  # streaming: H/P steps


def test_a_prepared_outer_step_is_installed_only_for_its_mean_state_and_round():
    """``OverlapSchedule._install``: the step the sync's thread prepared replaces the landing's apply only
    when it came from this very mean, from the state the peer still holds, for the round the
    landing starts; anything else (an adoption since, a dropped sync's leftover) is applied anew."""
    import dataclasses
    import types

    from peer.round.overlapped import OverlapSchedule, PreparedStep
    from peer.state.snapshot import make_snapshot

    def snap(value, round_):
        return make_snapshot({"run_id": "r", "round": round_, "inner_step": 0}, [torch.full((2,), value)] * 2)

    held, mean = snap(1.0, 4), [torch.ones(2)]
    live = [torch.zeros(2), torch.zeros(2)]  # φ, then the outer state

    def install_all(tensors):
        live[:] = list(tensors)

    t = types.SimpleNamespace(
        state=types.SimpleNamespace(install_all=install_all, snapshots=[held], pos=types.SimpleNamespace(round=4))
    )
    ready = PreparedStep(mean=mean, base=held.digest, snapshot=snap(7.0, 5))
    for wrong in (
        None,
        dataclasses.replace(ready, mean=[torch.ones(2)]),
        dataclasses.replace(ready, base=b"x" * 16),
        dataclasses.replace(ready, snapshot=snap(7.0, 6)),
    ):
        assert OverlapSchedule._install(t, wrong, mean) is False
        assert torch.equal(live[0], torch.zeros(2)) and torch.equal(live[1], torch.zeros(2))
    assert OverlapSchedule._install(t, ready, mean) is True
    # installed as they are: the live state is the prepared snapshot's own tensors, not copies
    assert all(a is b for a, b in zip(live, ready.snapshot.tensors, strict=True))


def test_a_delayed_landing_keeps_thetas_progress_where_the_group_applied_none_of_its_delta(corpus):
    """A delayed sync whose result names kept rows (the receipts skipped their owner: the mean there is
    zeros, and nothing is carried): θ starts the next round at ψ = φ − Δ_t everywhere else, and there
    also keeps the landed round's own progress, so the next Δ holds it (peer/train/overlap.py
    ``keep_skipped_progress``)."""
    rows = ((0, 0, 2),)

    class Skipping(Transport):
        def average(self, payload, *, request):
            self.sent = getattr(self, "sent", {})
            self.sent[request.round_] = [t.clone() for t in payload]
            result = super().average(payload, request=request)
            assert not request.carry_skipped  # delayed keeps the progress in θ instead of carrying it
            if request.round_ == 0:
                result.mean[0][0:2].zero_()  # what every peer applies there: no mean, as after a skip
                return dataclasses.replace(result, kept_rows=rows)
            return result

    manifest = tiny_run().replace(sync={"overlap": "delayed"}, outer_optimizer={"lr": 0.7, "momentum": 0.0})
    records, group = Records(), Group(2)
    transports = [Skipping(p, group) for p in ("a", "b")]
    seen: dict[str, list] = {}
    trainers = []
    for p, t in zip(("a", "b"), transports):

        def on_event(event, fields, p=p):
            if event == "round" and fields["round"] == 2:  # round 1 ended: mean 0 landed, θ set
                trainer = trainers[("a", "b").index(p)]
                seen[p] = [[x.detach().float().clone() for x in trainer.params], [f.clone() for f in trainer.phi]]

        trainers.append(make_trainer(corpus, manifest, p, records, t, rounds=3, reporter=Events(on_event)))
    run_in_threads(trainers)
    assert all(torch.equal(x, y) for x, y in zip(trainers[0].phi, trainers[1].phi, strict=True))  # one φ still
    for p, transport in zip(("a", "b"), transports):
        theta, phi = seen[p]
        d0, d1 = transport.sent[0], transport.sent[1]  # Δ of rounds 0 (landed with kept rows) and 1
        assert d0[0][0:2].abs().sum() > 0  # it trained there
        # kept rows: ψ minus the landed round's own Δ (no outer step moved φ there: a zero mean, no momentum)
        torch.testing.assert_close(theta[0][0:2], phi[0][0:2] - d1[0][0:2] - d0[0][0:2])
        # elsewhere ψ = φ − Δ_1, as always with delayed
        torch.testing.assert_close(theta[0][2:], phi[0][2:] - d1[0][2:])
        for t, f, d in zip(theta[1:], phi[1:], d1[1:], strict=True):
            torch.testing.assert_close(t, f - d)
        # and the next Δ holds that progress again: round 2's payload there is over the landed Δ
        assert (transport.sent[2][0][0:2] - d0[0][0:2]).abs().sum() < transport.sent[2][0][0:2].abs().sum()
