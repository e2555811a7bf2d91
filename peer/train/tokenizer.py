"""Tokenizers: byte-level (the default: identical on every machine, nothing to fetch) and BPE.

Byte-level ids 0..255 are the bytes of UTF-8 text; 256 is BOS, 257 EOS, 258 PAD. Vocabulary size 259.
A byte-level BPE (``data.tokenizer = 'bpe'``) is a ``tokenizer.json`` named by its SHA-256, shipped
with the package or fetched, never trained at join (peer/train/bpe.py, which also picks the run's
tokenizer: ``load_tokenizer``). Both are described by a :class:`Tokenizer`, which carries the
content hash that ``data.tokenizer_sha256`` pins. Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocol.manifest import DataSpec

if TYPE_CHECKING:
    import torch

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259

_BYTES_DESCRIPTION = b"locoswarm bytes tokenizer v1: ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS, 258 PAD"


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor of ids in [0, 255]."""
    import torch

    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Text from ids; special ids are dropped and invalid UTF-8 is replaced with U+FFFD."""
    values = ids if isinstance(ids, list) else ids.tolist()
    return bytes(i for i in values if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer as the data pipeline and the model see it.

    Attributes:
        kind: 'bytes' or 'bpe'.
        vocab_size: rows of the model's embedding; every id is below it.
        bos_id, eos_id, pad_id: the special ids (EOS ends every document of a token stream).
        sha256: hex SHA-256 of the tokenizer's content (the tokenizer.json bytes for BPE), what
            ``data.tokenizer_sha256`` pins.
        encode_batch: documents (UTF-8 bytes) to one 1-D integer id array each, without specials.
        token_bytes: int64 array (vocab_size,): UTF-8 bytes each id stands for (0 for specials), for
            bits per byte.
    """

    kind: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    sha256: str
    encode_batch: Callable[[list[bytes]], list[np.ndarray]]
    token_bytes: np.ndarray

    @property
    def token_dtype(self) -> type:
        """numpy dtype of the on-disk token cache: uint16 when every id fits, else uint32."""
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32


def _bytes_encode_batch(docs: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(doc, dtype=np.uint8) for doc in docs]


def byte_tokenizer() -> Tokenizer:
    """The byte-level tokenizer (vocabulary 259)."""
    token_bytes = np.zeros(VOCAB_SIZE, dtype=np.int64)
    token_bytes[:256] = 1
    return Tokenizer(
        kind="bytes",
        vocab_size=VOCAB_SIZE,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        sha256=hashlib.sha256(_BYTES_DESCRIPTION).hexdigest(),
        encode_batch=_bytes_encode_batch,
        token_bytes=token_bytes,
    )


def vocab_size(spec: DataSpec) -> int:
    """Rows of the model's embedding for a run: 259 for 'bytes', ``data.vocab_size`` for 'bpe'.

    Known from the manifest alone, before the tokenizer is loaded (a BPE may have fewer ids than
    ``data.vocab_size``; the rest are never seen).
    """
    return VOCAB_SIZE if spec.tokenizer == "bytes" else spec.vocab_size
