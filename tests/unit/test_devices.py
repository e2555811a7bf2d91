"""peer/net/devices.py: each peer's device record, its validation, and where it is shown
(`peer status`, the monitor). Issue #14 item 1: the device is a per-peer fact the swarm can see."""

from __future__ import annotations

import io

import pytest
from hivemind.utils import get_dht_time
from rich.console import Console

from bootstrap.monitor import SwarmMonitor
from peer import status as peer_status
from peer.net import devices, dht as swarm_dht
from peer.net.devices import DeviceRecord, publish_device, read_devices
from peer.net.identity import ensure_identity
from protocol.errors import BadPayload
from protocol.records import ProgressRecord
from protocol.signing import REJECTED, PeerSigner
from tests.security.fake_dht import FakeDHT

RTX = DeviceRecord(
    kind="cuda", name="NVIDIA GeForce RTX 3060", memory_gib=11.76, capability="8.6", precision="bf16", ranks=1
)
RUN = "4" * 32


@pytest.fixture(scope="module")
def signers(tmp_path_factory):
    base = tmp_path_factory.mktemp("ids")
    return [PeerSigner.from_identity(ensure_identity(base / f"{n}.key")) for n in ("gpu", "cpu", "evil")]


def test_the_record_of_a_started_event_describes_the_card():
    fields = dict(
        device="cuda:0",
        ranks=1,
        device_name="NVIDIA GeForce RTX 3060",
        device_memory_gib=11.76,
        compute_capability="8.6",
        precision="bf16",
        compile=True,
        peak_tflops=101.0,
    )
    assert DeviceRecord.from_event(fields) == RTX
    assert RTX.describe() == "cuda NVIDIA GeForce RTX 3060 11.8 GiB sm 8.6 bf16"
    two = DeviceRecord.from_event(dict(fields, device="cuda:0,cuda:1", ranks=2))
    assert two.describe().startswith("2× cuda ")
    cpu = DeviceRecord.from_event(
        dict(device="cpu", device_name="x86_64", device_memory_gib=None, compute_capability=None, precision="fp32")
    )
    assert cpu.describe() == "cpu x86_64 fp32"
    assert DeviceRecord.from_wire(RTX.to_wire()) == RTX


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "tpu"),
        ("precision", "fp8"),
        ("memory_gib", float("inf")),
        ("memory_gib", -1.0),
        ("memory_gib", 1e9),
        ("memory_gib", True),
        ("capability", "8.6; rm -rf"),
        ("capability", 86),
        ("ranks", 0),
        ("ranks", 10**6),
        ("ranks", 1.5),
        ("name", b"bytes"),
    ],
)
def test_a_record_with_a_bad_field_is_refused_naming_it(field, value):
    with pytest.raises(BadPayload, match=field):
        DeviceRecord.from_wire(dict(RTX.to_wire(), **{field: value}))


def test_a_record_with_missing_or_extra_fields_is_refused():
    wire = RTX.to_wire()
    with pytest.raises(BadPayload, match="fields"):
        DeviceRecord.from_wire({k: v for k, v in wire.items() if k != "ranks"})
    with pytest.raises(BadPayload, match="fields"):
        DeviceRecord.from_wire(dict(wire, extra=1))
    with pytest.raises(BadPayload, match="map"):
        DeviceRecord.from_wire([1, 2])


def test_a_hostile_name_is_stripped_and_cut():
    record = DeviceRecord.from_wire(dict(RTX.to_wire(), name="\x1b[2J\x1b]0;pwned\x07GPU" + "x" * 500))
    assert "\x1b" not in record.name and "\x07" not in record.name
    assert record.name.startswith("GPU") and len(record.name) <= devices.MAX_NAME_CHARS


def test_records_are_read_only_when_signed_by_the_peer_they_describe(signers):
    gpu, cpu, evil = signers
    dht = FakeDHT()
    assert publish_device(dht, RUN, gpu, RTX)
    cpu_record = DeviceRecord(kind="cpu", name="x86_64", memory_gib=None, capability=None, precision="fp32")
    assert publish_device(dht, RUN, cpu, cpu_record)
    key, expiration = devices.devices_key(RUN), get_dht_time() + 60
    # the attacker's signature over a claim for the cpu peer's subkey: replaced, then ignored and counted
    dht.store(key, evil.seal(key, expiration, dict(RTX.to_wire(), name="H100 x 8")), expiration, subkey=cpu.peer_id)
    before = REJECTED.counts["devices"]
    assert read_devices(dht, RUN) == {gpu.peer_id: RTX}
    assert REJECTED.counts["devices"] == before + 1


def test_peer_status_shows_each_peers_device(signers, monkeypatch):
    gpu, cpu, _ = signers
    dht = FakeDHT()
    publish_device(dht, RUN, gpu, RTX)
    record = ProgressRecord(round=2, inner_step=20, train_loss=3.0, tokens_per_s=500.0, group_size=2, bytes_sent=1)
    items = [swarm_dht.PeerProgress(p.peer_id, record, get_dht_time() + 60) for p in (gpu, cpu)]
    monkeypatch.setattr(swarm_dht, "list_runs", lambda dht: {RUN: "r"})
    monkeypatch.setattr(swarm_dht, "read_progress", lambda dht, run_id: items)
    monkeypatch.setattr(swarm_dht, "fetch_manifest", lambda dht, run_id: None)
    [run] = peer_status.collect_status(dht, wait_s=0)["runs"]
    by_id = {p["peer_id"]: p for p in run["peers"]}
    assert by_id[gpu.peer_id]["device"] == RTX.to_wire() and by_id[cpu.peer_id]["device"] is None
    out = io.StringIO()
    peer_status.print_status({"runs": [run]}, Console(file=out, width=300))
    assert "RTX 3060" in out.getvalue() and "bf16" in out.getvalue()


def test_the_monitor_shows_each_peers_device(signers, monkeypatch):
    gpu, _, _ = signers
    dht = FakeDHT()
    publish_device(dht, RUN, gpu, RTX)
    record = ProgressRecord(round=1, inner_step=10, train_loss=3.0, tokens_per_s=500.0, group_size=1, bytes_sent=0)
    items = [swarm_dht.PeerProgress(gpu.peer_id, record, get_dht_time() + 60)]
    monkeypatch.setattr(swarm_dht, "list_runs", lambda dht: {RUN: "r"})
    monkeypatch.setattr(swarm_dht, "read_progress", lambda dht, run_id: items)
    monkeypatch.setattr(swarm_dht, "fetch_manifest", lambda dht, run_id, allow_data_path=False: None)
    monitor = SwarmMonitor(dht)
    monitor.poll()
    [peer] = monitor.snapshot()["runs"][0]["peers"]
    assert peer["device"] == RTX.describe()
