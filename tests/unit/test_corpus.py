"""Corpus sources, bad input, corpus identity, the validation split and the token cache."""

import json
import os

import numpy as np
import pytest
import torch

from peer.train import cache
from peer.train.data import is_validation, load_corpus, validation_batch
from peer.train.sources import iter_documents
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

WORDS = "the quick brown fox jumps over a lazy dog while peers average pseudo gradients".split()


def texts(n=60):
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(20 + i % 7)) + f" doc {i}." for i in range(n)]


def spec(path, source, **kw):
    return DataSpec(
        source=source, path=str(path), seq_len_tokens=8, validation_sequences=4, validation_fraction=0.2, **kw
    )


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path, column, values):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: values, "id": list(range(len(values)))}), path, row_group_size=16)
    return path


def stream_text(corpus):
    """Both splits' documents, sorted, decoded from byte-token streams (EOS = 257 ends each document)."""
    docs = []
    for stream in (corpus.train, corpus.validation):
        data = stream.to(torch.int64).numpy()
        assert data[-1] == 257
        docs += [
            bytes(part[part != 257].astype(np.uint8)).decode()
            for part in np.split(data, np.flatnonzero(data == 257) + 1)[:-1]
        ]
    return sorted(docs)


def test_every_source_yields_the_same_documents(tmp_path):
    docs = texts()
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, text in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    (folder / "notes.bin").write_bytes(b"\0\1")  # other suffixes are not part of a files corpus
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": t, "n": 1} for t in docs])
    parquet = write_parquet(tmp_path / "c.parquet", "body", docs)
    datasets = pytest.importorskip("datasets")  # the optional [hf] extra

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    sources = [
        spec(folder, "files"),
        spec(jsonl, "jsonl"),
        spec(parquet, "parquet", text_field="body"),
        spec(tmp_path / "hf", "hf-dataset"),
    ]
    for s in sources:
        got = [d.data.decode() for d in iter_documents(s)]
        assert got == docs, s.source
        corpus = load_corpus(s, cache_dir=tmp_path / "cache")
        assert corpus.train_files + corpus.validation_files == len(docs)
        assert stream_text(corpus) == sorted(docs)
    # Records are identified by their text alone: jsonl, parquet and hf-dataset are one corpus.
    hashes = {load_corpus(s, cache_dir=tmp_path / "cache").corpus_sha256 for s in sources[1:]}
    assert len(hashes) == 1


def test_jsonl_and_parquet_folders_are_read_in_path_order(tmp_path):
    docs = texts(40)
    (tmp_path / "j").mkdir()
    (tmp_path / "p").mkdir()
    for k in (1, 0):  # written out of order
        write_jsonl(tmp_path / "j" / f"part{k}.jsonl", [{"text": t} for t in docs[20 * k : 20 * k + 20]])
        write_parquet(tmp_path / "p" / f"part{k}.parquet", "text", docs[20 * k : 20 * k + 20])
    for s in (spec(tmp_path / "j", "jsonl"), spec(tmp_path / "p", "parquet")):
        assert [d.data.decode() for d in iter_documents(s)] == docs


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "does not exist"),
        ("empty", "no .txt, .md, .rst, .py files under data.path"),
        # a source of nothing but binary or non-UTF-8 files: each is skipped, and then nothing is left
        ("binary", r"holds no documents \(1 binary or non-UTF-8 file\(s\) skipped\)"),
        ("latin1", r"holds no documents \(1 binary or non-UTF-8 file\(s\) skipped\)"),
        ("jsonl-not-json", r"c.jsonl:2 is not JSON"),
        ("jsonl-no-field", r"c.jsonl:1 has no string field 'text'"),
        ("parquet-no-column", r"has no column 'text' \(columns: body, id\)"),
        ("parquet-corrupt", "is not a readable parquet file"),
        ("hf-not-saved", "is not a dataset saved with save_to_disk"),
        ("hf-no-column", r"has no column 'text' \(columns: body\)"),
    ],
)
def test_bad_input_is_one_clear_config_error(tmp_path, case, match):
    folder = tmp_path / "d"
    folder.mkdir()
    source, path = "files", folder
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "binary":
        (folder / "a.txt").write_bytes(b"text\0\x01\x02")
    elif case == "latin1":
        (folder / "a.txt").write_bytes("café".encode("latin-1"))
    elif case.startswith("jsonl"):
        source, path = "jsonl", tmp_path / "c.jsonl"
        path.write_text('{"text": "ok"}\n{not json\n' if case == "jsonl-not-json" else '{"body": "x"}\n')
    elif case == "parquet-no-column":
        source, path = "parquet", write_parquet(tmp_path / "c.parquet", "body", ["x"])
    elif case == "parquet-corrupt":
        source, path = "parquet", tmp_path / "c.parquet"
        path.write_bytes(b"not parquet at all")
    elif case.startswith("hf"):
        datasets = pytest.importorskip("datasets")  # the optional [hf] extra

        source, path = "hf-dataset", folder
        if case == "hf-no-column":
            datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(folder))
    with pytest.raises(ConfigError, match=match) as info:
        load_corpus(spec(path, source), cache_dir=tmp_path / "cache")
    assert str(path.name) in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("tokens-*"))


