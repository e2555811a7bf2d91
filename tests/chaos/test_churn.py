"""Churn on real hosts: 6 peers and a bootstrap node, each in its own network namespace behind a
20 Mbit/s tbf uplink, and every fault of the chaos harness (lab/chaos.py) in one run:

kill -9 of a peer while the group syncs, SIGSTOP/SIGCONT of a peer, a partition (link down, then
up), the bootstrap node killed, a new peer joining through a live peer's address, and the killed
peer restarted from its checkpoint.

Asserted: no survivor's sync outlives its deadline and every survivor keeps finishing rounds
(issue item 2); peers that completed a round from the same state hold the same state after it
(3); losses stay finite and every state a peer publishes is finite, as make_snapshot refuses
NaN/inf (4); the joiner downloads from several donors and then averages with the swarm (5); the
swarm trains on without its bootstrap node and is joinable through a peer (6); the partitioned,
the hung and the restarted peer end up holding the swarm's state (7); deadlines adapt (8).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from lab import netlab
from lab.chaos import CHAOS_MODEL, ChaosSwarm
from peer.events import Event
from peer.launch import Child
from protocol.manifest import dump_toml
from protocol.presets import tiny_run

OK, WHY = netlab.available()
pytestmark = [
    pytest.mark.skipif(not OK, reason=f"chaos test needs network namespaces: {WHY}"),
    pytest.mark.timeout(600),
]

MAX_ALLREDUCE_S = 30.0


def manifest():
    # ~0.5 M parameters (2 MB per payload), rounds of ~3-4 s of inner steps and ~2 s of sync
    return tiny_run().replace(
        model=CHAOS_MODEL,
        sync={
            "inner_steps": 30,
            "matchmaking_time_s": 3.0,
            "allreduce_timeout_s": MAX_ALLREDUCE_S,
            "next_chunk_timeout_s": 5.0,
        },
    )


def after(member: Child, since_time: float, kind: str = "round") -> list[Event]:
    return [e for e in member.of(kind) if e.time >= since_time]


def wait_in_sync(swarm: ChaosSwarm, name: str, timeout_s: float) -> Event:
    """Wait for a round that ``name`` completed together with a groupmate from the same state."""
    member = swarm.members[name]
    return member.wait_event(
        lambda e: e.kind == "round" and len(e.get("agreeing", [])) > 1, timeout_s, since=len(member.events)
    )


def test_swarm_survives_every_fault(tmp_path: Path):
    run = tmp_path / "run.toml"
    run.write_text(dump_toml(manifest()))
    names = [f"p{i}" for i in range(5)]
    with ChaosSwarm(tmp_path, run, rate_mbit=20, prefix="lsct", subnet="10.213.79") as swarm:
        swarm.start_bootstrap()
        for name in names:
            swarm.add_peer(name)
        swarm.wait_rounds(names, 2, 240)

        # 1. kill -9 of p4 while the group syncs
        r = max(swarm.round_of(n) for n in names)
        for name in names:
            swarm.members[name].wait_event(lambda e: e.kind == "sync" and e.round >= r, 120)
        time.sleep(0.5)
        swarm.kill("p4")
        survivors = names[:4]
        swarm.wait_rounds(survivors, r + 3, 180)

        # 2. SIGSTOP p3 (open sockets, no answers), SIGCONT after 20 s
        swarm.freeze("p3")
        time.sleep(20)
        swarm.thaw("p3")
        wait_in_sync(swarm, "p3", 180)

        # 3. partition p2 for 20 s
        swarm.partition("p2")
        time.sleep(20)
        swarm.heal("p2")
        wait_in_sync(swarm, "p2", 180)

        # 4. the bootstrap node dies; the swarm trains on
        p1_addr = swarm.peer_addr("p1")
        killed_bootstrap_at = time.time()
        swarm.kill_bootstrap()
        r = max(swarm.round_of(n) for n in survivors)
        swarm.wait_rounds(survivors, r + 2, 180)

        # 5. a joiner through a peer's address, and p4 restarted from its checkpoint
        joined_at = time.time()
        swarm.add_peer("p5", initial_peers=[p1_addr])
        swarm.restart("p4", initial_peers=[swarm.peer_addr("p2")])
        for name in ("p5", "p4"):
            wait_in_sync(swarm, name, 240)
        everyone = [*names, "p5"]
        swarm.wait_rounds(everyone, max(swarm.round_of(n) for n in everyone) + 1, 240)

        members = swarm.members

        # (2) no sync outlived its deadline; every survivor kept finishing rounds
        for name, member in members.items():
            for e in member.of("round"):
                assert e["sync_s"] <= e["deadline_s"] + 5.0, (
                    f"{name} round {e['round']}: sync {e['sync_s']:.1f} s past its deadline {e['deadline_s']:.1f} s"
                )
        # (3) peers that completed a round from the same state hold the same state after it
        assert swarm.disagreements() == []
        # (4) nothing non-finite: losses finite, and every state published has a digest
        for name, member in members.items():
            for e in member.of("round"):
                assert math.isfinite(e["train_loss"]), f"{name} round {e['round']}: loss {e['train_loss']}"
                assert len(e["state_digest"]) == 32
        # (5) the joiner asked several donors and striped its download over those that still held the
        # state, then averaged with the swarm. A download can race the swarm's next round: donors that
        # moved on answer MISSING and the others deliver their share (in one CI run 3 of 4 donors had
        # moved on before the first piece, and the fourth delivered it all), so a download counts as
        # striped when it took pieces from at least two donors, or from every donor still holding it.
        adopted = members["p5"].of("adopted_state")
        assert adopted, "the joiner never downloaded the swarm's state"

        def striped(e) -> bool:
            delivered = sum(1 for n in e["donors"].values() if n > 0)
            moved_on = sum(1 for why in e.get("failed_donors", {}).values() if why.startswith("MISSING"))
            still_held = len(e["donors"]) - moved_on
            return len(e["donors"]) >= 2 and still_held >= 1 and delivered >= min(2, still_held)

        assert any(striped(e) for e in adopted), adopted
        # within two rounds of its first download the joiner averages with the swarm (a joiner waits
        # out a swarm about to sync, peer/round/; its download can still outlast the swarm's
        # matchmaking on these 2 loaded cores, and then it re-syncs after one round alone)
        first_rounds = after(members["p5"], adopted[0].time)[:2]
        assert any(e["group_size"] > 1 for e in first_rounds), f"joiner's first rounds were alone: {first_rounds}"
        # (6) rounds after the bootstrap died, and a join through a peer's address
        for name in survivors:
            assert len([e for e in after(members[name], killed_bootstrap_at) if e["group_size"] > 1]) >= 2, name
        assert members["p5"].of("started") and after(members["p5"], joined_at)
        # (7) the restarted peer resumed from its checkpoint and re-synced
        resumed = [e for e in members["p4"].of("resumed") if e.start == 2]
        assert resumed, "p4 did not resume from its checkpoint"
        assert [e for e in members["p4"].of("adopted_state") if e.start == 2], "p4 did not re-sync"
        # (8) deadlines adapted below their configured maximum after the first rounds
        adaptive = [e["deadline_s"] for e in members["p0"].of("round") if e["deadline_s"] > 0]
        worst = 2 * (3 * 3.0 + MAX_ALLREDUCE_S + 5.0)
        assert min(adaptive) < worst, adaptive
