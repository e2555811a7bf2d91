import dataclasses

import pytest
import torch

from peer.train import tokenizer
from peer.train.data import BatchSampler, is_validation, list_files, load_corpus, peer_seed, validation_batch
from protocol.manifest import DataSpec


def test_tokenizer_round_trip():
    text = "def f(x):\n    return x * 2  # ünïcödé ✓\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert tokenizer.decode(ids) == text
    assert (
        tokenizer.decode(torch.cat([torch.tensor([tokenizer.BOS_ID]), ids, torch.tensor([tokenizer.EOS_ID])])) == text
    )


def test_split_is_deterministic_and_disjoint():
    spec = DataSpec()
    root, files = list_files(spec)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert not any("site-packages" in r for r in rel)
    val = {r for r in rel if is_validation(r, spec.validation_fraction)}
    val_again = {r for r in rel if is_validation(r, spec.validation_fraction)}
    train = set(rel) - val
    assert val == val_again
    assert val and train and not (val & train)
    assert 0.01 < len(val) / len(rel) < 0.15  # about validation_fraction = 0.05


def test_corpus_and_fixed_validation_subset():
    spec = DataSpec(seq_len_tokens=32, validation_sequences=8)
    corpus = load_corpus(spec)
    assert corpus.train.numel() > 1_000_000 and corpus.validation.numel() > 10_000
    # Byte tokens as ever: the first training file's bytes, then EOS.
    root, files = list_files(spec)
    first = next(
        f
        for f in files
        if not is_validation(f.relative_to(root).as_posix(), spec.validation_fraction) and f.stat().st_size
    )
    raw = torch.tensor(list(first.read_bytes()) + [tokenizer.EOS_ID])
    assert torch.equal(corpus.train[: raw.numel()].to(torch.int64), raw)
    assert corpus.tokenizer.vocab_size == tokenizer.VOCAB_SIZE and len(corpus.corpus_sha256) == 64
    a, b = validation_batch(corpus, spec), validation_batch(corpus, spec)
    assert a.shape == (8, 33) and torch.equal(a, b)


def test_peers_sample_different_shards():
    stream = torch.arange(10_000, dtype=torch.int16)
    a = BatchSampler(stream, seq_len=16, batch_sequences=4, seed=peer_seed("peerA")).next_batch()
    b = BatchSampler(stream, seq_len=16, batch_sequences=4, seed=peer_seed("peerB")).next_batch()
    a2 = BatchSampler(stream, seq_len=16, batch_sequences=4, seed=peer_seed("peerA")).next_batch()
    assert a.shape == (4, 17) and not torch.equal(a, b) and torch.equal(a, a2)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous windows


def test_a_restored_sampler_continues_where_the_saved_one_stopped():
    stream = torch.arange(10_000, dtype=torch.int16)

    def sampler(seed=peer_seed("peerA")):  # noqa: B008 (an int, computed once)
        return BatchSampler(stream, seq_len=16, batch_sequences=4, seed=seed)

    uninterrupted, saved = sampler(), sampler()
    for _ in range(7):
        uninterrupted.next_batch()
        saved.next_batch()
    state = saved.state()
    saved.next_batch()  # drawing on after the save does not move the saved state
    restarted = sampler()
    restarted.load_state(state)
    assert restarted.batches_drawn == state.batches_drawn == 7
    expected = uninterrupted.next_batch()
    assert torch.equal(restarted.next_batch(), expected)
    assert not torch.equal(sampler().next_batch(), expected)  # a fresh one would replay batch 1 instead
    assert restarted.batches_drawn == 8


def test_a_sampler_refuses_another_seeds_or_a_malformed_state():
    stream = torch.arange(1_000, dtype=torch.int16)
    a = BatchSampler(stream, seq_len=8, batch_sequences=2, seed=1)
    b = BatchSampler(stream, seq_len=8, batch_sequences=2, seed=2)
    b.next_batch()
    with pytest.raises(ValueError, match="seed 1, this peer samples with seed 2"):
        b.load_state(a.state())
    with pytest.raises(ValueError, match="malformed"):
        b.load_state(dataclasses.replace(b.state(), rng=torch.zeros(10, dtype=torch.uint8)))
    assert b.batches_drawn == 1  # unchanged: it goes on with its own sequence
    again = BatchSampler(stream, seq_len=8, batch_sequences=2, seed=2)
    again.next_batch()
    assert torch.equal(b.next_batch(), again.next_batch())
