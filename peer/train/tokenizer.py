"""Byte-level tokenizer: identical on every machine, nothing to download.

Ids 0..255 are the bytes of UTF-8 text; 256 is BOS, 257 EOS, 258 PAD. Vocabulary size 259.
"""

from __future__ import annotations

import torch

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor of ids in [0, 255]."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Text from ids; special ids are dropped and invalid UTF-8 is replaced with U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(i for i in values if 0 <= i < 256).decode("utf-8", errors="replace")
