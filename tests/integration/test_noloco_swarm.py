"""Four NoLoCo peers on loopback: one partner per round, and a smaller weight spread than no sync."""

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.harness import make_manifest, phi_file, write_manifest

pytestmark = pytest.mark.integration

ROUNDS = 4
NAMES = ["p0", "p1", "p2", "p3"]


def spread(tensors_by_peer: list[dict[str, torch.Tensor]]) -> float:
    """σ = sqrt(Σ_i ‖φ_i − φ̄‖² / (N·P)) (NoLoCo arXiv 2506.10911; docs/algorithms.md §2)."""
    keys = sorted(tensors_by_peer[0])
    flat = torch.stack([torch.cat([t[k].flatten() for k in keys]) for t in tensors_by_peer])
    return ((flat - flat.mean(0)).pow(2).sum() / flat.numel()).sqrt().item()


def run_swarm(procs, workdir, algorithm: str):
    workdir.mkdir()
    procs.workdir = workdir
    # A window that does not shrink below 3 s (deadline 9 s): 4 peers on a loaded 2-core CI host have
    # arrived > 3 s apart at round 2, and a partner that misses the window leaves a round without one.
    # This test is about pairing and bytes; tests/unit/test_deadlines.py is about the adaptive window.
    manifest = make_manifest(sync={"algorithm": algorithm, "inner_steps": 60, "min_matchmaking_time_s": 3.0})
    _, addr = procs.bootstrap(write_manifest(workdir, manifest))
    peers = [
        procs.peer(
            n,
            "--initial-peers",
            addr,
            "--max-rounds",
            str(ROUNDS),
            "--wait-for-peers",
            "4",
            "--export-phi-every",
            str(ROUNDS),
        )
        for n in NAMES
    ]
    for p in peers:
        assert p.wait(240) == 0, p.tail()
    phis = [load_file(str(phi_file(workdir, n, manifest.run_id, ROUNDS))) for n in NAMES]
    return manifest, peers, phis


def test_noloco_peers_exchange_with_one_partner_and_stay_closer_than_no_sync(procs, tmp_path):
    manifest, peers, phis = run_swarm(procs, tmp_path / "noloco", "noloco")
    params = sum(t.numel() for t in phis[0].values())
    payload_bytes = 2 * params * 4  # Δ and φ, fp32
    ids = {p.of("started")[0]["peer_id"] for p in peers}
    partners_seen = {pid: set() for pid in ids}
    for p in peers:
        me = p.of("started")[0]["peer_id"]
        rounds = p.of("round")
        assert len(rounds) == ROUNDS
        for e in rounds:
            # Exactly one partner, and only the payload's worth of bytes: no collective.
            assert e["group_size"] == 2 and len(e["group"]) == 2 and me in e["group"], (
                e.get("note"),
                [
                    (
                        q.name,
                        q.of("started")[0]["peer_id"][-4:],
                        [
                            (x["round"], x["group_size"], [g[-4:] for g in x.get("planned_group") or []])
                            for x in q.of("round")
                        ],
                    )
                    for q in peers
                ],
            )
            # (frames counted at the stream: the payload plus < 1 % of headers)
            assert payload_bytes <= e["bytes_sent"] <= 1.01 * payload_bytes, (
                e["bytes_sent"],
                payload_bytes,
                e.get("note"),
            )
            assert payload_bytes <= e["bytes_received"] <= 1.01 * payload_bytes, (
                e["bytes_received"],
                payload_bytes,
                e.get("note"),
            )
            # honest partners drift apart (by ‖φ‖ when they have not met for rounds): no check may call it an attack
            assert "refused" not in (e.get("note") or ""), e["note"]
            partner = (set(e["group"]) - {me}).pop()
            assert partner in ids
            partners_seen[me].add(partner)
        assert p.of("eval")[-1]["loss"] < p.of("eval")[0]["loss"]
    # Pairs are consistent: if a is b's partner in round r, b is a's.
    for r in range(ROUNDS):
        pairs = {tuple(sorted(p.of("round")[r]["group"])) for p in peers}
        assert len(pairs) == 2 and set().union(*pairs) == ids
    sigma_noloco = spread(phis)

    procs.cleanup()
    _, _, phis_alone = run_swarm(procs, tmp_path / "independent", "independent")
    sigma_alone = spread(phis_alone)
    # The pairs of round r are drawn afresh each round (3 ways to pair 4 peers). When the last round
    # paired peers that the round before had kept apart, every final φ averages both earlier pairs
    # and the spread nearly vanishes (σ ratio 0.02-0.03 measured). When it kept the same pairs (1 in 3,
    # and 1 in 27 for all four rounds), the two pairs have trained apart since their last meeting:
    # two 2-peer swarms, whose spread is still well under no sync's (a CI run measured 0.73, as
    # pairs kept all four rounds would give; 0.58 for pairs that average exactly).
    pairings = [frozenset(tuple(sorted(p.of("round")[r]["group"])) for p in peers) for r in range(ROUNDS)]
    bound = 0.2 if pairings[-1] != pairings[-2] else 0.9
    assert sigma_noloco < bound * sigma_alone, (sigma_noloco, sigma_alone, bound)
