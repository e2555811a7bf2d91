"""What `peer status` and the monitor's snapshot say at a glance (issue #68 item 6): the swarm's round
is the median of the live peers' rounds, each validation loss comes with the round it was measured
at, and `peer status` piped or redirected prints every column whole."""

from __future__ import annotations

import io
import subprocess
import sys

from hivemind.utils import get_dht_time

from bootstrap.monitor import SwarmMonitor
from peer import status as peer_status
from peer.net import dht as swarm_dht
from protocol.records import ProgressRecord
from tests.security.fake_dht import FakeDHT

RUN = "ab" * 16
CAPS = {"upload_cap_mbit": 5.0, "upload_mbit": 4.8, "day_gb": 1.2, "day_cap_gb": 2.0, "rounds_sat_out": 2.0}


def record(round_: int, eval_loss: float | None = None, caps=None) -> ProgressRecord:
    return ProgressRecord(
        round=round_,
        inner_step=round_ * 10,
        train_loss=2.5,
        tokens_per_s=1234.0,
        group_size=2,
        bytes_sent=10,
        eval_loss=eval_loss,
        caps=caps,
    )


def swarm(monkeypatch, records: dict[str, ProgressRecord]) -> None:
    items = [swarm_dht.PeerProgress(pid, r, get_dht_time() + 60) for pid, r in records.items()]
    monkeypatch.setattr(swarm_dht, "list_runs", lambda dht: {RUN: "r"})
    monkeypatch.setattr(swarm_dht, "read_progress", lambda dht, run_id: items)
    monkeypatch.setattr(swarm_dht, "fetch_manifest", lambda dht, run_id, allow_data_path=False: None)
    monkeypatch.setattr(peer_status, "_devices_or_empty", lambda dht, run_id, peers=(): {})


def test_the_swarms_round_is_the_median_of_live_peers_not_the_lone_peer_ahead(monkeypatch):
    swarm(monkeypatch, {"QmA": record(12, eval_loss=2.4113), "QmB": record(12), "QmC": record(40, caps=CAPS)})
    [run] = peer_status.collect_status(FakeDHT(), wait_s=0)["runs"]
    assert peer_status.median_round(run["peers"]) == 12
    assert peer_status.median_round([{"round": r, "live": True} for r in (3, 5, 7, 9)]) == 5  # a round a peer is at
    assert peer_status.median_round([{"round": 9, "live": False}]) is None
    out = io.StringIO()
    peer_status.print_status({"runs": [run]}, peer_status.status_console(out))
    assert "swarm: median round 12 (rounds 12 to 40) | 3,702 tok/s from 3 live peer(s)" in out.getvalue()

    monitor = SwarmMonitor(FakeDHT())
    monkeypatch.setattr(monitor, "_read_devices", lambda found: None)
    monitor.poll()
    [snap] = monitor.snapshot()["runs"]
    assert (snap["median_round"], snap["max_round"]) == (12, 40)


def test_each_validation_loss_comes_with_the_round_it_was_measured_at(monkeypatch):
    records = {"QmA": record(5, eval_loss=3.1)}
    swarm(monkeypatch, records)
    monitor = SwarmMonitor(FakeDHT())
    monkeypatch.setattr(monitor, "_read_devices", lambda found: None)
    monitor.poll()
    records["QmA"] = record(9)  # the peer moved on without evaluating again
    swarm(monkeypatch, records)
    monitor.poll()
    [peer] = monitor.snapshot()["runs"][0]["peers"]
    assert (peer["round"], peer["eval_loss"], peer["eval_round"]) == (9, 3.1, 5)  # stale: measured 4 rounds ago

    [run] = peer_status.collect_status(FakeDHT(), wait_s=0)["runs"]
    assert (run["peers"][0]["eval_loss"], run["peers"][0]["eval_round"]) == (None, None)
    assert peer_status.loss_at(2.41131, 12) == "2.4113 @ r12" and peer_status.loss_at(None, None) == "-"


def test_status_piped_prints_every_column_whole(monkeypatch):
    """Piped or redirected, rich would fit the table to 80 columns (cells cut to '…', headers folded):
    every column's header and every cell must come out whole, one line per peer."""
    long_id = "12D3KooW" + "P" * 44
    swarm(monkeypatch, {long_id: record(7, eval_loss=2.0, caps=CAPS)})
    [run] = peer_status.collect_status(FakeDHT(), wait_s=0)["runs"]
    out = io.StringIO()  # not a terminal
    peer_status.print_status({"runs": [run]}, peer_status.status_console(out))
    text = out.getvalue()
    assert "…" not in text, text
    [row] = [line for line in text.splitlines() if long_id in line]
    for cell in ("live", "2.0000 @ r7", "1,234", "upload 4.8/5 Mbit/s, today 1.20/2 GB, 2 rounds sat out"):
        assert cell in row, row
    header = next(line for line in text.splitlines() if "peer id" in line)
    for column in ("device", "inner step", "train loss", "val loss @ round", "record age", "caps (use/cap)"):
        assert column in header, header


def test_the_status_console_is_wide_when_stdout_is_a_pipe():
    code = "from peer.status import status_console, PIPED_WIDTH; assert status_console().width == PIPED_WIDTH"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)  # stdout: a pipe
    assert result.returncode == 0, result.stderr
