"""Data that travels (issue 16, item 5): a run names its corpus by content, each volunteer reads
their own copy (``peer join --data PATH``) checked against the run's hash, and binary or non-UTF-8
files are skipped with a count in the log."""

import logging
import shutil

import pytest

from peer.train.data import load_corpus, with_local_data
from peer.train.sources import SkippedFiles, iter_documents
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import DataSpec

WORDS = "peers average pseudo gradients over a distributed hash table while volunteers come and go".split()


def write_corpus(folder, n=40):
    (folder / "sub").mkdir(parents=True)
    for i in range(n):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + i % 5)) + f" doc {i}."
        (folder / ("sub" if i % 3 == 0 else ".") / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


def spec(path="", **kw):
    return DataSpec(
        source="files", path=str(path), seq_len_tokens=8, validation_sequences=4, validation_fraction=0.2, **kw
    )


def test_binary_and_non_utf8_files_are_skipped_and_counted(tmp_path, caplog):
    clean = write_corpus(tmp_path / "clean")
    dirty = tmp_path / "dirty"
    shutil.copytree(clean, dirty)
    (dirty / "scan.txt").write_bytes(b"%PDF-1.4\0\x01\x02 binary")  # a PDF named *.txt
    (dirty / "sub" / "notes.md").write_bytes("café au lait".encode("latin-1"))
    skipped = SkippedFiles()
    names = [d.name for d in iter_documents(spec(dirty), skipped)]
    assert "scan.txt" not in names and "sub/notes.md" not in names
    assert skipped.paths == ["scan.txt", "sub/notes.md"]
    with caplog.at_level(logging.WARNING, logger="peer.train.data"):
        corpus = load_corpus(spec(dirty), cache_dir=tmp_path / "cache")
    assert corpus.skipped_files == 2
    [line] = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 2 binary or non-UTF-8 file(s)" in line and "scan.txt" in line and "\n" not in line
    # what is left is exactly the clean corpus: same hash, no skip reported
    assert load_corpus(spec(clean), cache_dir=tmp_path / "cache").corpus_sha256 == corpus.corpus_sha256


def test_a_copy_elsewhere_has_the_runs_hash_and_a_different_copy_is_refused(tmp_path):
    original = write_corpus(tmp_path / "owner" / "corpus")
    pinned = load_corpus(spec(original), cache_dir=tmp_path / "cache").corpus_sha256
    run_data = spec("", corpus_sha256=pinned)  # the run names its corpus by content, no path
    copy = tmp_path / "volunteer" / "somewhere" / "else"
    shutil.copytree(original, copy)
    mine = with_local_data(run_data, copy, run="run abc (web)")
    assert mine.path == str(copy) and mine.corpus_sha256 == pinned
    assert load_corpus(mine, cache_dir=tmp_path / "cache2").corpus_sha256 == pinned

    (copy / "000.txt").write_text("an edited document", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_corpus(with_local_data(run_data, copy, run="run abc (web)"), cache_dir=tmp_path / "cache2")
    message = str(info.value)
    assert pinned in message and str(copy) in message and "--data" in message and "\n" not in message


def test_a_copy_of_another_size_is_refused_naming_both_sizes(tmp_path):
    original = write_corpus(tmp_path / "owner" / "corpus")
    corpus = load_corpus(spec(original), cache_dir=tmp_path / "cache")
    assert corpus.corpus_bytes == sum(len(p.read_bytes()) for p in original.rglob("*") if p.is_file())
    run_data = spec("", corpus_sha256=corpus.corpus_sha256, corpus_bytes=corpus.corpus_bytes)
    copy = tmp_path / "volunteer" / "corpus"
    shutil.copytree(original, copy)
    assert (
        load_corpus(with_local_data(run_data, copy, run="run abc (web)"), cache_dir=tmp_path / "cache2").corpus_sha256
        == corpus.corpus_sha256
    )
    victim = sorted(p for p in copy.rglob("*") if p.is_file())[0]
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])  # an interrupted download
    with pytest.raises(ConfigError) as info:
        load_corpus(with_local_data(run_data, copy, run="run abc (web)"), cache_dir=tmp_path / "cache2")
    message = str(info.value)
    assert f"{corpus.corpus_bytes:,}" in message and "incomplete" in message and "\n" not in message


def test_data_flag_errors_are_one_clear_line(tmp_path):
    named = spec("", corpus_sha256="a" * 64)
    with pytest.raises(ConfigError, match=r"run abc \(web\) names its corpus by content only .*pass --data PATH"):
        with_local_data(named, None, run="run abc (web)")
    with pytest.raises(ConfigError, match=r"--data '/x' cannot be checked: run abc \(web\) pins no data.corpus_sha256"):
        with_local_data(spec(tmp_path), "/x", run="run abc (web)")
    with pytest.raises(ConfigError, match=r"--data '/x': run abc \(web\) trains on the Python standard library"):
        with_local_data(DataSpec(), "/x", run="run abc (web)")
    # a spec with an empty path never reads the working directory
    with pytest.raises(ConfigError, match="data.path is empty for data.source = 'files': pass --data PATH"):
        load_corpus(named, cache_dir=tmp_path / "cache")


def test_a_run_may_leave_the_path_empty_only_when_it_pins_the_corpus_hash():
    assert DataSpec(source="jsonl", corpus_sha256="b" * 64).path == ""
    with pytest.raises(ManifestError, match="data.path"):
        DataSpec(source="jsonl")
