"""The round loop with sync.overlap = "streaming" (Streaming DiLoCo, arXiv 2501.18512;
peer/round/streamed.py, peer/train/streaming.py): two real Trainers in threads over the in-memory transport
of test_round_overlap.py, each fragment's sync keyed and carried on its own."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from peer.state.checkpoint import load_checkpoint
from peer.train.streaming import partition
from protocol.errors import GroupNotFound
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import (
    Events,
    Group,
    Records,
    Transport,
    check_averager_death,
    die_with_the_averager,
    make_trainer,
    run_in_threads,
)

H = 10


def streaming(fragments=2, tau=1, alpha=0.5, **sync):
    return tiny_run().replace(
        model={"num_layers": 2},
        sync={
            "overlap": "streaming",
            "inner_steps": H,
            "fragments": fragments,
            "fragment_delay_steps": tau,
            "fragment_alpha": alpha,
            **sync,
        },
    )


FragmentTransport = Transport
"""The in-process transport (lab/inprocess.py) keys a group per (round, fragment), as the
network does (protocol/keys.py ``sync_index``), and records what each call carried."""


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_two_peers_stream_fragments_and_hold_identical_phi(corpus, algorithm):
    manifest = streaming(algorithm=algorithm)
    records, group = Records(), Group(2)
    trainers = [make_trainer(corpus, manifest, p, records, FragmentTransport(p, group), rounds=3) for p in ("a", "b")]
    phi0 = [f.clone() for f in trainers[0].phi]
    run_in_threads(trainers)
    a, b = trainers
    for x, y in zip(a.phi, b.phi):
        assert torch.isfinite(x).all() and torch.equal(x, y)
    assert a.state_digest == b.state_digest
    fragments = partition(a.names, 2)
    n = len(a.phi)
    for t in trainers:
        calls = t.transport.carried
        # fragment 1 (offset H/2) mid-round, fragment 0 at the round's end; at the last round's end
        # fragment 1 syncs once more so the final φ holds every step
        assert [(r, f) for r, f, *_ in calls] == [(0, 1), (0, 0), (1, 1), (1, 0), (2, 1), (2, 0), (3, 1)]
        for _, f, shapes, tensors, thread in calls:
            want = fragments[f] if algorithm == "diloco" else [*fragments[f], *(n + k for k in fragments[f])]
            assert tensors == want  # its own tensors, nothing else
            assert shapes == [tuple(t.phi[k % n].shape) for k in want]
            assert thread.startswith("locoswarm-sync")  # in the background
        assert [(e["round"], e["fragment"]) for e in t.reporter.of("sync")] == [(r, f) for r, f, *_ in calls]
        rounds = t.reporter.of("round")
        assert [e["round"] for e in rounds] == [1, 2, 3]
        assert all(e["group_size"] == 2 for e in rounds)  # round 1 already reports fragment 1's sync
        # each mean landed τ = 1 step after its sync started or later (a slower one postponed the next
        # fragment's start rather than the inner loop waiting: at most the round and its extra steps)
        assert all(1 <= s <= 2 * H for e in rounds for s in e["overlap_steps"])
        assert all(torch.equal(p.detach(), f) for p, f in zip(t.params, t.phi))  # θ ← φ at the end
        assert t.summary.final_eval_loss < t.summary.initial_eval_loss
    assert any(not torch.equal(x, y) for x, y in zip(a.phi, phi0))


def test_one_fragment_streams_a_one_block_model_its_mean_landing_tau_steps_into_the_next_round(corpus):
    """P = 1 with τ > 0 (the tiny preset's single block, which P = 2 cannot split): the whole model's
    sync starts at each round's end and its mean lands τ or more inner steps into the next round,
    shifted onto θ with α = 0 (θ ← θ + φ − θ^sync); the peers hold identical φ after every round."""
    tau = 3
    manifest = tiny_run().replace(
        sync={
            "overlap": "streaming",
            "inner_steps": H,
            "fragments": 1,
            "fragment_delay_steps": tau,
            "fragment_alpha": 0.0,
            "fragment_merge": "shift",
        }
    )
    assert manifest.model.num_layers == 1
    records, group = Records(), Group(2)
    trainers = [make_trainer(corpus, manifest, p, records, FragmentTransport(p, group), rounds=3) for p in ("a", "b")]
    phi0 = [f.clone() for f in trainers[0].phi]
    run_in_threads(trainers)
    a, b = trainers
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi)) and a.state_digest == b.state_digest
    for t in trainers:
        # one sync a round, at its end, of every tensor; the last one lands before the run ends
        assert [(r, f, tensors) for r, f, _, tensors, _ in t.transport.carried] == [
            (r, 0, list(range(len(t.phi)))) for r in range(3)
        ]
        rounds = t.reporter.of("round")
        landed = [s for e in rounds for s in e.get("overlap_steps", ())]
        assert len(landed) == 2 and all(tau <= s <= 2 * H for s in landed)  # rounds 0 and 1's, in rounds 1, 2
        assert all(torch.equal(p.detach(), f) for p, f in zip(t.params, t.phi))  # θ ← φ at the end
        assert t.summary.final_eval_loss < t.summary.initial_eval_loss
    assert any(not torch.equal(x, y) for x, y in zip(a.phi, phi0))


def test_one_fragment_without_delay_or_merge_is_diloco_without_overlap(corpus):
    """P = 1, τ = 0, α = 0: Streaming DiLoCo's rules reduce to DiLoCo's round (θ ← φ after each
    outer step), bit for bit, on the same data and peers."""
    results = []
    for manifest in (
        streaming(fragments=1, tau=0, alpha=0.0),
        tiny_run().replace(model={"num_layers": 2}, sync={"inner_steps": H}),
    ):
        records, group = Records(), Group(2)
        trainers = [
            make_trainer(corpus, manifest, p, records, FragmentTransport(p, group), rounds=3) for p in ("a", "b")
        ]
        run_in_threads(trainers)
        results.append(trainers[0])
    stream, plain = results
    assert [(r, f) for r, f, *_ in stream.transport.carried] == [(0, 0), (1, 0), (2, 0)]
    for x, y in zip(stream.phi, plain.phi):
        assert torch.equal(x, y)
    assert [e["train_loss"] for e in stream.reporter.of("round")] == [
        e["train_loss"] for e in plain.reporter.of("round")
    ]


def test_a_fragment_sync_in_flight_is_dropped_by_a_stop_and_the_checkpoint_holds_the_last_landed_phi(corpus, tmp_path):
    manifest = streaming()
    path = tmp_path / "checkpoint.safetensors"
    stop, hung = threading.Event(), threading.Event()

    def hang(round_, should_stop):  # the groupmate never answers: fragment 1's first sync stays in flight
        hung.set()
        while not should_stop():
            time.sleep(0.02)
        raise GroupNotFound(f"round {round_} sync cancelled by shutdown")

    t = make_trainer(
        corpus,
        manifest,
        "a",
        Records(ghosts=("ghost",)),
        FragmentTransport("a", None, fail=hang),
        rounds=5,
        checkpoint=path,
        stop=stop,
    )
    phi0 = [f.clone() for f in t.phi]
    runner = threading.Thread(target=t.run)
    runner.start()
    assert hung.wait(60)
    stop.set()  # as a SIGINT while fragment 1's sync waits for its group
    runner.join(60)
    assert not runner.is_alive() and t.summary.interrupted
    t.save()
    saved = load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes)
    for a, b in zip(saved.phi, phi0):  # nothing landed: φ is the initial one
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(saved.theta, phi0))  # θ holds the steps trained

    # the restart resumes mid-round with nothing in flight, trains alone and lands its own steps
    again = make_trainer(
        corpus, manifest, "a", Records(), FragmentTransport("a", None), rounds=2, checkpoint=path, reporter=Events()
    )
    again.run()
    assert again.reporter.of("resumed")[0]["round"] == saved.round
    assert again.transport.carried == []  # alone: no sync went to the network
    assert all(torch.isfinite(f).all() for f in again.phi)
    assert any(not torch.equal(a, b) for a, b in zip(again.phi, phi0))


def test_an_averager_that_dies_during_a_fragment_sync_stops_the_loop_at_its_landing(corpus, tmp_path):
    """The first fragment sync (fragment 1's, at step H/P) fails in its thread; its landing, τ steps
    later, finds the averager dead."""
    manifest = streaming(tau=2)
    check_averager_death(
        corpus,
        manifest,
        tmp_path / "checkpoint.safetensors",
        FragmentTransport("a", None, fail=die_with_the_averager),
        FragmentTransport("a", None),
        expected=(0, H // 2 + 2),
    )


def test_a_fragment_sync_slower_than_tau_lands_when_it_arrives_and_phi_stays_identical(corpus):
    """τ is the earliest a mean lands: a sync that takes longer lands at the first step its mean is
    there; the next fragment's start is postponed to that step and the round trains on past H while
    one is in flight (the inner loop waits only once its extra steps are used up); the groupmates
    still hold the same φ."""
    manifest = streaming(tau=1)
    records, group = Records(), Group(2)

    def slow(round_, should_stop):
        time.sleep(0.5)  # a slow uplink: many inner steps of the tiny model

    trainers = [
        make_trainer(corpus, manifest, p, records, FragmentTransport(p, group, fail=slow), rounds=2) for p in ("a", "b")
    ]
    run_in_threads(trainers)
    a, b = trainers
    for x, y in zip(a.phi, b.phi):
        assert torch.equal(x, y)
    for t in trainers:
        rounds = t.reporter.of("round")
        overlaps = [s for e in rounds for s in e["overlap_steps"]]
        # a landing forced at a round's end, its extra steps used up, may have had none
        assert overlaps and all(0 <= s <= 2 * H for s in overlaps)
        assert max(overlaps) > H // 2  # it trained on past the next fragment's offset instead of waiting
        tokens_per_step = t.m.inner_optimizer.batch_size_tokens
        assert max(e["tokens"] for e in rounds) > H * tokens_per_step  # and past H while a sync was in flight


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_each_landing_is_prepared_by_the_syncs_thread_and_the_rounds_snapshot_is_the_one_made_afresh(
    corpus, algorithm, monkeypatch
):
    """The sync's thread steps and seals each fragment (StreamingSchedule.prepare_fragment), the
    landing copies it in, and the round's end snapshots from the sealed tensors (make_snapshot_from):
    every such snapshot has the digest of one made from φ and the outer state afresh."""
    from peer.round.state import RoundState
    from peer.round.streamed import StreamingSchedule
    from peer.state.snapshot import make_snapshot

    prepared_on, installed, derived = [], [], []
    prepare, install = StreamingSchedule.prepare_fragment, StreamingSchedule.install_fragment
    take = RoundState.take_snapshot

    def spy_prepare(self, p, base, mean):
        prepared_on.append(threading.current_thread().name)
        return prepare(self, p, base, mean)

    def spy_install(self, prepared, p, mean):
        installed.append(install(self, prepared, p, mean))
        return installed[-1]

    def spy_take(self, *, from_sealed=False):
        take(self, from_sealed=from_sealed)
        if from_sealed:
            fresh = make_snapshot(self.snapshots[-1].meta, [*self.phi, *self.outer.state_tensors()])
            derived.append(fresh.digest == self.snapshots[-1].digest)

    monkeypatch.setattr(StreamingSchedule, "prepare_fragment", spy_prepare)
    monkeypatch.setattr(StreamingSchedule, "install_fragment", spy_install)
    monkeypatch.setattr(RoundState, "take_snapshot", spy_take)
    records, group = Records(), Group(2)
    trainers = [
        make_trainer(corpus, streaming(algorithm=algorithm), p, records, FragmentTransport(p, group), rounds=3)
        for p in ("a", "b")
    ]
    run_in_threads(trainers)
    a, b = trainers
    assert a.state_digest == b.state_digest and all(torch.equal(x, y) for x, y in zip(a.phi, b.phi))
    assert len(derived) == 2 * 3 and all(derived)  # every round's end, on both peers
    assert len(installed) == 2 * 7 and all(installed)  # every landing installed its prepared step
    assert all(name.startswith("locoswarm-sync") for name in prepared_on)


def test_a_landing_without_a_prepared_step_applies_the_mean_and_seals_it_itself(corpus, monkeypatch):
    """When the sync's thread prepared nothing (here: it is made to), each landing applies the mean
    and seals the fragment on the round loop's thread: φ and every snapshot are bit-identical to a
    run whose steps were prepared (τ = 0: each mean lands at its sync's step, so both runs train
    the same steps)."""
    from peer.round.state import RoundState
    from peer.round.streamed import StreamingSchedule
    from peer.state.snapshot import make_snapshot

    runs, digests = {}, {True: [], False: []}
    take = RoundState.take_snapshot
    for prepared in (True, False):

        def spy_take(self, *, from_sealed=False, prepared=prepared):
            take(self, from_sealed=from_sealed)
            last = self.snapshots[-1]
            assert make_snapshot(last.meta, [*self.phi, *self.outer.state_tensors()]).digest == last.digest
            digests[prepared].append((id(self), last.digest))

        monkeypatch.setattr(RoundState, "take_snapshot", spy_take)
        if not prepared:
            monkeypatch.setattr(StreamingSchedule, "prepare_fragment", lambda self, p, base, mean: None)
        records, group = Records(), Group(2)
        trainers = [
            make_trainer(corpus, streaming(tau=0), p, records, FragmentTransport(p, group), rounds=3)
            for p in ("a", "b")
        ]
        run_in_threads(trainers)
        runs[prepared] = trainers
    for with_prep, without in zip(runs[True], runs[False]):
        assert all(torch.equal(x, y) for x, y in zip(with_prep.phi, without.phi))
    for with_prep, without in zip(runs[True], runs[False]):
        assert [d for s, d in digests[True] if s == id(with_prep.state)] == [
            d for s, d in digests[False] if s == id(without.state)
        ]


def test_a_checkpoint_after_a_landing_holds_the_landed_phi_and_one_at_the_rounds_end_the_snapshots(
    corpus, tmp_path, monkeypatch
):
    """The checkpoint takes φ and the outer state from the round's snapshot only while no landing
    changed them since (Checkpointing.save): a save right after a mid-round landing holds the landed
    φ, and one right after the round's end holds the snapshot's, which is then the same φ."""
    from peer.round import Trainer
    from peer.round.streamed import StreamingSchedule

    checked, trainer_of = [], {}
    land, after = StreamingSchedule.land_fragment, Trainer._after_round

    def check_save(self, when):
        path = tmp_path / self.peer_id / f"{self.peer_id}.safetensors"
        self.save()
        saved = load_checkpoint(path, run_id=self.m.run_id, names=self.names, shapes=self.shapes)
        checked.append(
            (
                when,
                all(torch.equal(a, b) for a, b in zip(saved.phi, self.phi))
                and all(torch.equal(a, b) for a, b in zip(saved.momentum, self.outer.state_tensors())),
            )
        )

    def land_then_save(self):
        land(self)
        if self.state.sealed and self.state.pos.step > 0:  # a landing inside a round changed φ since the snapshot
            check_save(trainer_of[id(self)], "landing")

    def after_then_save(self, outcome):
        check_save(self, "round's end")
        after(self, outcome)

    monkeypatch.setattr(StreamingSchedule, "land_fragment", land_then_save)
    monkeypatch.setattr(Trainer, "_after_round", after_then_save)
    records, group = Records(), Group(2)
    trainers = [
        make_trainer(
            corpus,
            streaming(),
            p,
            records,
            FragmentTransport(p, group),
            rounds=2,
            checkpoint=tmp_path / p / f"{p}.safetensors",
        )
        for p in ("a", "b")
    ]  # a directory each, as peers have
    trainer_of.update((id(t.schedule), t) for t in trainers)
    run_in_threads(trainers)
    assert {when for when, _ in checked} == {"landing", "round's end"}
    assert all(ok for _, ok in checked)


def test_shift_lands_each_mean_relative_to_theta_at_its_sync_and_keeps_the_steps_since(corpus, monkeypatch):
    """``sync.fragment_merge = "shift"``: each landing moves θ_p by (1 − α)·(φ_p − θ_p^sync), θ_p^sync
    a copy taken when the fragment's sync started, so the steps trained while it was in flight stay
    in θ_p; the groupmates still hold identical φ. A slow sync makes those steps many."""
    import peer.round.streamed as round_module

    landings, real_land = [], round_module.land

    def spy_land(theta, phi, *, alpha, rule, at_sync, **kept):
        before = [t.detach().clone() for t in theta]
        real_land(theta, phi, alpha=alpha, rule=rule, at_sync=at_sync, **kept)
        landings.append(
            (
                rule,
                alpha,
                before,
                [p.clone() for p in phi],
                None if at_sync is None else [s.clone() for s in at_sync],
                [t.detach().clone() for t in theta],
            )
        )

    def slow(round_, should_stop):
        time.sleep(0.3)

    monkeypatch.setattr(round_module, "land", spy_land)
    records, group = Records(), Group(2)
    trainers = [
        make_trainer(
            corpus,
            streaming(tau=1, fragment_merge="shift"),
            p,
            records,
            FragmentTransport(p, group, fail=slow),
            rounds=2,
        )
        for p in ("a", "b")
    ]
    run_in_threads(trainers)
    a, b = trainers
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi)) and a.state_digest == b.state_digest
    # per peer: fragments 1, 0 of rounds 0 and 1, and the final 1 when fragment 1 has steps left (none
    # when its postponed start came at the last round's end)
    assert 2 * 4 <= len(landings) <= 2 * 5
    stepped = 0
    for rule, alpha, before, phi, at_sync, after in landings:
        assert rule == "shift" and alpha == 0.5 and at_sync is not None
        for t0, p, s, t1 in zip(before, phi, at_sync, after, strict=True):
            torch.testing.assert_close(t1, t0 + 0.5 * (p - s))
        stepped += any(not torch.equal(t0, s) for t0, s in zip(before, at_sync))
    assert stepped >= 4  # steps trained between the sync and its landing were kept
    assert a.summary.final_eval_loss < a.summary.initial_eval_loss


def test_an_adopted_state_keeps_fragment_0s_sync_and_shifts_from_the_adopted_phi(corpus):
    """A peer that adopts the swarm's state of round k+1 keeps fragment 0's sync of round k in flight
    (its groupmates land that mean on exactly this φ); with 'shift' that landing is then relative to
    the adopted φ_p, where θ_p restarted, not to the θ_p the sync started from. Any other sync in
    flight is dropped, and its θ_p^sync with it."""
    from types import SimpleNamespace

    from peer.state.download import DownloadedState

    t = make_trainer(
        corpus, streaming(tau=1, fragment_merge="shift"), "a", Records(), FragmentTransport("a", None), rounds=2
    )
    dropped = []
    t.schedule.background = SimpleNamespace(in_flight=True, round=0, drop=dropped.append)
    index = t.schedule.fragments[0]
    stale = [torch.full_like(t.phi[k], 7.0) for k in index]
    g = torch.Generator().manual_seed(3)
    state = DownloadedState(
        round=1,
        inner_step=H,
        phi=[torch.randn(f.shape, generator=g) for f in t.phi],
        outer_state=[s.clone() for s in t.outer.state_tensors()],
    )
    t.schedule.flight = (0, H, stale)
    t.catchup.adopt(state)
    assert t.schedule.adopted_in_flight and not dropped
    p, started, at_sync = t.schedule.flight
    assert (p, started) == (0, H)
    assert all(torch.equal(s, state.phi[k]) for s, k in zip(at_sync, index, strict=True))
    assert all(torch.equal(q.detach(), f) for q, f in zip(t.params, state.phi))  # θ restarted at the adopted φ

    t.schedule.adopted_in_flight = False
    t.schedule.flight = (1, H // 2, stale)  # fragment 1's sync is part of round 1's state already: dropped
    t.catchup.adopt(state)
    assert dropped and t.schedule.flight is None and not t.schedule.adopted_in_flight


def test_an_adopted_download_becomes_the_snapshot_without_a_copy_or_a_second_hashing(corpus):
    """The state's tensors and the hashes its download verified are the snapshot's own and the live
    state's (φ is never written in place, so the snapshot needs no copy of it): the digest is the one
    hashing the live state afresh gives; a state without hashes is hashed, still not copied."""
    import dataclasses

    from peer.state.download import DownloadedState
    from peer.state.snapshot import make_snapshot

    t = make_trainer(corpus, streaming(tau=1), "a", Records(), FragmentTransport("a", None), rounds=2)
    g = torch.Generator().manual_seed(5)
    phi = [torch.randn(f.shape, generator=g) for f in t.phi]
    outer = [torch.randn(s.shape, generator=g) for s in t.outer.state_tensors()]
    meta = {"run_id": t.state.state_key, "round": 1, "inner_step": H}
    hashes = make_snapshot(meta, [*phi, *outer]).chunk_hashes
    state = DownloadedState(round=1, inner_step=H, phi=phi, outer_state=outer, chunk_hashes=hashes)
    t.catchup.adopt(state)
    snap = t.state.snapshots[-1]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(snap.tensors, [*phi, *outer], strict=True))
    assert snap.digest == make_snapshot(meta, t.state.live_tensors()).digest
    assert all(a is b for a, b in zip(t.state.live_tensors(), snap.tensors, strict=True))

    plain = dataclasses.replace(state, round=2, inner_step=2 * H, chunk_hashes=None)
    t.catchup.adopt(plain)
    snap = t.state.snapshots[-1]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(snap.tensors, [*phi, *outer], strict=True))
    assert all(a is b for a, b in zip(t.state.live_tensors(), snap.tensors, strict=True))
    assert snap.digest == make_snapshot({**meta, "round": 2, "inner_step": 2 * H}, [*phi, *outer]).digest


def test_own_delta_keeps_only_its_norm_once_settled():
    """A sync's own Δ is held as its tensors only until the mean is there: ``settle`` gives the
    norm ``check_step_bound`` takes (inf when a value is not finite) and lets go of the tensors."""
    import gc
    import weakref

    from peer.round.schedule import OwnDelta
    from peer.train.step_bound import global_norm

    delta = [torch.randn(4, 3), torch.randn(5)]
    expected = global_norm(delta)
    gone = weakref.ref(delta[0])
    own = OwnDelta(delta, 2.0)
    del delta
    assert own.settle() == expected and own.scale == 2.0
    gc.collect()
    assert gone() is None
    assert own.settle() == expected
    assert OwnDelta([torch.tensor([1.0, float("nan")])], 1.0).settle() == float("inf")


def test_a_blocking_landing_keeps_its_new_outer_momentum_in_the_means_own_tensors(corpus):
    """The blocking schedule's landing makes one model-sized set of new tensors, the new φ: the
    group's mean (the transport's own copy) becomes the new outer momentum, and both peers still
    hold identical φ and momentum, finite, that moved."""

    class Recording(FragmentTransport):
        def average(self, payload, **kwargs):
            result = super().average(payload, **kwargs)
            self.means.append(result.mean)
            return result

    manifest = tiny_run().replace(model={"num_layers": 2}, sync={"overlap": "none", "inner_steps": H})
    records, group = Records(), Group(2)
    transports = [Recording(p, group) for p in ("a", "b")]
    for transport in transports:
        transport.means = []
    trainers = [make_trainer(corpus, manifest, p, records, t, rounds=2) for p, t in zip(("a", "b"), transports)]
    run_in_threads(trainers)
    (a, b), n = trainers, len(trainers[0].phi)
    for trainer, transport in zip(trainers, transports):
        momentum = trainer.state.live_tensors()[n:]
        assert len(transport.means) == 2
        # the same memory: the snapshot holds the tensors it seals as they are (a detached alias)
        assert [m.data_ptr() for m in momentum] == [d.data_ptr() for d in transport.means[-1]]
    for x, y in zip(a.state.live_tensors(), b.state.live_tensors(), strict=True):
        assert torch.isfinite(x).all() and torch.equal(x, y)
    assert any(bool(m.abs().sum() > 0) for m in a.state.live_tensors()[n:])


def test_a_blocking_landing_keeps_thetas_progress_where_the_group_applied_none_of_its_delta(corpus):
    """A blocking sync whose result names kept rows (the receipts skipped their owner: the mean there
    is zeros): the landing sets θ to the new φ everywhere else, and there keeps this peer's own
    progress, θ = φ − Δ, so its next Δ holds it (peer/train/streaming.py ``land``)."""
    rows = ((0, 0, 2),)

    class Skipping(FragmentTransport):
        def average(self, payload, **kwargs):
            self.sent = [t.clone() for t in payload]
            result = super().average(payload, **kwargs)
            result.mean[0][0:2].zero_()  # what every peer applies there: no mean, as after a skip
            return dataclasses.replace(result, kept_rows=rows)

    manifest = tiny_run().replace(model={"num_layers": 2}, sync={"overlap": "none", "inner_steps": H})
    records, group = Records(), Group(2)
    transports = [Skipping(p, group) for p in ("a", "b")]
    trainers = [make_trainer(corpus, manifest, p, records, t, rounds=1) for p, t in zip(("a", "b"), transports)]
    run_in_threads(trainers)
    a, b = trainers
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi, strict=True))  # one φ still
    for trainer, transport in zip(trainers, transports):
        theta = [p.detach().float() for p in trainer.params]
        kept = theta[0][0:2]
        assert transport.sent[0][0:2].abs().sum() > 0  # it trained there
        # θ there is this round's progress on top of the new φ (its outer step moved φ by momentum 0)
        torch.testing.assert_close(trainer.phi[0][0:2] - kept, transport.sent[0][0:2])
        assert torch.equal(theta[0][2:], trainer.phi[0][2:])
        assert all(torch.equal(t, f) for t, f in zip(theta[1:], trainer.phi[1:], strict=True))
