"""lab/engine_sim.py: N real round loops in threads over the in-process transport."""

from __future__ import annotations

import math

import pytest

from lab.engine_sim import run_engine_simulation
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def test_three_peers_hold_identical_phi_after_blocking_diloco_rounds(corpus):
    manifest = tiny_run()
    assert manifest.sync.algorithm == "diloco" and manifest.sync.overlap == "none"
    seen = []
    result = run_engine_simulation(manifest, corpus, peers=3, rounds=2, on_eval=seen.append, timeout_s=240.0)
    assert len(set(result.state_digests)) == 1 and len(result.state_digests) == 3  # φ and outer state, bit for bit
    assert [h.round_ for h in result.history] == [0, 1, 2] and seen == result.history
    for h in result.history:
        assert h.sigma == 0.0 and h.replica_mean_bpb is None and math.isfinite(h.loss_bpb)
    batch = manifest.inner_optimizer.batch_size_tokens
    assert [h.tokens for h in result.history] == [
        0,
        3 * manifest.sync.inner_steps * batch,
        6 * manifest.sync.inner_steps * batch,
    ]
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb
    assert result.bytes_sent_per_peer > 0 and len(result.round_end_s) == 2 and result.train_s > 0


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_lossy_codec_runs_on_the_engine_and_the_peers_still_hold_one_phi(corpus, codec):
    """The hub encodes and decodes every contribution and mean with the run's codec, and each peer
    feeds its codec's error back (lab/inprocess.py): the group still applies one mean, so the peers
    hold one state, it trains, and it is not the uncompressed run's φ."""
    manifest = tiny_run().replace(compression={"codec": codec})
    result = run_engine_simulation(manifest, corpus, peers=3, rounds=2, timeout_s=240.0)
    plain = run_engine_simulation(tiny_run(), corpus, peers=3, rounds=2, timeout_s=240.0)
    assert len(set(result.state_digests)) == 1 and len(result.state_digests) == 3
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb
    assert result.state_digests[0] != plain.state_digests[0]
    largest, _ = _relative_differences(result.final_phis, plain.final_phis)
    assert 0 < largest < 0.1


def test_the_engine_refuses_what_it_cannot_run(corpus):
    with pytest.raises(ValueError, match="peers = 0"):
        run_engine_simulation(tiny_run(), corpus, peers=0, rounds=1)
    with pytest.raises(ValueError, match="init_seed"):
        run_engine_simulation(tiny_run(), corpus, peers=2, rounds=1, seed=tiny_run().model.init_seed + 1)
    delayed_noloco = tiny_run().replace(sync={"algorithm": "noloco", "overlap": "delayed"})
    with pytest.raises(ValueError, match=r"peers = 3 with noloco.group_size = 2 .* without a partner"):
        run_engine_simulation(delayed_noloco, corpus, peers=3, rounds=1, pinned=True)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_pinned_noloco_with_overlap_pairs_every_peer_and_trains_the_same_curve_twice(corpus, overlap):
    """NoLoCo with an overlapped sync on the engine: with the groups dividing the peers, every peer
    has a partner every round, none runs ahead of the lockstep, and two runs are bit for bit one."""
    manifest = tiny_run().replace(sync={"algorithm": "noloco", "overlap": overlap})
    runs = [run_engine_simulation(manifest, corpus, peers=4, rounds=3, pinned=True, timeout_s=240.0) for _ in range(2)]
    assert runs[0].state_digests == runs[1].state_digests and len(set(runs[0].state_digests)) == 4
    assert [h.loss_bpb for h in runs[0].history] == [h.loss_bpb for h in runs[1].history]
    assert runs[0].history[-1].loss_bpb < runs[0].history[0].loss_bpb
    assert runs[0].screening["failed_syncs"] == 0


SYNC_MODES = {
    "diloco": {"sync": {"algorithm": "diloco"}},
    "noloco": {"sync": {"algorithm": "noloco"}},
    "delayed": {"sync": {"algorithm": "diloco", "overlap": "delayed"}},
    "eager": {"sync": {"algorithm": "diloco", "overlap": "eager"}},
    "streaming": {
        "sync": {"algorithm": "diloco", "overlap": "streaming", "fragments": 2, "fragment_delay_steps": 1},
        "model": {"num_layers": 2},
    },
    "noloco-delayed": {"sync": {"algorithm": "noloco", "overlap": "delayed"}},
    "noloco-streaming": {
        "sync": {"algorithm": "noloco", "overlap": "streaming", "fragments": 2, "fragment_delay_steps": 1},
        "model": {"num_layers": 2},
    },
}
"""Sync modes as changes to the tiny preset: blocking DiLoCo and NoLoCo, DiLoCo's and NoLoCo's
overlapped rounds, and Streaming DiLoCo and NoLoCo with P = 2 fragments (offsets 0 and 2 of H = 5;
two blocks, since a fragment holds whole blocks) and τ = 1 (τ·P < H). With 4 peers every NoLoCo peer
has a partner every round."""


