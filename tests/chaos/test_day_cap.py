"""A volunteer's daily traffic budget on real hosts (issue #68 item 5): a bootstrap node and three
peers, each in its own network namespace on an unshaped link; one peer runs with
``--max-gb-per-day`` small enough that it sits out syncs within a few rounds.

Asserted:

* its traffic ledger (``DATA_DIR/traffic.json``) counts what its link carried within 5 %: the IP
  bytes its veth pair moved both ways (the interface's bytes less 14 B of Ethernet header a frame,
  one TCP segment a frame as on a real line), over the stretch from the ledger's first write to its
  last one seen, the DHT's RPCs included;
* a round whose sync it sat out ends only after the other peers finished that round: it keeps to
  the swarm's round instead of running ahead (its rounds would be shorter by the matchmaking and
  all-reduce it skips).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lab import netlab
from lab.chaos import CHAOS_MODEL, ChaosSwarm
from lab.linkmeter import LedgerWatch, one_segment_a_frame
from peer.net.traffic import LEDGER_FILE
from protocol.manifest import dump_toml
from protocol.presets import tiny_run

OK, WHY = netlab.available()
pytestmark = [
    pytest.mark.skipif(not OK, reason=f"chaos test needs network namespaces: {WHY}"),
    pytest.mark.timeout(420),
]

BUDGET_GB = 0.2
"""The first hour's share is 8.3 MB: about one and a half syncs of this run (a group of three moves
~5.4 MB through each peer's link in fp32), so the peer sits out from its second or third sync on."""
ROUNDS = 9
PRINT_SLACK_S = 0.5
"""A peer hands its record to the DHT just before it prints its round event; on a loaded host the
print may come after another peer read the record. A peer that ran ahead would end its round before
the others' matchmaking (3 s) and all-reduce."""


def test_capped_peer_counts_its_wire_and_keeps_to_the_swarms_round(tmp_path: Path):
    run = tmp_path / "run.toml"
    manifest = tiny_run().replace(
        model=CHAOS_MODEL,
        compression={"codec": "none"},
        sync={"inner_steps": 10, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 60.0, "next_chunk_timeout_s": 15.0},
    )
    run.write_text(dump_toml(manifest))
    common = ["--eval-every", "0", "--wait-for-peers", "3"]
    with ChaosSwarm(tmp_path, run, rate_mbit=None, prefix="lsday", subnet="10.213.91", peer_args=common) as swarm:
        swarm.start_bootstrap()
        one_segment_a_frame(swarm.hosts["bootstrap"])
        others = [swarm.add_peer("p0"), swarm.add_peer("p1")]
        capped = swarm.add_peer("capped", extra=["--max-gb-per-day", str(BUDGET_GB)])
        for name in swarm.members:  # before their peers connect: they are still starting
            one_segment_a_frame(swarm.hosts[name])
        watch = LedgerWatch(tmp_path / "capped" / LEDGER_FILE, swarm.hosts["capped"].veth_root)
        watch.start()
        try:
            capped.wait_event(lambda e: e.kind == "round" and (e.round or 0) >= ROUNDS, 300)
            time.sleep(1.0)  # the records and the ledger's write after the round
        finally:
            watch.stop()

    # the ledger against the link, from its first write to its last
    assert len(watch.pairs) >= 2, f"the ledger was written {len(watch.pairs)} time(s)"
    counted, wire = watch.span()
    print(f"ledger {counted / 1e6:.3f} MB, link {wire / 1e6:.3f} MB (IP bytes), {counted / wire - 1:+.2%}")
    assert wire > 5e6, f"the link carried only {wire} bytes: no sync in the stretch measured"
    assert abs(counted - wire) <= 0.05 * wire, f"ledger {counted} B, link {wire} B: more than 5 % apart"

    # a sat-out round ends after the others finished it
    sat_out = [e for e in capped.of("round") if "sat out this sync" in (e.get("note") or "")]
    assert sat_out, f"no sync sat out: {[e.get('note') for e in capped.of('round')]}"
    for e in sat_out:  # e.round: the round it goes on to
        went_on = e.round or 0
        finished = [
            min((o.time or 0.0 for o in p.of("round") if (o.round or 0) >= went_on), default=None) for p in others
        ]
        late = [
            f"{p.name} at {t}" for p, t in zip(others, finished) if t is None or t > (e.time or 0.0) + PRINT_SLACK_S
        ]
        assert not late, f"capped ended round {e.round - 1} (sat out) at {e.time}, before {late}: {e.get('note')}"
