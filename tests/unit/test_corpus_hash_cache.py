"""The corpus hash kept in the token cache (peer/train/data.py ``hash_corpus``): a restart on
unchanged files reads no text; a file whose content, size, or presence changed is read and hashed
again; files written within the racy window and a damaged cache entry are never trusted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import peer.train.data as data
from peer.train.cache import corpus_sha256
from peer.train.sources import SkippedFiles, iter_documents
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

TEXTS = {
    "a.txt": "the first document, long enough to cut a few windows from. " * 40,
    "sub/b.md": "a second one, in a subdirectory, with other words in it. " * 40,
    "e.txt": "and a third, so the training split is not empty either. " * 40,
    "f.txt": "a fourth, also trained on, with words of its own in it. " * 40,
}


def write_corpus(root: Path, texts: dict[str, str], *, age_s: float = 120.0) -> None:
    """Write ``texts`` under ``root`` with modification times ``age_s`` in the past (out of the racy window)."""
    then = time.time_ns() - int(age_s * 1e9)
    for name, text in texts.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        os.utime(path, ns=(then, then))


@pytest.fixture
def reads(monkeypatch):
    """How many passes over the corpus's documents load_corpus made (each hash or tokenization is one)."""
    counter = {"passes": 0}

    def counting(spec, skipped=None):
        counter["passes"] += 1
        return iter_documents(spec, skipped)

    monkeypatch.setattr(data, "iter_documents", counting)
    return counter


def spec_of(root: Path, **fields) -> DataSpec:
    return DataSpec(source="files", path=str(root), seq_len_tokens=16, validation_fraction=0.34, **fields)


def direct_hash(spec: DataSpec) -> str:
    return corpus_sha256(iter_documents(spec))[0]


def test_a_restart_on_unchanged_files_reads_no_text_and_gets_the_same_hash(tmp_path, reads):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS)
    spec = spec_of(root)
    first = data.load_corpus(spec, cache_dir=cache)
    assert reads["passes"] == 2  # hashed, then tokenized into the cache
    assert len(list(cache.glob("corpus-*.json"))) == 1
    again = data.load_corpus(spec, cache_dir=cache)
    assert reads["passes"] == 2  # neither hashed nor tokenized again
    assert again.corpus_sha256 == first.corpus_sha256 == direct_hash(spec)
    assert (again.corpus_bytes, again.train_files, again.validation_files) == (
        first.corpus_bytes,
        first.train_files,
        first.validation_files,
    )
    assert again.corpus_bytes == sum(len(t.encode()) for t in TEXTS.values())


@pytest.mark.parametrize(
    "change",
    ["same size, other bytes", "longer", "a file added", "a file removed", "touched, same bytes"],
)
def test_a_changed_corpus_is_read_and_hashed_again(tmp_path, reads, change):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS)
    spec = spec_of(root)
    before = data.load_corpus(spec, cache_dir=cache).corpus_sha256
    if change == "same size, other bytes":
        write_corpus(root, {"a.txt": TEXTS["a.txt"].replace("first", "FIRST")}, age_s=60)
    elif change == "longer":
        write_corpus(root, {"a.txt": TEXTS["a.txt"] + " more"}, age_s=60)
    elif change == "a file added":
        write_corpus(root, {"d.txt": "a fourth document. " * 30}, age_s=60)
    elif change == "a file removed":
        (root / "f.txt").unlink()
    else:
        write_corpus(root, {"a.txt": TEXTS["a.txt"]}, age_s=60)
    passes = reads["passes"]
    after = data.load_corpus(spec, cache_dir=cache).corpus_sha256
    assert reads["passes"] > passes  # read again
    assert after == direct_hash(spec)
    assert (after == before) == (change == "touched, same bytes")


def test_a_run_pinning_the_old_hash_refuses_the_changed_copy(tmp_path):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS)
    pinned = data.load_corpus(spec_of(root), cache_dir=cache).corpus_sha256
    data.load_corpus(spec_of(root, corpus_sha256=pinned), cache_dir=cache)  # the cached hash passes
    write_corpus(root, {"a.txt": TEXTS["a.txt"].replace("first", "FIRST")}, age_s=60)
    with pytest.raises(ConfigError, match=f"the run pins data.corpus_sha256 = {pinned}"):
        data.load_corpus(spec_of(root, corpus_sha256=pinned), cache_dir=cache)


def test_files_written_just_now_are_hashed_again_until_they_are_older_than_the_racy_window(tmp_path, reads):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS, age_s=0.0)
    spec = spec_of(root)
    skipped = SkippedFiles()
    data.hash_corpus(spec, cache, skipped)
    data.hash_corpus(spec, cache, skipped)
    assert reads["passes"] == 2 and not list(cache.glob("corpus-*.json"))
    write_corpus(root, TEXTS, age_s=data.RACY_MTIME_S + 5)
    data.hash_corpus(spec, cache, skipped)
    data.hash_corpus(spec, cache, skipped)
    assert reads["passes"] == 3


def test_a_damaged_cache_entry_is_ignored_and_replaced(tmp_path, reads):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS)
    spec = spec_of(root)
    right = data.hash_corpus(spec, cache, SkippedFiles())
    (entry,) = cache.glob("corpus-*.json")
    for damage in ("{not json", '{"format": "corpus-hash-v1"}', "[]"):
        entry.write_text(damage)
        assert data.hash_corpus(spec, cache, SkippedFiles()) == right
    assert reads["passes"] == 4
    assert data.hash_corpus(spec, cache, SkippedFiles()) == right and reads["passes"] == 4


def test_skipped_files_are_reported_from_the_cache_too(tmp_path):
    root, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(root, TEXTS)
    (root / "scan.txt").write_bytes(b"%PDF\x00\x01binary")
    then = time.time_ns() - int(120e9)
    os.utime(root / "scan.txt", ns=(then, then))
    spec = spec_of(root)
    first, again = SkippedFiles(), SkippedFiles()
    data.hash_corpus(spec, cache, first)
    data.hash_corpus(spec, cache, again)
    assert first.paths == again.paths == ["scan.txt"]
    assert again.summary(spec) == first.summary(spec)


def test_an_unwritable_cache_costs_only_the_read(tmp_path, reads):
    root = tmp_path / "corpus"
    write_corpus(root, TEXTS)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    spec = spec_of(root)
    assert data.hash_corpus(spec, blocked, SkippedFiles())[0] == direct_hash(spec)


def test_the_fingerprint_names_the_source_and_field_and_a_missing_path(tmp_path):
    root = tmp_path / "corpus"
    write_corpus(root, {"a.jsonl": '{"text": "one"}\n{"body": "two", "text": "three"}\n'})
    jsonl = DataSpec(source="jsonl", path=str(root))
    other_field = DataSpec(source="jsonl", path=str(root), text_field="body")
    assert data.source_fingerprint(jsonl)[0] != data.source_fingerprint(other_field)[0]
    with pytest.raises(ConfigError, match="does not exist"):
        data.source_fingerprint(DataSpec(source="files", path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="does not exist"):
        data.source_fingerprint(DataSpec(source="hf-dataset", path=str(tmp_path / "nowhere")))
