"""The byte-level BPE: trained once on the operator's side (deterministic), loaded by hash and never
trained at join, the model's vocabulary, bits per byte, `peer data prepare --train-tokenizer`."""

import json
import math

import numpy as np
import pytest
import torch

from peer.train import bpe
from peer.train.data import bits_per_byte, load_corpus, validation_batch, validation_bits_per_byte
from peer.train.model import build_model, evaluate
from peer.train.tokenizer import byte_tokenizer, vocab_size
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import DataSpec, ModelSpec

TEXTS = [
    f"def step_{i}(peers, rounds={i}):\n    return sum(p.delta for p in peers) / len(peers)  # ünï {i}\n"
    for i in range(300)
]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


def spec(path, **kw):
    return DataSpec(
        source="jsonl",
        path=str(path),
        tokenizer="bpe",
        vocab_size=512,
        seq_len_tokens=8,
        validation_sequences=4,
        validation_fraction=0.1,
        **kw,
    )


def pinned(tmp_path, corpus_file, cache="cache"):
    """The run's data section naming a BPE trained on the training texts (kept in ``cache``'s store)."""
    return bpe.train_for_run(spec(corpus_file), 512, iter(TEXTS), cache_dir=tmp_path / cache)


def test_training_twice_gives_the_same_tokenizer_bytes(tmp_path, corpus_file):
    (spec_a, file_a), (spec_b, file_b) = pinned(tmp_path, corpus_file, "a"), pinned(tmp_path, corpus_file, "b")
    assert file_a.read_bytes() == file_b.read_bytes() and spec_a == spec_b
    assert file_a == tmp_path / "a" / "tokenizers" / f"{spec_a.tokenizer_sha256}.json"
    a = load_corpus(spec_a, cache_dir=tmp_path / "a")
    b = load_corpus(spec_b, cache_dir=tmp_path / "b")
    assert a.tokenizer.sha256 == spec_a.tokenizer_sha256
    assert a.tokenizer.sha256 == b.tokenizer.sha256 and a.tokenizer.sha256 != byte_tokenizer().sha256
    assert torch.equal(a.train, b.train) and torch.equal(a.validation, b.validation)
    # Fewer tokens than bytes, every id inside the vocabulary, EOS (1) after every document.
    assert a.train.dtype == torch.uint16 and int(a.train.to(torch.int64).max()) < 512
    assert a.train.numel() + a.validation.numel() < sum(len(t.encode()) for t in TEXTS) / 2
    assert int((a.train.to(torch.int64) == 1).sum() + (a.validation.to(torch.int64) == 1).sum()) == len(TEXTS)
    # Each id's byte count is exact: the stream stands for every byte of the corpus.
    token_bytes = torch.from_numpy(a.tokenizer.token_bytes)
    total = token_bytes[a.train.to(torch.int64)].sum() + token_bytes[a.validation.to(torch.int64)].sum()
    assert int(total) == sum(len(t.encode()) for t in TEXTS)


def test_a_peer_never_trains_and_needs_the_pinned_hash(tmp_path, corpus_file, monkeypatch):
    run_data, _ = pinned(tmp_path, corpus_file)

    def boom(*args, **kwargs):
        raise AssertionError("a tokenizer was trained at load")

    monkeypatch.setattr(bpe, "train_bpe", boom)
    assert load_corpus(run_data, cache_dir=tmp_path / "cache").tokenizer.sha256 == run_data.tokenizer_sha256
    with pytest.raises(ConfigError, match="needs data.tokenizer_sha256.*--train-tokenizer N"):
        load_corpus(spec(corpus_file), cache_dir=tmp_path / "cache")  # a BPE run that names none
    other = "0" * 64
    with pytest.raises(ConfigError) as info:  # held nowhere here, and no source to fetch it from
        load_corpus(spec(corpus_file, tokenizer_sha256=other), cache_dir=tmp_path / "cache")
    assert other in str(info.value) and "data.tokenizer_source" in str(info.value)


def test_the_model_vocabulary_follows_the_tokenizer(tmp_path, corpus_file):
    corpus = load_corpus(pinned(tmp_path, corpus_file)[0], cache_dir=tmp_path / "cache")
    model_spec = ModelSpec(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32, max_seq_len=16
    )
    model = build_model(model_spec, corpus.tokenizer)
    assert model.get_input_embeddings().weight.shape == (512, 16) == (vocab_size(spec(corpus_file)), 16)
    assert build_model(model_spec).get_input_embeddings().weight.shape[0] == 259
    windows = validation_batch(corpus, spec(corpus_file))
    nats = evaluate(model, windows)
    assert abs(nats - math.log(512)) < 0.5  # untrained: about uniform over the vocabulary
    bpb = validation_bits_per_byte(nats, windows, corpus.tokenizer)
    assert 0 < bpb < nats / math.log(2)  # several bytes per BPE token