def _relative_differences(a: list[list], b: list[list]) -> tuple[float, float]:
    """Over the peers (φ of peer i in ``a`` against ``b``): the largest max |Δφ| / ‖φ‖ and the largest
    ‖Δφ‖ / ‖φ‖ (‖·‖ the 2-norm over all of a peer's tensors)."""
    worst_max = worst_norm = 0.0
    for phi_a, phi_b in zip(a, b, strict=True):
        norm = math.sqrt(sum(float(y.double().pow(2).sum()) for y in phi_b))
        diff = [(x.double() - y.double()) for x, y in zip(phi_a, phi_b, strict=True)]
        worst_max = max(worst_max, max(float(d.abs().max()) for d in diff) / norm)
        worst_norm = max(worst_norm, math.sqrt(sum(float(d.pow(2).sum()) for d in diff)) / norm)
    return worst_max, worst_norm


@pytest.mark.parametrize("mode", list(SYNC_MODES))
def test_every_sync_mode_trains_on_the_engine_at_equal_tokens(corpus, mode):
    """bench/compare.py and bench/overlap.py run every sync mode on the engine, pinned (lab/engine_sim.py
    ``pinned=True``, peer/round/timing.py: no extra steps past H while a sync is out, a streaming
    fragment landing exactly τ steps after its start). Each mode trains the same tokens round by
    round, the loss falls, and DiLoCo's peers end on one state (NoLoCo's replicas differ by design);
    nothing honest is refused and no sync fails."""
    manifest = tiny_run().replace(**SYNC_MODES[mode])
    result = run_engine_simulation(manifest, corpus, peers=4, rounds=3, timeout_s=240.0, pinned=True)
    batch = manifest.inner_optimizer.batch_size_tokens
    assert [h.round_ for h in result.history] == [0, 1, 2, 3]
    assert [h.tokens for h in result.history] == [r * 4 * manifest.sync.inner_steps * batch for r in range(4)]
    assert all(math.isfinite(h.loss_bpb) for h in result.history)
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb - 0.2
    assert result.screening["failed_syncs"] == result.screening["rounds_with_refused_means"] == 0
    assert result.screening["rounds_with_refused_steps"] == 0
    if manifest.sync.algorithm == "diloco":
        assert len(set(result.state_digests)) == 1 and result.history[-1].sigma == 0.0
    else:
        assert len(set(result.state_digests)) == 4 and result.history[-1].sigma > 0.0


def test_a_lossy_codec_streams_fragments_on_the_engine_and_the_peers_hold_one_phi(corpus):
    """int8 with error feedback per fragment (each fragment's sync compensates and stages the residuals
    of its own tensors): the peers still land one mean per fragment, and the loss falls."""
    manifest = tiny_run().replace(**SYNC_MODES["streaming"]).replace(compression={"codec": "int8"})
    result = run_engine_simulation(manifest, corpus, peers=2, rounds=3, timeout_s=240.0, pinned=True)
    assert len(set(result.state_digests)) == 1 and result.screening["failed_syncs"] == 0
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb - 0.2


def test_noloco_evaluates_each_replica_at_its_phi(corpus):
    """NoLoCo's headline loss is the mean of each replica's own loss, of its φ, not of θ: with delayed
    overlap, round 1's mean is still in flight after round 1, so φ, and its loss, are still round 0's
    (θ has moved on to ψ = φ + Δ)."""
    manifest = tiny_run().replace(sync={"algorithm": "noloco", "overlap": "delayed"})
    result = run_engine_simulation(manifest, corpus, peers=4, rounds=2, timeout_s=240.0, pinned=True)
    first, after_one, last = result.history
    assert after_one.replica_mean_bpb == after_one.loss_bpb == first.loss_bpb
    assert last.loss_bpb < first.loss_bpb
