"""A tokenizer named by the SHA-256 of its tokenizer.json (issue #52 item 3): the shipped one the
llama-* presets pin, a file path as the source, a copy whose bytes differ refused with both hashes,
the run id of a run without a source unchanged."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import sysconfig
import tomllib
from pathlib import Path

import pytest

from peer.train import bpe
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import DataSpec, dump_toml, load_manifest
from protocol.presets import PRESETS, STDLIB_BPE_16384_SHA256, default_run, tiny_run

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"def round_{i}(delta, peers={i}):\n    return delta / peers  # averaged, ünï {i}\n" for i in range(200)]
TEXT = "def outer_step(phi, delta):\n    return phi - 0.7 * delta  # Nesterov, ünï\n"


def trained(vocab: int = 512, texts: list[str] = TEXTS) -> bytes:
    return bpe.train_bpe(iter(texts), vocab).to_str().encode("utf-8")


def bpe_spec(**kw) -> DataSpec:
    return DataSpec(tokenizer="bpe", vocab_size=512, **kw)


def test_every_llama_preset_pins_the_shipped_tokenizer_and_loads_it_with_nothing_to_fetch(tmp_path):
    llama = [name for name in PRESETS if name.startswith("llama-")]
    assert llama and all(PRESETS[n]().data.tokenizer_sha256 == STDLIB_BPE_16384_SHA256 for n in llama)
    assert all(PRESETS[n]().data.tokenizer == "bytes" for n in PRESETS if n not in llama)
    assert set(bpe.packaged_tokenizers()) == {STDLIB_BPE_16384_SHA256}
    tok = bpe.load_tokenizer(PRESETS["llama-125m"]().data, cache_dir=tmp_path / "empty")
    assert tok.sha256 == STDLIB_BPE_16384_SHA256 and tok.vocab_size == 16384
    assert not (tmp_path / "empty").exists()  # neither stored nor fetched: read from the package
    (ids,) = tok.encode_batch([TEXT.encode()])
    assert len(ids) < len(TEXT.encode()) / 2 and ids.max() < 16384
    assert int(tok.token_bytes[ids].sum()) == len(TEXT.encode())  # each id's bytes, exactly


def test_the_package_data_ships_the_tokenizer_files():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = [p.relative_to(ROOT / "peer").as_posix() for p in bpe.PACKAGED_DIR.glob("*.json")]
    assert len(shipped) == 2 and all(any(fnmatch.fnmatch(f, pat) for pat in package_data["peer"]) for f in shipped)


def test_the_shipped_tokenizer_is_what_its_provenance_names():
    path = bpe.packaged_tokenizers()[STDLIB_BPE_16384_SHA256]
    provenance = json.loads(path.with_name(path.stem + ".provenance.json").read_text())
    assert provenance["sha256"] == STDLIB_BPE_16384_SHA256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert provenance["vocab_size"] == 16384 and len(provenance["files"]) > 100
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f["name"] for f in provenance["files"]]
    here = [hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "" for f in files]
    if here != [f["sha256"] for f in provenance["files"]]:
        pytest.skip("this interpreter's standard library is not the pinned file list the tokenizer was trained on")
    import tokenizers

    if f"tokenizers {tokenizers.__version__}," not in provenance["trained_with"]:
        pytest.skip(f"tokenizers {tokenizers.__version__} is not the version the tokenizer was trained with")
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    assert trained(16384, texts) == path.read_bytes()  # the recipe the provenance names gives these bytes


def test_a_path_source_is_read_once_then_kept_in_the_store(tmp_path):
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    source = tmp_path / "published" / "tokenizer.json"
    source.parent.mkdir()
    source.write_bytes(data)
    spec = bpe_spec(tokenizer_sha256=want, tokenizer_source=str(source))
    assert bpe.load_tokenizer(spec, cache_dir=tmp_path / "cache").sha256 == want
    assert bpe.store_path(tmp_path / "cache", want).read_bytes() == data
    source.unlink()  # the source gone: the store has it
    assert bpe.load_tokenizer(spec, cache_dir=tmp_path / "cache").sha256 == want
    with pytest.raises(ConfigError, match="cannot read the tokenizer at data.tokenizer_source"):
        bpe.load_tokenizer(spec, cache_dir=tmp_path / "other-machine")


def test_a_tokenizer_whose_bytes_differ_is_refused_naming_both_hashes(tmp_path):
    data, other = trained(), trained(texts=TEXTS[:100])
    want, got = hashlib.sha256(data).hexdigest(), hashlib.sha256(other).hexdigest()
    assert want != got
    source = tmp_path / "tokenizer.json"
    source.write_bytes(other)
    with pytest.raises(ConfigError) as info:
        bpe.load_tokenizer(bpe_spec(tokenizer_sha256=want, tokenizer_source=str(source)), cache_dir=tmp_path / "c")
    assert info.value.exit_code == 78
    assert want in str(info.value) and got in str(info.value) and str(source) in str(info.value)
    assert not (tmp_path / "c" / "tokenizers").exists()  # nothing kept of a file that is not the run's


def test_a_corrupt_store_entry_is_not_used_and_the_source_is_read_again(tmp_path, caplog):
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    source = tmp_path / "tokenizer.json"
    source.write_bytes(data)
    bpe.keep(tmp_path / "cache", data)
    bpe.store_path(tmp_path / "cache", want).write_bytes(data[:-10])  # a disk fault, a partial copy
    spec = bpe_spec(tokenizer_sha256=want, tokenizer_source=str(source))
    assert bpe.load_tokenizer(spec, cache_dir=tmp_path / "cache").sha256 == want
    assert "does not hash to its name" in caplog.text
    assert bpe.store_path(tmp_path / "cache", want).read_bytes() == data  # repaired


def test_files_that_are_not_the_runs_tokenizer_are_refused_with_what_to_do(tmp_path):
    junk = b'{"version": "1.0", "model": "not a tokenizer"}'
    path = tmp_path / "junk.json"
    path.write_bytes(junk)
    spec = bpe_spec(tokenizer_sha256=hashlib.sha256(junk).hexdigest(), tokenizer_source=str(path))
    with pytest.raises(ConfigError, match="is not a tokenizer.json"):
        bpe.load_tokenizer(spec, cache_dir=tmp_path / "cache")
    too_big = PRESETS["llama-125m"]().data
    with pytest.raises(ConfigError, match="16,384 ids, more than data.vocab_size = 4,096.*at least 16384"):
        bpe.load_tokenizer(DataSpec(**{**too_big.__dict__, "vocab_size": 4096}), cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="the bytes tokenizer hashes to .* pins data.tokenizer_sha256 = 0000"):
        bpe.load_tokenizer(DataSpec(tokenizer_sha256="0" * 64), cache_dir=tmp_path)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tokenizer_source": "tokenizer.json"}, "with data.tokenizer = 'bytes'"),
        ({"tokenizer": "bpe", "vocab_size": 512, "tokenizer_source": "hf://datasets/me/tok/tokenizer.json"}, "COMMIT"),
        ({"tokenizer": "bpe", "vocab_size": 512, "tokenizer_source": f"hf://me/tok@{'A' * 40}/t.json"}, "COMMIT"),
        ({"tokenizer": "bpe", "vocab_size": 512, "tokenizer_source": 7}, "tokenizer_source = 7"),
    ],
)
def test_the_manifest_refuses_a_source_that_names_no_pinned_file(fields, match):
    with pytest.raises(ManifestError, match=match):
        DataSpec(**fields)


def test_a_source_is_part_of_the_run_and_a_run_without_one_keeps_its_id(tmp_path):
    assert "tokenizer_source" not in default_run().to_dict()["data"]
    assert "tokenizer_source" not in tiny_run().to_dict()["data"]
    source = f"hf://datasets/me/tokenizers@{'a' * 40}/tokenizer.json"
    run = tiny_run().replace(data={"tokenizer": "bpe", "vocab_size": 512, "tokenizer_sha256": "b" * 64})
    with_source = run.replace(data={"tokenizer_source": source})
    assert with_source.to_dict()["data"]["tokenizer_source"] == source and with_source.run_id != run.run_id
    (tmp_path / "run.toml").write_text(dump_toml(with_source))
    assert load_manifest(tmp_path / "run.toml").run_id == with_source.run_id
