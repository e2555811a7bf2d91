"""Issue 17, item 5: a manifest from the network can never name a local path."""

from __future__ import annotations

import types

import pytest

from peer import node
from peer.net import dht as swarm_dht
from protocol.errors import ManifestError
from protocol.manifest import DataSpec, RunManifest, sign_manifest
from protocol.signing import OwnerKey
from tests.security.fake_dht import FakeDHT


def _announce(dht: FakeDHT, manifest: RunManifest) -> RunManifest:
    """Announce ``manifest`` signed by a key of its announcer (the attacker owns its own run)."""
    signed = sign_manifest(manifest, OwnerKey.generate())
    swarm_dht.store_manifest(dht, signed)
    return signed.manifest


def test_a_joiner_refuses_a_data_path_named_by_the_network(tmp_path):
    private = tmp_path / "home" / "volunteer"
    private.mkdir(parents=True)
    (private / "diary.txt").write_text("private")
    dht = FakeDHT()
    attacker_run = _announce(dht, RunManifest(name="default", data=DataSpec(source="files", path=str(private))))
    # what `peer join` without --run does (peer/node.py: the run chosen from the swarm's index)
    cfg = types.SimpleNamespace(
        new_run=None,
        manifest_wait_s=0.0,
        run_flag="--run/--preset",
        run_id=None,
        start_new_run=False,
        data_dir=tmp_path / "data",
        owner_key_path=None,
        initial_peers=[],
    )
    reporter = types.SimpleNamespace(emit=lambda *args, **fields: None)
    with pytest.raises(ManifestError) as info:
        node._find_run(dht, cfg, reporter)
    message = str(info.value)
    assert "data.path" in message and "--run" in message and "\n" not in message
    with pytest.raises(ManifestError):
        swarm_dht.fetch_manifest(dht, attacker_run.run_id)


def test_a_manifest_without_a_path_is_still_joined_and_the_monitor_may_show_one_with_a_path():
    dht = FakeDHT()
    honest = _announce(dht, RunManifest(name="stdlib"))
    assert swarm_dht.fetch_manifest(dht, honest.run_id) == honest
    with_path = _announce(dht, RunManifest(name="files", data=DataSpec(source="files", path="/data/corpus")))
    assert swarm_dht.fetch_manifest(dht, with_path.run_id, allow_data_path=True) == with_path
