"""Two real peers on loopback with sync.overlap: each round's all-reduce runs while the next round
trains; φ stays bit-identical across the peers and the loss falls."""

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.harness import make_manifest, phi_file, write_manifest

pytestmark = pytest.mark.integration

ROUNDS = 3


@pytest.mark.parametrize(
    "overlap,codec,outer,from_round",
    [
        ("delayed", "none", {}, 0),
        # eager with outer momentum: each peer's own part of the paper's per-worker outer state in θ
        ("eager", "int8", {"lr": 0.7, "momentum": 0.5, "nesterov": True}, 0),
        # eager after a blocking first round (sync.overlap_from_round), with the shipped outer step
        ("eager", "none", {}, 1),
    ],
)
def test_two_peers_overlap_syncs_with_identical_phi(procs, tmp_path, overlap, codec, outer, from_round):
    manifest = make_manifest(
        sync={"overlap": overlap, "overlap_from_round": from_round}, compression={"codec": codec}, outer_optimizer=outer
    )
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    names = ("p0", "p1")
    peers = [
        procs.peer(
            n, "--initial-peers", addr, "--max-rounds", str(ROUNDS), "--wait-for-peers", "2", "--export-phi-every", "1"
        )
        for n in names
    ]
    for p in peers:
        assert p.wait(180) == 0, p.tail()
    run_id = peers[0].of("started")[0]["run_id"]  # the announced run's id (the run as the peers train it)
    for p in peers:
        rounds = p.of("round")
        assert [e["round"] for e in rounds] == list(range(1, ROUNDS + 1))
        # a round reports the sync that landed at its end: its own while blocking (rounds before
        # from_round), else the previous round's (none for the first overlapped round)
        landed = [r != from_round for r in range(ROUNDS)]
        assert [e["group_size"] for e in rounds] == [2 if x else 1 for x in landed], [e.get("note") for e in rounds]
        assert [e["bytes_sent"] > 0 for e in rounds] == landed
        initial, final = p.of("eval")[0], p.of("eval")[-1]
        assert (initial["when"], final["when"]) == ("initial", "final")
        assert final["loss"] < initial["loss"] - 0.3
    for round_ in range(1, ROUNDS + 1):
        a, b = (load_file(str(phi_file(tmp_path, n, run_id, round_))) for n in names)
        for key in a:
            assert torch.isfinite(a[key]).all() and torch.equal(a[key], b[key]), (round_, key)
    # The last sync landed before the peers stopped: the checkpoints hold the same, newer φ.
    final = [load_file(str(tmp_path / n / "runs" / run_id / "checkpoint.safetensors")) for n in names]
    last_exported = load_file(str(phi_file(tmp_path, "p0", run_id, ROUNDS)))
    for key in last_exported:
        assert torch.equal(final[0][f"phi.{key}"], final[1][f"phi.{key}"]), key
    # round 3's mean landed after round 3's export (which held φ up to round 2's mean)
    assert any(not torch.equal(final[0][f"phi.{k}"], last_exported[k]) for k in last_exported)


def test_two_noloco_peers_exchange_with_their_partner_in_the_background(procs, tmp_path):
    manifest = make_manifest(sync={"algorithm": "noloco", "overlap": "eager"})
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    names = ("p0", "p1")
    peers = [
        procs.peer(
            n,
            "--initial-peers",
            addr,
            "--max-rounds",
            str(ROUNDS),
            "--wait-for-peers",
            "2",
            "--export-phi-every",
            str(ROUNDS),
        )
        for n in names
    ]
    for p in peers:
        assert p.wait(180) == 0, p.tail()
    run_id = peers[0].of("started")[0]["run_id"]
    for p in peers:
        rounds = p.of("round")
        assert [e["group_size"] for e in rounds[1:]] == [2] * (ROUNDS - 1), [e.get("note") for e in rounds]
        assert p.of("eval")[-1]["loss"] < p.of("eval")[0]["loss"] - 0.3
    for n in names:
        phi = load_file(str(phi_file(tmp_path, n, run_id, ROUNDS)))
        assert all(torch.isfinite(t).all() for t in phi.values())


@pytest.mark.parametrize(
    "algorithm,codec,merge,alpha,inner",
    [
        ("diloco", "int8", "mix", 0.5, "adamw"),
        ("noloco", "none", "mix", 0.5, "adamw"),
        ("diloco", "none", "shift", 0.5, "adamw"),
        # Muon's momentum carried across the landings, with the merge measured best for it
        ("diloco", "none", "shift", 0.0, "muon"),
    ],
)
def test_two_peers_stream_fragments_over_the_network_with_identical_phi(
    procs, tmp_path, algorithm, codec, merge, alpha, inner
):
    """Streaming DiLoCo: each fragment's all-reduce carries only that fragment's tensors, under its
    own key, in the background (with a codec: its error feedback kept per tensor of the fragment;
    with ``fragment_merge = "shift"``: each mean landed relative to θ at its sync)."""
    manifest = make_manifest(
        model={"num_layers": 2},
        compression={"codec": codec},
        inner_optimizer={"kind": inner},
        sync={
            "algorithm": algorithm,
            "overlap": "streaming",
            "inner_steps": 20,
            "fragments": 2,
            "fragment_delay_steps": 2,
            "fragment_merge": merge,
            "fragment_alpha": alpha,
        },
    )
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    names = ("p0", "p1")
    peers = [
        procs.peer(
            n, "--initial-peers", addr, "--max-rounds", str(ROUNDS), "--wait-for-peers", "2", "--export-phi-every", "1"
        )
        for n in names
    ]
    for p in peers:
        assert p.wait(240) == 0, p.tail()
    run_id = peers[0].of("started")[0]["run_id"]
    for p in peers:
        # fragment 1 mid-round and fragment 0 at each round's end, then fragment 1 once more at the end
        assert [(e["round"], e["fragment"]) for e in p.of("sync")] == [
            (r, f) for r in range(ROUNDS) for f in (1, 0)
        ] + [(ROUNDS, 1)]
        rounds = p.of("round")
        assert [e["group_size"] for e in rounds] == [2] * ROUNDS, [e.get("note") for e in rounds]
        assert p.of("eval")[-1]["loss"] < p.of("eval")[0]["loss"] - 0.3
    for round_ in range(1, ROUNDS + 1):
        a, b = (load_file(str(phi_file(tmp_path, n, run_id, round_))) for n in names)
        for key in a:
            assert torch.isfinite(a[key]).all() and torch.equal(a[key], b[key]), (round_, key)
    final = [load_file(str(tmp_path / n / "runs" / run_id / "checkpoint.safetensors")) for n in names]
    for key in final[0]:
        if key.startswith("phi."):
            assert torch.equal(final[0][key], final[1][key]), key
