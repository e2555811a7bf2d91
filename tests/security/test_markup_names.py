"""Issue 51, item 1: a name from the network is never rich markup. A run named ``[/]`` made
``peer status`` exit 1 (rich's ``MarkupError``) for everyone, and ``[link=…]`` rendered an injected
hyperlink; the names reach rich as text wherever it renders them."""

from __future__ import annotations

import io

import pytest

from peer.net import dht as swarm_dht
from peer.net.devices import DeviceRecord, publish_device
from peer.net.identity import ensure_identity
from peer.status import collect_status, print_status
from protocol.manifest import RunManifest, sign_manifest
from protocol.records import ProgressRecord
from protocol.signing import OwnerKey, PeerSigner
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(60)

CLOSE_ALL = "[/]"
"""Closes a style that was never opened: rich raises ``MarkupError``."""
LINK = "[link=https://evil.example/]click[/link]"
"""Renders as a terminal hyperlink (OSC 8) to the attacker's page."""
OSC8 = "\x1b]8;"


def _console():
    from rich.console import Console

    buffer = io.StringIO()
    # a terminal with colours and hyperlinks: what markup would turn into escape sequences
    return Console(file=buffer, force_terminal=True, color_system="truecolor", width=400, soft_wrap=True), buffer


def _hostile_swarm(tmp_path, name: str) -> tuple[FakeDHT, str]:
    dht = FakeDHT()
    signed = sign_manifest(RunManifest(name=name), OwnerKey.generate())
    swarm_dht.store_manifest(dht, signed)
    signer = PeerSigner.from_identity(ensure_identity(tmp_path / "peer.key"))
    record = ProgressRecord(
        round=3, inner_step=30, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10, state_digest="a" * 32
    )
    assert swarm_dht.publish_progress(dht, signed.run_id, signer, record, ttl_s=600)
    assert publish_device(
        dht,
        signed.run_id,
        signer,
        DeviceRecord(kind="cuda", name=f"{CLOSE_ALL} {LINK}", memory_gib=80.0, capability="9.0", precision="bf16"),
    )
    return dht, signed.run_id


@pytest.mark.parametrize("name", [CLOSE_ALL, LINK, "[bold red]loud", "[/bold]"])
def test_peer_status_prints_a_hostile_run_name_as_it_is(tmp_path, name):
    dht, run_id = _hostile_swarm(tmp_path, name)
    status = collect_status(dht, wait_s=0.0)
    assert [run["name"] for run in status["runs"]] == [name]
    console, buffer = _console()
    print_status(status, console)  # before: rich.errors.MarkupError for "[/]" and "[/bold]"
    out = buffer.getvalue()
    assert f"({name})" in out  # the name as the run announced it, brackets and all
    assert f"{CLOSE_ALL} {LINK}" in out  # the device name too
    assert OSC8 not in out  # no injected hyperlink


def test_the_swarm_summary_prints_hostile_names_as_they_are():
    from peer.swarm import _print_summary

    summary = {
        "run_id": "0" * 32,
        "run_name": f"{CLOSE_ALL}{LINK}",
        "initial_eval_loss": None,
        "final_eval_loss": 3.5,
        "wall_seconds": 1.0,
        "peers": [
            {
                "name": LINK,
                "peer_id": "[/][link=x]abcdefghijk",
                "rounds_completed": 1,
                "max_group_size": 2,
                "bytes_sent": 1,
                "bytes_received": 1,
                "tokens_per_s": 1.0,
                "final_eval_loss": 3.5,
                "exit_code": 0,
            }
        ],
    }
    console, buffer = _console()
    _print_summary(console, summary)
    out = buffer.getvalue()
    assert f"{CLOSE_ALL}{LINK}" in out and LINK in out and "[/][link=x]abcde…" in out
    assert OSC8 not in out
