"""A byte-level BPE trained locally, with the ``tokenizers`` library, on a run's training split.

Training is deterministic (same corpus, same ``vocab_size``, same tokenizers version: the same
tokenizer.json bytes), so peers that train their own copy get the tokenizer the run pins in
``data.tokenizer_sha256``. The result is cached as ``tokenizer-<key>.json`` and reused.
Specials come first: id 0 BOS, 1 EOS, 2 PAD; then the 256 byte symbols, then the merges.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from peer.train.cache import atomic_write
from peer.train.tokenizer import Tokenizer, byte_tokenizer
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

logger = logging.getLogger(__name__)

SPECIALS = ("<bos>", "<eos>", "<pad>")
_FORMAT = "bpe-v1"


def cache_name(spec: DataSpec, corpus_sha256: str) -> str:
    """File name of the BPE for this corpus, vocabulary and split (the split decides the training text)."""
    key = f"{_FORMAT}:{corpus_sha256}:{spec.vocab_size}:{spec.validation_fraction!r}"
    return f"tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def train_bpe(texts: Iterator[str], vocab_size: int):
    """Train a byte-level BPE (a ``tokenizers.Tokenizer``) on ``texts``; deterministic for equal input."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def from_json(text: str, *, vocab_size: int) -> Tokenizer:
    """A :class:`Tokenizer` from tokenizer.json text; its hash is the SHA-256 of that text's UTF-8 bytes.

    Raises:
        ConfigError: the JSON is not a tokenizer of this layout, or has more than ``vocab_size`` ids.
    """
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises its own untyped Exception
        raise ConfigError(f"cached tokenizer is not valid tokenizer.json ({exc}): delete it to retrain") from exc
    if hf.get_vocab_size() > vocab_size or [hf.token_to_id(s) for s in SPECIALS] != [0, 1, 2]:
        raise ConfigError(
            f"cached tokenizer has {hf.get_vocab_size()} ids or other specials than {SPECIALS}, "
            f"data.vocab_size = {vocab_size}: delete it to retrain"
        )
    token_bytes = np.zeros(vocab_size, dtype=np.int64)
    for token, index in hf.get_vocab().items():
        # Every character of a byte-level token stands for exactly one byte.
        token_bytes[index] = 0 if token in SPECIALS else len(token)

    def encode_batch(docs: list[bytes]) -> list[np.ndarray]:
        texts = [doc.decode("utf-8", errors="replace") for doc in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in hf.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(
        kind="bpe",
        vocab_size=vocab_size,
        bos_id=0,
        eos_id=1,
        pad_id=2,
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        encode_batch=encode_batch,
        token_bytes=token_bytes,
    )


def load_or_train_bpe(
    spec: DataSpec, *, cache_dir: Path, corpus_sha256: str, train_texts: Callable[[], Iterator[str]]
) -> Tokenizer:
    """The cached BPE of this corpus, or a new one trained on ``train_texts()`` and cached atomically."""
    path = cache_dir / cache_name(spec, corpus_sha256)
    if not path.exists():
        logger.info("training a %d-id byte-level BPE on the training split (once per corpus)", spec.vocab_size)
        text = train_bpe(train_texts(), spec.vocab_size).to_str()
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return from_json(path.read_text(encoding="utf-8"), vocab_size=spec.vocab_size)


def load_tokenizer(
    spec: DataSpec, *, cache_dir: Path, corpus_sha256: str, train_texts: Callable[[], Iterator[str]]
) -> Tokenizer:
    """The run's tokenizer: byte-level, or the BPE of this corpus (from the cache, else trained and cached).

    Args:
        cache_dir: where a trained BPE is kept (``tokenizer-*.json``) and found again.
        corpus_sha256: the corpus's content hash; part of the cached BPE's name.
        train_texts: starts a fresh pass over the training split's documents (only called to train).

    Raises:
        ConfigError: ``data.tokenizer_sha256`` is set and the tokenizer hashes otherwise.
    """
    if spec.tokenizer == "bytes":
        tokenizer = byte_tokenizer()
    else:
        tokenizer = load_or_train_bpe(spec, cache_dir=cache_dir, corpus_sha256=corpus_sha256, train_texts=train_texts)
    if spec.tokenizer_sha256 and tokenizer.sha256 != spec.tokenizer_sha256:
        raise ConfigError(
            f"the {spec.tokenizer} tokenizer built here hashes to {tokenizer.sha256}, the run pins "
            f"data.tokenizer_sha256 = {spec.tokenizer_sha256}: use the run's corpus and the tokenizers "
            "version it was prepared with (`peer data prepare` prints both hashes)"
        )
    return tokenizer
