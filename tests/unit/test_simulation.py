"""The in-process transport: same algorithm code as the swarm, metrics and bytes accounting."""

import math

import pytest
import torch

from lab.simulation import (
    Simulation,
    bits_per_byte,
    butterfly_bytes,
    run_simulation,
    sync_groups,
    weight_spread,
    weighted_mean,
)
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)


def manifest(algorithm: str, **sync):
    return tiny_run().replace(sync={"algorithm": algorithm, **sync})


def test_diloco_replicas_hold_identical_phi_after_a_round(corpus):
    sim = Simulation(manifest("diloco"), corpus, peers=2, seed=0)
    phi0 = [p.clone() for p in sim.phis[0]]
    sim.run_round()
    for a, b in zip(sim.phis[0], sim.phis[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(sim.phis[0], phi0))
    for model, phi in zip(sim.models, sim.phis):  # θ ← φ after the outer step
        for t, p in zip(model.parameters(), phi):
            assert torch.equal(t.detach(), p)


def test_diloco_round_applies_nesterov_to_the_mean_pseudo_gradient(corpus):
    # First round from zero momentum: m = Δ̄, φ_1 = φ_0 − lr·(Δ̄ + μ·Δ̄) (DiLoCo Alg. 1, Nesterov SGD).
    m = manifest("diloco").replace(outer_optimizer={"lr": 0.7, "momentum": 0.9, "nesterov": True})
    sim = Simulation(m, corpus, peers=2, seed=3)
    phi0 = [p.clone() for p in sim.phis[0]]
    H = m.sync.inner_steps
    for inner in sim.inners:
        for k in range(H):
            inner.step(k)
    thetas = [[p.detach().clone() for p in model.parameters()] for model in sim.models]
    sim._outer_step([1, 1])  # the inner steps are done above: run only the outer step
    lr, mu = m.outer_optimizer.lr, m.outer_optimizer.momentum
    for i, p0 in enumerate(phi0):
        mean_delta = p0 - (thetas[0][i] + thetas[1][i]) / 2
        torch.testing.assert_close(sim.phis[0][i], p0 - lr * (1 + mu) * mean_delta, rtol=1e-5, atol=1e-6)


def test_outer_lr_one_without_momentum_is_plain_training(corpus):
    # DiLoCo with one peer, lr 1, no momentum sets φ ← θ each round: the same trajectory as
    # data-parallel with one peer, provided AdamW state and the lr schedule carry across rounds.
    # φ − 1.0·(φ − θ) is θ only up to rounding, and AdamW amplifies ulps over later rounds, so
    # each round starts both runs from the same weights (b copies a's φ) and the comparison is
    # of one round: the inner steps are then the same operations on the same values (bit-equal
    # θ, AdamW state and lr carried), and φ differs from θ by the outer step's two roundings,
    # each at most half an fp32 ulp of the values involved (|φ_start| and |θ|).
    import copy

    from lab.data_parallel import ConcatSampler, peer_samplers
    from peer.train.inner import InnerLoop

    m = manifest("diloco").replace(outer_optimizer={"lr": 1.0, "momentum": 0.0})
    a = Simulation(m, corpus, peers=1, seed=1)
    model = copy.deepcopy(a.models[0])  # data-parallel with one peer: one model on that peer's batches
    b = InnerLoop(model, m.inner_optimizer, ConcatSampler(peer_samplers(m, corpus, 1, seed=1)))
    eps, H = torch.finfo(torch.float32).eps, m.sync.inner_steps
    for r in range(3):
        with torch.no_grad():
            for x, y in zip(a.models[0].parameters(), model.parameters()):
                y.copy_(x)
        start = [p.detach().clone() for p in a.phis[0]]
        a.run_round()
        for k in range(H):
            b.step(r * H + k)  # the lr schedule carries across rounds
        for x, y, p0 in zip(a.models[0].parameters(), model.parameters(), start):
            bound = eps * (p0.abs() + y.abs())
            assert ((x - y).abs() <= bound).all(), f"max |φ − θ| {(x - y).abs().max():.3g} over the rounding bound"
        assert a.inner_step == (r + 1) * H


def test_independent_replicas_spread_more_than_noloco(corpus):
    spreads = {}
    for algorithm in ("noloco", "independent", "diloco"):
        result = run_simulation(manifest(algorithm), corpus, peers=4, rounds=3, seed=0, eval_every_rounds=3)
        spreads[algorithm] = result.history[-1].sigma
        assert result.history[-1].loss_bpb < result.history[0].loss_bpb  # the loss fell
    assert spreads["diloco"] == 0.0
    assert 0.0 < spreads["noloco"] < spreads["independent"]


def test_noloco_groups_are_pairs_with_changing_partners():
    m = manifest("noloco")
    partners = {i: set() for i in range(8)}
    for round_ in range(20):
        groups = sync_groups(m, 8, round_)
        members = sorted(i for g in groups for i in g)
        assert members == list(range(8))  # every peer in exactly one group
        for group in groups:
            assert len(group) == 2 and group[0] != group[1]
            partners[group[0]].add(group[1])
            partners[group[1]].add(group[0])
    assert all(len(p) >= 3 for p in partners.values()), partners
    assert sync_groups(manifest("diloco"), 8, 0) == [list(range(8))]
    assert sync_groups(manifest("independent"), 3, 0) == [[0], [1], [2]]


def test_bytes_sent_match_the_butterfly_formula(corpus):
    rounds, N = 2, 4
    sent = {}
    for algorithm in ("diloco", "noloco", "independent"):
        sent[algorithm] = run_simulation(
            manifest(algorithm), corpus, peers=N, rounds=rounds, eval_every_rounds=rounds
        ).bytes_sent_per_peer
    from lab.data_parallel import run_data_parallel

    dp = run_data_parallel(manifest("diloco"), corpus, peers=N, rounds=rounds, eval_every_rounds=rounds)
    P, H = dp.parameters, dp.inner_steps
    assert sent["diloco"] == pytest.approx(rounds * 2 * (N - 1) / N * 4 * P)
    assert sent["noloco"] == pytest.approx(rounds * 2 * (2 - 1) / 2 * 4 * (2 * P))
    assert sent["independent"] == 0.0
    assert dp.bytes_sent_per_peer == pytest.approx(rounds * H * 2 * (N - 1) / N * 4 * P)


def test_butterfly_bytes_and_bits_per_byte():
    assert butterfly_bytes(1000, 1) == 0.0
    assert butterfly_bytes(1000, 2) == 4000.0
    assert butterfly_bytes(1000, 8) == pytest.approx(2 * 7 / 8 * 4000)
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="group_size = 0"):
        butterfly_bytes(10, 0)