def test_corpus_hash_is_content_identity_and_a_pinned_hash_is_enforced(tmp_path):
    docs = texts()
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t, "extra": 1} for t in docs])  # same texts: same corpus
    c = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in docs[:-1] + [docs[-1] + "!"]])
    ha, hb, hc = (load_corpus(spec(p, "jsonl"), cache_dir=tmp_path / "cache").corpus_sha256 for p in (a, b, c))
    assert ha == hb != hc and len(ha) == 64
    assert load_corpus(spec(a, "jsonl", corpus_sha256=ha), cache_dir=tmp_path / "cache").corpus_sha256 == ha
    with pytest.raises(ConfigError) as info:
        load_corpus(spec(c, "jsonl", corpus_sha256=ha), cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert hc in message and ha in message and "c.jsonl" in message and "use the run's corpus" in message


def test_validation_split_is_by_document_hash_and_the_same_everywhere(tmp_path):
    docs = texts(200)
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in reversed(docs)])  # another order
    s = spec(a, "jsonl")
    held_out = {d.data for d in iter_documents(s) if is_validation(d.name, s.validation_fraction)}
    assert held_out == {
        d.data for d in iter_documents(spec(b, "jsonl")) if is_validation(d.name, s.validation_fraction)
    }
    assert 0.1 < len(held_out) / len(docs) < 0.3
    one = load_corpus(s, cache_dir=tmp_path / "peer1")
    two = load_corpus(s, cache_dir=tmp_path / "peer2")  # another machine: its own cache
    assert torch.equal(validation_batch(one, s), validation_batch(two, s))
    assert torch.equal(one.train, two.train) and one.validation_files == len(held_out)


def test_the_token_cache_is_reused_and_a_killed_write_leaves_nothing_valid(tmp_path, monkeypatch):
    s = spec(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts()]), "jsonl")
    first = load_corpus(s, cache_dir=tmp_path / "cache")
    files = sorted(p.name.split(".", 1)[1] for p in (tmp_path / "cache").iterdir())
    assert files == ["json", "train.bin", "validation.bin"]  # no temporary file left over
    assert first.train.dtype == torch.uint16

    def boom(*args, **kwargs):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr("peer.train.data.write_token_cache", boom)
    again = load_corpus(s, cache_dir=tmp_path / "cache")
    assert torch.equal(first.train, again.train) and torch.equal(first.validation, again.validation)
    monkeypatch.undo()

    # A write killed half-way (here: the tokenizer fails on the 2nd batch) leaves no file behind.
    killed = tmp_path / "killed"

    def encode_then_die(docs, calls=[]):  # noqa: B006 (the call count persists on purpose)
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return [np.frombuffer(d, np.uint8) for d in docs]

    monkeypatch.setattr(cache, "_CHUNK_BYTES", 64)
    with pytest.raises(KeyboardInterrupt):
        cache.write_token_cache(
            killed,
            "tokens-x",
            iter_documents(s),
            is_validation=lambda n: False,
            encode_batch=encode_then_die,
            eos_id=257,
            dtype=np.uint16,
            corpus="c",
            tokenizer="t",
        )
    assert list(killed.iterdir()) == []
    # A cache whose stream lost its tail (a torn copy) is not taken for valid: it is rebuilt.
    expected = first.train.clone()  # first maps the file that is now torn in place
    key = next((tmp_path / "cache").glob("*.train.bin"))
    os.truncate(key, key.stat().st_size - 2)
    assert cache.load_token_cache(tmp_path / "cache", key.name.removesuffix(".train.bin")) is None
    assert torch.equal(load_corpus(s, cache_dir=tmp_path / "cache").train, expected)
