"""The run manifest's [pipeline] section (issue #19): validated, absent at its defaults, refused by peers."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from peer.config import JoinConfig
from peer.reporting import Reporter
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import RunManifest, dump_toml, from_dict


def test_pipeline_fields_validated_round_tripped_and_absent_at_defaults():
    m = RunManifest().replace(
        pipeline={"stages": 2, "routing": "fastest", "activation_dtype": "fp32", "call_timeout_s": 5.0}
    )
    assert from_dict(tomllib.loads(dump_toml(m))) == m
    assert (m.pipeline.stages, m.pipeline.routing, m.pipeline.activation_dtype) == (2, "fastest", "fp32")
    # at its defaults the section stays out of the encoding: run ids from before it are unchanged
    assert "pipeline" not in dump_toml(RunManifest()) and "pipeline" not in RunManifest().to_dict()
    assert RunManifest().replace(pipeline={"stages": 1}).run_id == RunManifest().run_id
    assert RunManifest().replace(pipeline={"stages": 2}).run_id != RunManifest().run_id
    assert RunManifest().replace(pipeline={"routing": "fastest"}).run_id != RunManifest().run_id
    with pytest.raises(ManifestError, match=r"pipeline\.stages = 0"):
        from_dict({"pipeline": {"stages": 0}})
    with pytest.raises(ManifestError, match=r"pipeline\.routing = 'nearest'.*'random', 'fastest'"):
        from_dict({"pipeline": {"routing": "nearest"}})
    with pytest.raises(ManifestError, match=r"pipeline\.activation_dtype = 'fp8'"):
        from_dict({"pipeline": {"activation_dtype": "fp8"}})
    with pytest.raises(ManifestError, match=r"pipeline\.call_timeout_s = 0"):
        from_dict({"pipeline": {"call_timeout_s": 0}})
    # a stage holds whole blocks: the default model has 4
    with pytest.raises(ManifestError, match=r"pipeline\.stages = 5 .*model\.num_layers = 4"):
        from_dict({"pipeline": {"stages": 5}})
    with pytest.raises(ManifestError, match=r"unknown field\(s\) \['replicas'\] in manifest section \[pipeline\]"):
        from_dict({"pipeline": {"replicas": 2}})


def test_peer_join_refuses_pipeline_stages_with_overlap_before_any_network_work(monkeypatch, tmp_path: Path):
    import peer.node as node

    def no_network(*args, **kwargs):
        raise AssertionError("the DHT was started for a run the peer cannot train")

    monkeypatch.setattr(node, "start_dht_remembering", no_network)
    monkeypatch.setattr(node, "load_data", no_network)
    cfg = JoinConfig(
        new_run=RunManifest().replace(pipeline={"stages": 2}, sync={"overlap": "eager"}), data_dir=tmp_path
    )
    with pytest.raises(
        ConfigError,
        match=r"pipeline\.stages = 2 with sync\.overlap = 'eager'.*"
        r"use sync\.overlap = 'none'",
    ) as error:
        node.join(cfg, Reporter("json"))
    assert error.value.exit_code == 78


def test_choose_stage_flag_checkpoint_and_fewest_replicas(monkeypatch, tmp_path: Path):
    from types import SimpleNamespace

    import peer.node as node

    manifest = RunManifest().replace(pipeline={"stages": 3})
    signer = SimpleNamespace(peer_id="me")
    records = {
        node.stage_key(manifest.run_id, 0): ["a", "b"],
        node.stage_key(manifest.run_id, 1): ["c", "me"],
        node.stage_key(manifest.run_id, 2): ["d"],
    }
    monkeypatch.setattr(
        node.swarm_dht, "read_progress", lambda dht, key: [SimpleNamespace(peer_id=p) for p in records.get(key, [])]
    )
    cfg = JoinConfig(data_dir=tmp_path)
    # fewest live replicas, not counting this peer's own old record: stage 1 (1 other), ties to the lowest
    assert node.choose_stage(None, manifest, cfg, signer) == 1
    assert node.choose_stage(None, manifest, JoinConfig(data_dir=tmp_path, stage=2), signer) == 2
    assert node.choose_stage(None, manifest, JoinConfig(data_dir=tmp_path, client_mode=True), signer) == 0
    # a restarted peer goes back to the stage it holds a checkpoint of
    checkpoint = node.stage_checkpoint(cfg, manifest, 2)
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    assert node.choose_stage(None, manifest, cfg, signer) == 2
    with pytest.raises(ConfigError, match=r"--stage 3: run .* has 3 pipeline stages \(0 to 2\)"):
        node.choose_stage(None, manifest, JoinConfig(data_dir=tmp_path, stage=3), signer)
    with pytest.raises(ConfigError, match=r"--stage 1 with --client-mode"):
        node.choose_stage(None, manifest, JoinConfig(data_dir=tmp_path, stage=1, client_mode=True), signer)