def test_weighted_mean_and_spread_against_hand_computation():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    b = [torch.tensor([3.0, 6.0]), torch.tensor([[4.0]])]
    mean = weighted_mean([a, b], [1.0, 3.0])
    torch.testing.assert_close(mean[0], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(mean[1], torch.tensor([[3.0]]))
    # φ̄ = ([2, 4], [2]); Σ‖φ_i − φ̄‖² = 2·(1 + 4 + 4) = 18; N·P = 2·3.
    assert weight_spread([a, b]) == pytest.approx(math.sqrt(18 / 6))
    assert weight_spread([a, a]) == 0.0


def compressed(algorithm: str, **compression):
    return manifest(algorithm).replace(compression=compression)


def test_compressed_round_is_the_codec_mean_of_error_compensated_deltas(corpus):
    # Reference from the codec API: each peer but tensor i's owner (peer i mod n, whose own Δ
    # stays exact) sends decode(encode(Δ_j)); the owner sends the token-weighted fp32 mean
    # through for_mean(n); every peer applies that identical tensor.
    from protocol.codecs import decode, make_codec

    m = compressed("diloco", codec="int4", block_size=16)
    sim = Simulation(m, corpus, peers=3, seed=2)
    phi0 = [p.clone() for p in sim.phis[0]]
    for inner in sim.inners:
        for k in range(m.sync.inner_steps):
            inner.step(k)
    thetas = [[p.detach().clone() for p in model.parameters()] for model in sim.models]
    sim._outer_step([1, 1, 1])
    lr, mu = m.outer_optimizer.lr, m.outer_optimizer.momentum
    for i, p0 in enumerate(phi0):
        codec = make_codec(m.compression, p0.shape)
        deltas = [p0 - theta[i] for theta in thetas]
        sent = [
            d if j == i % 3 else decode(codec.encode(d, seed=i), tuple(p0.shape), seed=i) for j, d in enumerate(deltas)
        ]
        mean = sum(sent) / 3
        mean = decode(codec.for_mean(3).encode(mean, seed=i), tuple(p0.shape), seed=i)
        torch.testing.assert_close(sim.phis[0][i], p0 - lr * (1 + mu) * mean, rtol=1e-5, atol=1e-6)
        for j in range(3):
            assert torch.equal(sim.phis[j][i], sim.phis[0][i])
            torch.testing.assert_close(sim.feedback[j].state_tensors()[i], deltas[j] - sent[j], rtol=0, atol=1e-6)


def test_codec_bytes_replace_the_fp32_payload_sizes(corpus):
    rounds, N = 2, 4
    results = {
        codec: run_simulation(
            compressed("diloco", codec=codec), corpus, peers=N, rounds=rounds, eval_every_rounds=rounds
        )
        for codec in ("none", "fp16", "int8", "topk")
    }
    fp32 = results["none"].bytes_sent_per_peer
    assert fp32 == pytest.approx(rounds * 2 * (N - 1) / N * 4 * results["none"].parameters)
    assert results["fp16"].bytes_sent_per_peer == pytest.approx(fp32 / 2, rel=0.01)
    assert results["int8"].bytes_sent_per_peer == pytest.approx(fp32 * (1 + 4 / 64) / 4, rel=0.02)
    assert results["topk"].bytes_sent_per_peer < fp32 / 8
    for r in results.values():
        assert r.history[-1].loss_bpb < r.history[0].loss_bpb
        assert r.history[-1].sigma == 0.0


def test_adaptive_sync_fits_its_budget(corpus):
    rounds, N = 2, 4
    m = compressed("diloco", codec="adaptive")
    fp32_round = butterfly_bytes(
        run_simulation(m.replace(compression={"codec": "none"}), corpus, peers=N, rounds=1).parameters, N
    )
    m = m.replace(compression={"sync_time_budget_s": fp32_round / 8 / 1e6})  # 8 Mbit/s = 1e6 bytes/s
    r = run_simulation(m, corpus, peers=N, rounds=rounds, eval_every_rounds=rounds, uplink_mbps=8.0)
    # Each peer's plan fits its own sends; the simulation's whole-tensor owners and the peers'
    # differing plans move the group average by a little.
    assert fp32_round / 16 < r.bytes_sent_per_peer / rounds <= fp32_round / 8 * 1.02
    assert r.history[-1].loss_bpb < r.history[0].loss_bpb


def test_noloco_with_compressed_delta_and_phi(corpus):
    m = compressed("noloco", codec="int8", phi_codec="fp16")
    sim = Simulation(m, corpus, peers=4, seed=0)
    sim.run_round()
    (a, b), (c, _) = sync_groups(m, 4, 0)
    # All start from φ_0 with δ = 0, so partners that decoded the identical group mean hold equal φ.
    assert all(torch.equal(x, y) for x, y in zip(sim.phis[a], sim.phis[b]))
    assert not all(torch.equal(x, y) for x, y in zip(sim.phis[a], sim.phis[c]))
    result = run_simulation(m, corpus, peers=4, rounds=3, eval_every_rounds=3)
    plain = run_simulation(manifest("noloco"), corpus, peers=4, rounds=3, eval_every_rounds=3)
    assert result.bytes_sent_per_peer < 0.45 * plain.bytes_sent_per_peer  # Δ in int8, φ in fp16
    assert result.history[-1].loss_bpb < result.history[0].loss_bpb


@pytest.mark.parametrize("codec", ["topk", "lowrank"])
def test_structured_codecs_send_the_group_mean_exactly(corpus, codec):
    # Every contribution (the owner's too) is a decoded encoding, so for_mean(n) carries the
    # mean exactly up to fp16: the mean the peers apply is the fp32 mean of what was sent.
    m = compressed("diloco", codec=codec, topk_fraction=0.02, rank=2)
    sim = Simulation(m, corpus, peers=3, seed=1)
    for inner in sim.inners:
        for k in range(m.sync.inner_steps):
            inner.step(k)
    thetas = [list(model.parameters()) for model in sim.models]
    from peer.train.outer import pseudo_gradient

    deltas = [pseudo_gradient(phi, theta) for phi, theta in zip(sim.phis, thetas)]
    mean, _ = sim._compressed_mean([0, 1, 2], deltas, [1, 1, 1])
    residuals = [ef.state_tensors() for ef in sim.feedback]
    for i, got in enumerate(mean):
        sent_mean = sum(d[i] - e[i] for d, e in zip(deltas, residuals)) / 3  # Σ (Δ − e) = Σ decoded
        torch.testing.assert_close(got, sent_mean, rtol=2e-3, atol=1e-3 * float(sent_mean.abs().max()) + 1e-12)


def test_replicas_train_under_the_placement_precision_while_phi_stays_fp32_on_the_host(corpus):
    # The device seam of bench/compare.py --device: θ trains where and how the placement says (bf16
    # autocast here, on the CPU), φ and the outer step stay fp32 host tensors, replicas stay identical.
    from peer.train.precision import BF16

    sim = Simulation(manifest("diloco"), corpus, peers=2, seed=0, precision=BF16)
    assert all(inner.precision is BF16 for inner in sim.inners)
    sim.run_round()
    for a, b in zip(sim.phis[0], sim.phis[1]):
        assert a.dtype == torch.float32 and a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    history = run_simulation(manifest("diloco"), corpus, peers=2, rounds=2, precision=BF16).history
    assert all(math.isfinite(h.loss_bpb) for h in history) and history[-1].loss_bpb < history[0].loss_bpb


def test_an_adversary_is_refused_off_the_cpu_before_any_device_is_touched(corpus):
    from lab.adversary import Adversary

    with pytest.raises(ValueError, match="'cuda'.*CPU only"):
        Simulation(
            manifest("diloco"), corpus, peers=2, adversary=Adversary(peers=(1,), attack="sign-flip"), device="cuda"
        )


def test_on_eval_sees_every_evaluation_as_it_is_made(corpus):
    seen = []
    result = run_simulation(manifest("diloco"), corpus, peers=2, rounds=3, eval_every_rounds=2, on_eval=seen.append)
    assert [p.round_ for p in seen] == [0, 2, 3] and seen == result.history


def test_compile_reaches_every_replica(corpus):
    sim = Simulation(manifest("diloco"), corpus, peers=2, compile=True)
    assert all(inner.compiled for inner in sim.inners)  # compiled lazily: nothing is traced here
    assert not any(inner.compiled for inner in Simulation(manifest("diloco"), corpus, peers=2).inners)
