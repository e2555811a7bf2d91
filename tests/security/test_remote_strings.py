"""Issue 17, item 5: strings from the network reach no terminal raw, and the monitor page renders
them as text."""

from __future__ import annotations

import json
import re

import pytest

from bootstrap.monitor import SwarmMonitor
from bootstrap.monitor_page import render_page
from peer.net import dht as swarm_dht
from protocol import keys
from protocol.errors import BadPayload, ManifestError
from protocol.manifest import RunManifest, sign_manifest
from protocol.signing import OwnerKey
from protocol.text import sanitize
from protocol.wire import allreduce as frames, state as state_frames
from tests.security.fake_dht import FakeDHT

HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07<!--<script>\u202e"
PRINTABLE_HOSTILE = "evil<!--<script>"
RUN_ID = "0123456789abcdef" * 2


def _harmless_in_a_terminal(text: str) -> bool:
    return not re.search(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", text)


def test_sanitize_strips_escape_sequences_and_keeps_the_rest():
    assert sanitize(HOSTILE) == "evil<!--<script>"
    assert sanitize("plain run-name 1") == "plain run-name 1"


def test_a_run_name_from_the_runs_index_is_harmless():
    dht = FakeDHT()
    dht.store(keys.RUNS_KEY, HOSTILE, subkey=RUN_ID)  # unsigned: not a run at all
    assert swarm_dht.list_runs(dht) == {}
    # a signed run's name is a manifest field: printable, checked where the manifest is decoded
    with pytest.raises(ManifestError, match="name"):
        RunManifest(name=HOSTILE)
    signed = sign_manifest(RunManifest(name=PRINTABLE_HOSTILE), OwnerKey.generate())
    swarm_dht.store_manifest(dht, signed)
    runs = swarm_dht.list_runs(dht)
    assert runs == {signed.run_id: PRINTABLE_HOSTILE}
    assert _harmless_in_a_terminal(runs[signed.run_id])


def test_an_abort_reason_is_harmless():
    reason = frames.parse_abort(frames.encode_abort(HOSTILE))
    assert _harmless_in_a_terminal(reason) and "evil" in reason
    with pytest.raises(BadPayload) as info:
        frames.parse_mean(frames.encode_abort(HOSTILE), expected_index=0, group_size=2)
    assert _harmless_in_a_terminal(str(info.value))


def test_field_names_a_peer_chose_are_harmless_in_errors():
    body = {"\x1b[2Jv": 1, b"bytes-key": 2, "sender": 0, "weight": 1.0, "pieces": 1}
    import msgpack

    with pytest.raises(BadPayload) as info:
        frames.parse_hello(bytes([frames.HELLO]) + msgpack.packb(body, use_bin_type=True), group_size=2)
    assert _harmless_in_a_terminal(str(info.value))
    problem = state_frames.meta_problem({"\x1b[2Jrun_id": "r", "round": 1})
    assert problem is not None and _harmless_in_a_terminal(problem)


def test_the_monitor_page_shows_a_hostile_run_name_as_text():
    dht = FakeDHT()
    swarm_dht.store_manifest(dht, sign_manifest(RunManifest(name=PRINTABLE_HOSTILE), OwnerKey.generate()))
    monitor = SwarmMonitor(dht)
    monitor.poll()
    page = render_page("locoswarm", json.dumps(monitor.snapshot()))
    embedded = page.split('<script id="initial" type="application/json">', 1)[1].split("</script>", 1)[0]
    # nothing in the data can open a comment or a tag inside the page's script elements
    assert "<" not in embedded and ">" not in embedded
    assert "<!--" not in page
    [run] = json.loads(embedded)["runs"]
    assert run["name"] == "evil<!--<script>"
