import pytest

from protocol.errors import ManifestError, VersionMismatch
from protocol.manifest import RunManifest, decode, dump_toml, load_manifest
from protocol.presets import PRESETS, default_run, tiny_run
from protocol.version import PROTOCOL_VERSION


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_toml_and_msgpack_round_trip(tmp_path, name):
    manifest = PRESETS[name]()
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(manifest))
    loaded = load_manifest(path)
    assert loaded == manifest
    assert loaded.run_id == manifest.run_id
    assert decode(manifest.encode(), expected_run_id=manifest.run_id) == manifest


def test_run_id_is_stable_and_changes_with_content():
    assert default_run().run_id == RunManifest().run_id
    assert len(default_run().run_id) == 32
    assert default_run().replace(sync={"inner_steps": 21}).run_id != default_run().run_id
    assert tiny_run().run_id != default_run().run_id


def test_out_of_range_value_names_field_value_and_range(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\n[inner_optimizer]\nlr = -0.5\n')
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert "inner_optimizer.lr" in message and "-0.5" in message and "(0.0, 1.0]" in message


def test_wrong_type_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[sync]\ninner_steps = "many"\n')
    with pytest.raises(ManifestError, match=r"sync.inner_steps = 'many'.*int"):
        load_manifest(path)


def test_unknown_field_lists_allowed(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sync]\ninner_stepz = 3\n")
    with pytest.raises(ManifestError, match=r"inner_stepz.*\[sync\].*inner_steps"):
        load_manifest(path)


def test_the_old_tokenizer_section_says_where_the_tokenizer_went(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[tokenizer]\nkind = "bytes"\n')
    with pytest.raises(ManifestError, match=r"\[tokenizer\] section is gone.*data.tokenizer"):
        load_manifest(path)


def test_other_protocol_version_is_refused_naming_both(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"protocol_version = {PROTOCOL_VERSION + 1}\n")
    with pytest.raises(VersionMismatch) as info:
        load_manifest(path)
    assert str(PROTOCOL_VERSION + 1) in str(info.value) and f"speaks {PROTOCOL_VERSION}" in str(info.value)


def test_cross_field_validation():
    with pytest.raises(ManifestError, match="batch_size_tokens"):
        RunManifest().replace(inner_optimizer={"batch_size_tokens": 1000})
    with pytest.raises(ManifestError, match="hidden_size"):
        RunManifest().replace(model={"hidden_size": 130, "num_heads": 4})


def test_decode_rejects_tampered_or_garbage_payload():
    manifest = tiny_run()
    with pytest.raises(ManifestError, match="expected"):
        decode(manifest.encode(), expected_run_id=default_run().run_id)
    with pytest.raises(ManifestError):
        decode(b"\xc1not msgpack")
    with pytest.raises(ManifestError, match="64 KiB"):
        decode(b"\x00" * (1 << 17))


def test_bad_toml_syntax(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sync\n")
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(path)


def test_a_peers_uplink_is_not_part_of_a_run(tmp_path):
    # The uplink is each peer's own fact: a run file naming it is refused with the flag to use.
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\n[compression]\ncodec = "adaptive"\nuplink_mbps = 8.0\n')
    with pytest.raises(ManifestError, match="uplink-mbps"):
        load_manifest(path)
    assert "uplink" not in dump_toml(RunManifest())
