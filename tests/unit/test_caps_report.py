"""A peer's use against its own caps: the progress record's ``caps`` (protocol/records.py), what the
peer puts there (peer/net/traffic.py ``caps_report``), and how `peer status` and the monitor show it."""

from __future__ import annotations

import io

import pytest
from hivemind.utils import get_dht_time
from rich.console import Console

from bootstrap.monitor import SwarmMonitor
from peer import status as peer_status
from peer.net import dht as swarm_dht, pacing, traffic
from peer.net.pacing import Pacer
from protocol.errors import BadPayload
from protocol.records import ProgressRecord
from tests.security.fake_dht import FakeDHT

RUN = "ab" * 16


def record(caps=None) -> ProgressRecord:
    return ProgressRecord(
        round=2, inner_step=20, train_loss=2.5, tokens_per_s=100.0, group_size=2, bytes_sent=10, caps=caps
    )


def test_a_record_without_caps_is_the_record_it_was():
    wire = record().to_wire()
    assert "caps" not in wire  # peers without caps publish what older peers read
    assert ProgressRecord.from_wire(wire) == record()


def test_caps_round_trip_and_bad_caps_are_refused():
    caps = {"upload_cap_mbit": 5.0, "upload_mbit": 4.8, "day_gb": 1.2, "day_cap_gb": 2.0, "rounds_sat_out": 3.0}
    assert ProgressRecord.from_wire(record(caps).to_wire()).caps == caps
    assert ProgressRecord.from_wire({**record().to_wire(), "caps": {"day_gb": None}}).caps == {}
    for bad in (
        {"upload_mbit": float("nan")},
        {"upload_mbit": -1.0},
        {"day_gb": 1e12},
        {"upload_mbit": True},
        {"colour": 1.0},
        [1.0],
        "\x1b[31mred",
    ):
        with pytest.raises(BadPayload, match="caps"):
            ProgressRecord.from_wire({**record().to_wire(), "caps": bad})


def test_describe_caps_reads_as_the_issue_asks():
    caps = {"upload_cap_mbit": 5.0, "upload_mbit": 4.83, "day_gb": 1.2, "day_cap_gb": 2.0, "rounds_sat_out": 3.0}
    assert traffic.describe_caps(caps) == "upload 4.8/5 Mbit/s, today 1.20/2 GB, 3 rounds sat out"
    assert traffic.describe_caps({"upload_cap_mbit": 5.0, "upload_mbit": 0.0}) == "upload 0.0/5 Mbit/s"
    assert traffic.describe_caps(None) == ""


def test_caps_report_from_the_installed_pacer_and_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(traffic, "_BUDGET", None)
    monkeypatch.setattr(pacing, "_PACER", None)
    # the ledger from the pacer's counters, as where the kernel's socket counters cannot be read
    monkeypatch.setattr(traffic.wiremeter, "available", lambda: (False, "not here"))
    assert traffic.caps_report() is None  # no caps: nothing in the record
    pacer = pacing.install(5.0)

    class Inner:
        def average(self, payload, **kwargs):
            pacer.reserve(10**6)
            return "mean"

    t = traffic.budgeted(Inner(), tmp_path, 2.0)
    t.average([])
    report = traffic.caps_report()
    assert report is not None
    assert report["upload_cap_mbit"] == pytest.approx(5.0)
    assert report["day_cap_gb"] == 2.0 and report["day_gb"] == pytest.approx(1e-3)
    assert report["rounds_sat_out"] == 0.0
    assert (tmp_path / traffic.LEDGER_FILE).exists()


def test_recent_rate_is_the_rate_while_sending_not_the_idle_time_after():
    now = [100.0]
    pacer = Pacer(625_000.0, clock=lambda: now[0])  # 5 Mbit/s
    for _ in range(400):  # 6.5 MB, booked as one sender sends: ~10 s
        now[0] += pacer.reserve(16384)
    now[0] += 60.0  # idle
    pacer.reserve(100)
    assert pacer.recent_rate() == pytest.approx(625_000.0, rel=0.1)


def test_status_and_monitor_show_the_caps(monkeypatch):
    capped = record({"upload_cap_mbit": 5.0, "upload_mbit": 4.8, "day_gb": 1.2, "day_cap_gb": 2.0})
    items = [
        swarm_dht.PeerProgress("QmCapped", capped, get_dht_time() + 60),
        swarm_dht.PeerProgress("QmFree", record(), get_dht_time() + 60),
    ]
    monkeypatch.setattr(swarm_dht, "list_runs", lambda dht: {RUN: "r"})
    monkeypatch.setattr(swarm_dht, "read_progress", lambda dht, run_id: items)
    monkeypatch.setattr(swarm_dht, "fetch_manifest", lambda dht, run_id, allow_data_path=False: None)
    monkeypatch.setattr(peer_status, "_devices_or_empty", lambda dht, run_id, peers=(): {})
    [run] = peer_status.collect_status(FakeDHT(), wait_s=0)["runs"]
    assert {p["peer_id"]: p["caps"] for p in run["peers"]} == {"QmCapped": capped.caps, "QmFree": None}
    out = io.StringIO()
    peer_status.print_status({"runs": [run]}, Console(file=out, width=300))
    assert "upload 4.8/5 Mbit/s, today 1.20/2 GB" in out.getvalue()

    monitor = SwarmMonitor(FakeDHT())
    monkeypatch.setattr(monitor, "_read_devices", lambda found: None)
    monitor.poll()
    shown = {p["peer_id"]: p["caps"] for p in monitor.snapshot()["runs"][0]["peers"]}
    assert shown == {"QmCapped": "upload 4.8/5 Mbit/s, today 1.20/2 GB", "QmFree": None}
