"""A bootstrap node and real peer processes train over libp2p on loopback (DiLoCo)."""

import signal

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.harness import make_manifest, phi_file, process_tree, shared_memory_files, write_manifest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("inner", ["adamw", "muon"])
def test_three_peers_train_two_rounds_with_identical_phi(procs, tmp_path, inner):
    manifest = make_manifest(inner_optimizer={"kind": inner})
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    names = ["p0", "p1", "p2"]
    peers = [
        procs.peer(n, "--initial-peers", addr, "--max-rounds", "2", "--wait-for-peers", "3", "--export-phi-every", "1")
        for n in names
    ]
    for p in peers:
        assert p.wait(180) == 0, p.tail()

    for p in peers:
        rounds = p.of("round")
        assert [e["round"] for e in rounds] == [1, 2]
        assert [e["group_size"] for e in rounds] == [3, 3], [e.get("note") for e in rounds]
        assert all(e["bytes_sent"] > 0 for e in rounds)
        initial, final = p.of("eval")[0], p.of("eval")[-1]
        assert (initial["when"], final["when"]) == ("initial", "final")
        assert final["loss"] < initial["loss"] - 0.5  # loss falls visibly in two rounds
        assert p.of("started")[0]["run_id"] == manifest.run_id

    for round_ in (1, 2):
        phis = [load_file(str(phi_file(tmp_path, n, manifest.run_id, round_))) for n in names]
        for other in phis[1:]:
            assert other.keys() == phis[0].keys()
            for key in phis[0]:  # every peer applies the same bytes: φ is bit-identical
                assert torch.equal(other[key], phis[0][key]), key
    # φ moved between rounds: the outer step was applied.
    r1 = load_file(str(phi_file(tmp_path, "p0", manifest.run_id, 1)))
    r2 = load_file(str(phi_file(tmp_path, "p0", manifest.run_id, 2)))
    assert any(not torch.equal(r1[k], r2[k]) for k in r1)


def test_joiner_starts_from_the_swarms_phi_and_round(procs, tmp_path):
    H = 150
    manifest = make_manifest(sync={"inner_steps": H, "matchmaking_time_s": 3.0})
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    # Train until stopped, so the test does not depend on how fast rounds are on this machine.
    first = [
        procs.peer(n, "--initial-peers", addr, "--wait-for-peers", "2", "--export-phi-every", "1") for n in ("p0", "p1")
    ]
    first[0].wait_event(lambda e: e.get("event") == "round" and e["round"] >= 2, 240)
    joiner = procs.peer("late", "--initial-peers", addr, "--export-phi-every", "1")

    adopted = joiner.wait_event(lambda e: e.get("event") == "adopted_state", 120)
    assert adopted["round"] >= 2
    # The inner lr schedule continues from the swarm's step count: no warm-up restart.
    assert adopted["inner_step"] >= adopted["round"] * H
    # Its first full-group round in which a groupmate started from the same φ and completed the
    # all-reduce with it in full (``agreeing``). A round can pass without one: a first peer that
    # missed the previous group applied its own Δ and is a round out of step until it re-syncs
    # (docs/architecture.md), and a round with an excluded piece vouches for no one.
    joint = joiner.wait_event(
        lambda e: e.get("event") == "round" and e["group_size"] == 3 and len(e["agreeing"]) >= 2, 240
    )
    for p in (joiner, *first):
        p.popen.send_signal(signal.SIGINT)
    for p in (joiner, *first):
        assert p.wait(120) == 130, p.tail()

    # It evaluated the swarm's φ at a round it adopted, not a fresh initialisation. (It may adopt
    # twice: the swarm can finish a round during the first download, and catch-up goes again.)
    swarm_initial = first[0].of("eval")[0]["loss"]
    assert joiner.of("eval")[0]["round"] in {e["round"] for e in joiner.of("adopted_state")}, (
        joiner.of("eval")[0]["round"],
        [(e["round"], e.get("reason")) for e in joiner.of("adopted_state")],
    )
    assert joiner.of("eval")[0]["loss"] < swarm_initial - 0.5
    # It trained with the others: φ after that round is bit-identical with that of every groupmate
    # that agreed, and each of them recorded the same round from the same start φ.
    r = joint["round"]
    ids = {p.of("started")[0]["peer_id"]: p for p in first}
    mates = [ids[i] for i in joint["agreeing"] if i in ids]
    assert mates, (joint["agreeing"], list(ids))
    mine = load_file(str(phi_file(tmp_path, "late", manifest.run_id, r)))
    for mate in mates:
        theirs_round = [e for e in mate.of("round") if e["round"] == r]
        assert [e["start_digest"] for e in theirs_round] == [joint["start_digest"]], (mate.name, theirs_round)
        theirs = load_file(str(phi_file(tmp_path, mate.name, manifest.run_id, r)))
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (mate.name, key)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4", "fp4", "topk", "lowrank", "adaptive"])
def test_two_peers_sync_with_each_codec_to_identical_phi(procs, tmp_path, codec):
    manifest = make_manifest(compression={"codec": codec})
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    peers = [
        procs.peer(n, "--initial-peers", addr, "--max-rounds", "2", "--wait-for-peers", "2", "--export-phi-every", "1")
        for n in ("p0", "p1")
    ]
    pids = []
    for p in peers:
        p.wait_event(lambda e: e.kind == "round", 180)  # its helpers run
        pids += process_tree(p.popen.pid)
    for p in peers:
        assert p.wait(180) == 0, p.tail()
    # the tensors the peers' processes passed each other (buffers, the checkpoints' residuals) left
    # no shared memory behind: the averager is killed at shutdown, whatever it still held
    assert shared_memory_files(pids) == []
    for p in peers:
        rounds = p.of("round")
        assert [e["group_size"] for e in rounds] == [2, 2], [e.get("note") for e in rounds]
        assert all(e["bytes_sent"] > 0 and e["bytes_received"] > 0 for e in rounds)
        assert p.of("eval")[-1]["loss"] < p.of("eval")[0]["loss"]
    for round_ in (1, 2):
        a, b = (load_file(str(phi_file(tmp_path, n, manifest.run_id, round_))) for n in ("p0", "p1"))
        for key in a:
            assert torch.isfinite(a[key]).all() and torch.equal(a[key], b[key]), key