def test_bits_per_byte():
    assert bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0)
    assert bits_per_byte(math.log(2), 10, 40) == pytest.approx(0.25)
    windows = torch.tensor([[104, 105, 257, 33]])  # targets: 'i', EOS, '!': two bytes
    assert validation_bits_per_byte(math.log(2), windows, byte_tokenizer()) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="num_bytes = 0"):
        bits_per_byte(1.0, 1, 0)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tokenizer": "bpe"}, "data.vocab_size = 0 is invalid"),
        ({"tokenizer": "bytes", "vocab_size": 4096}, "data.vocab_size = 4096"),
        ({"tokenizer": "wordpiece"}, "data.tokenizer = 'wordpiece'"),
        ({"corpus_sha256": "abc"}, "data.corpus_sha256 = 'abc'"),
        ({"source": "parquet"}, "data.path = '' is invalid"),
        ({"tokenizer_source": "/x/tokenizer.json"}, "data.tokenizer_source = '/x/tokenizer.json'"),
        (
            {"tokenizer": "bpe", "vocab_size": 512, "tokenizer_source": "hf://datasets/me/tok@main/tokenizer.json"},
            "COMMIT: 40 lowercase hex digits",
        ),
    ],
)
def test_manifest_validation_of_the_data_section(fields, match):
    with pytest.raises(ManifestError, match=match):
        DataSpec(**fields)


def test_peer_data_prepare_prints_the_hashes_that_pin_the_run(tmp_path, corpus_file):
    import tomllib

    from click.testing import CliRunner

    from peer.cli import main

    run = tmp_path / "run.toml"
    run.write_text(
        f'[data]\nsource = "jsonl"\npath = "{corpus_file}"\ntokenizer = "bpe"\nvocab_size = 512\n'
        "seq_len_tokens = 8\nvalidation_fraction = 0.1\n"
    )
    cache = tmp_path / "dd" / "cache"
    result = CliRunner().invoke(main, ["data", "prepare", "--run", str(run), "--cache-dir", str(cache)])
    assert result.exit_code == 78 and "--train-tokenizer" in result.output  # a BPE run names its tokenizer
    result = CliRunner().invoke(
        main, ["data", "prepare", "--run", str(run), "--cache-dir", str(cache), "--train-tokenizer", "600"]
    )
    assert result.exit_code == 0, result.output
    pins = tomllib.loads(result.output)["data"]
    assert set(pins) == {"corpus_sha256", "corpus_bytes", "tokenizer_sha256", "tokenizer", "vocab_size"}
    assert pins["vocab_size"] == 600 and (cache / "tokenizers" / f"{pins['tokenizer_sha256']}.json").is_file()
    assert pins["corpus_bytes"] == sum(
        len(json.loads(line)["text"].encode()) for line in corpus_file.read_text().splitlines() if line.strip()
    )
    assert list((tmp_path / "dd" / "cache").glob("tokens-*.train.bin"))
    lines = run.read_text().replace('tokenizer = "bpe"\nvocab_size = 512\n', "")
    run.write_text(lines + "".join(f"{k} = {json.dumps(v)}\n" for k, v in pins.items()))
    # the pinned manifest loads against the same corpus, its tokenizer from this machine's store
    assert (
        CliRunner()
        .invoke(main, ["data", "prepare", "--run", str(run), "--cache-dir", str(tmp_path / "dd" / "cache")])
        .exit_code
        == 0
    )
    corpus_file.write_text(json.dumps({"text": "another corpus " * 50}) + "\n" + corpus_file.read_text())
    result = CliRunner().invoke(
        main, ["data", "prepare", "--run", str(run), "--cache-dir", str(tmp_path / "dd" / "cache")]
    )
    # another size: refused before the hashes are compared, both sizes named
    assert result.exit_code == 78 and f"{pins['corpus_bytes']:,} (data.corpus_bytes)" in result.output, result.output
    assert "another corpus" in result.output


# long documents (a source tree's generated files run to tens of MB in one document)


class _Counting:
    """A Hugging Face tokenizer that records the characters of each encode call."""

    def __init__(self, hf):
        self.hf, self.calls = hf, []

    def encode_batch_fast(self, texts, add_special_tokens):
        self.calls.append(sum(len(t) for t in texts))
        return self.hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


def _shipped():
    from tokenizers import Tokenizer as HFTokenizer

    from peer.train.bpe import PACKAGED_DIR

    return HFTokenizer.from_file(str(PACKAGED_DIR / "stdlib-bpe-16384.json"))


def test_a_long_document_is_encoded_in_pieces_that_decode_to_it():
    from peer.train.bpe import encode_pieces

    hf = _shipped()
    line = "def f(x):\n    return x * 2  # a line of source\n"
    long = line * 200 + "no newline " * 300  # 9,900 + 3,300 characters, the tail without a newline
    short = ["a short one", "", "another\n"]
    counting = _Counting(hf)
    ids = encode_pieces(counting, [short[0], long, *short[1:]], most=1000)
    assert max(counting.calls) <= 1000 and len(counting.calls) > 10  # bounded calls, the long one cut
    assert hf.decode(ids[1].tolist()) == long  # byte-level: the pieces' ids decode to the whole text
    whole = [e.ids for e in hf.encode_batch([short[0], *short[1:]], add_special_tokens=False)]
    assert [ids[0].tolist(), ids[2].tolist(), ids[3].tolist()] == whole  # short texts as one call gives
    assert all(i.dtype == np.int64 for i in ids)
