"""A volunteer's upload cap on real hosts (issue #53 item 10): a bootstrap node and two peers, each in
its own network namespace on an unshaped link; one peer runs with ``--max-upload-mbit 5``.

Asserted: over every sync of the capped peer (each stretch its link is busy sending at least a
sync's bytes, as its own interface counts them: the root-side end of its veth pair receives exactly
what it sends), its send rate stays within 5 % of the cap. Without the pacer the same sync is a
burst of well over 100 Mbit/s here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab import netlab
from lab.chaos import CHAOS_MODEL, ChaosSwarm
from lab.linkmeter import LinkMeter, busy_stretches
from protocol.manifest import dump_toml
from protocol.presets import tiny_run

OK, WHY = netlab.available()
pytestmark = [
    pytest.mark.skipif(not OK, reason=f"chaos test needs network namespaces: {WHY}"),
    pytest.mark.timeout(300),
]

CAP_MBIT = 5.0
SYNC_BYTES = int(1.5 * 2**20)
"""A busy stretch that sent at least this much is a sync (each sends ~2 MB); shorter ones are
receipts, requests, records."""


def test_capped_peer_sends_within_its_cap(tmp_path: Path):
    run = tmp_path / "run.toml"
    # 0.49 M parameters in fp32: a 2 MB payload, of which a group of two sends each peer's half and
    # its means of the other half (2 MB a sync): ~3.4 s at the cap
    manifest = tiny_run().replace(
        model=CHAOS_MODEL,
        compression={"codec": "none"},
        sync={"inner_steps": 10, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 60.0, "next_chunk_timeout_s": 15.0},
    )
    run.write_text(dump_toml(manifest))
    with ChaosSwarm(tmp_path, run, rate_mbit=None, prefix="lscap", subnet="10.213.87") as swarm:
        swarm.start_bootstrap()
        swarm.add_peer("p1")
        capped = swarm.add_peer("capped", extra=["--max-upload-mbit", str(CAP_MBIT)])
        meter = LinkMeter(swarm.hosts["capped"].veth_root)
        meter.start()
        try:
            capped.wait_event(lambda e: e.kind == "round" and e.get("group_size", 1) >= 2, 180)
            capped.wait_event(
                lambda e: e.kind == "round" and e.get("group_size", 1) >= 2, 120, since=len(capped.events)
            )
        finally:
            meter.stop()

    cap = CAP_MBIT * 1e6 / 8
    stretches = busy_stretches(meter.samples, cap)
    rates = [f"{b * 8 / s / 1e6:.2f} Mbit/s over {s:.1f} s ({b / 2**20:.2f} MiB)" for s, b in stretches]
    print("capped peer's busy stretches:", "; ".join(rates))
    syncs = [(s, b) for s, b in stretches if b >= SYNC_BYTES]
    assert syncs, f"no busy stretch carried a sync's ~2 MB: {rates}"
    for seconds, sent in syncs:  # each sync over its whole length (an unpaced one is a 0.1 s burst)
        assert sent / seconds <= 1.05 * cap, f"sent {sent * 8 / seconds / 1e6:.2f} Mbit/s > 1.05 × {CAP_MBIT}: {rates}"
