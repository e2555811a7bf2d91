"""Corpus, train/validation split, and each peer's random shard of training windows.

The default corpus is the source of the running interpreter's standard library (DESIGN.md):
every machine that runs the client has it. Files are split into train and validation by a
hash of their relative path, so the split is the same on every machine and run. Each file's
bytes are followed by EOS and concatenated into one uint8 stream per split.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from peer.train.tokenizer import EOS_ID
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

logger = logging.getLogger(__name__)

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(spec: DataSpec) -> tuple[Path, list[Path]]:
    """Root directory and the sorted text files of the corpus the data spec names.

    Raises:
        ConfigError: the path does not exist or holds no text files.
    """
    if spec.source == "python-stdlib":
        root, suffixes = stdlib_root(), (".py",)
    else:
        root, suffixes = Path(spec.path).expanduser(), _TEXT_SUFFIXES
        if not root.exists():
            raise ConfigError(f"data.path {str(root)!r} does not exist: point it at a text file or directory")
    if root.is_file():
        return root.parent, [root]
    files = sorted(
        p for p in root.rglob("*")
        if p.suffix in suffixes and p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    if not files:
        raise ConfigError(f"no text files ({', '.join(suffixes)}) under data path {str(root)!r}")
    return root, files


def is_validation(relative_path: str, fraction: float) -> bool:
    """Deterministic split: a file is held out when the hash of its relative path falls below ``fraction``."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _read_text(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.suffix == ".jsonl":
        texts = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                texts.append(record["text"])
        return "\n\n".join(texts).encode("utf-8")
    return raw


@dataclass(frozen=True)
class Corpus:
    """Token streams of the two splits: 1-D int16 tensors (bytes 0-255 and EOS = 257)."""

    train: torch.Tensor
    validation: torch.Tensor
    train_files: int
    validation_files: int


def load_corpus(spec: DataSpec) -> Corpus:
    """Read the corpus and split it. Takes a second or two for the standard library (~2,000 files).

    Raises:
        ConfigError: no files, or a split too small to cut one sequence from.
    """
    root, files = list_files(spec)
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            parts[is_validation(rel, spec.validation_fraction)].append(_read_text(path))
        except OSError as exc:
            logger.warning("skipping unreadable corpus file %s: %s", path, exc.strerror)
    streams = {}
    for is_val, chunks in parts.items():
        # EOS (257) does not fit uint8: keep the stream as int16 to hold it.
        pieces = []
        for chunk in chunks:
            if not chunk:
                continue
            pieces.append(torch.frombuffer(bytearray(chunk), dtype=torch.uint8).to(torch.int16))
            pieces.append(torch.tensor([EOS_ID], dtype=torch.int16))
        streams[is_val] = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int16)
    need = spec.seq_len_tokens + 1
    for is_val, name in ((False, "train"), (True, "validation")):
        if streams[is_val].numel() < need:
            raise ConfigError(
                f"the {name} split of the corpus has {streams[is_val].numel()} tokens, fewer than one "
                f"sequence of {need}: use more text or change data.validation_fraction"
            )
    return Corpus(train=streams[False], validation=streams[True],
                  train_files=len(parts[False]), validation_files=len(parts[True]))


def peer_seed(peer_id: str, salt: int = 0) -> int:
    """A 63-bit RNG seed derived from a peer id, so each peer samples its own shard."""
    return int.from_bytes(hashlib.sha256(f"{peer_id}:{salt}".encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class SamplerState:
    """Where a :class:`BatchSampler` stands in its shard, for checkpoints."""

    seed: int
    """The seed the sampler started from (:func:`peer_seed`); a state only fits a sampler of the same seed."""
    batches_drawn: int
    """Batches drawn since the seed."""
    rng: torch.Tensor
    """The generator's state after those draws: 1-D uint8 (``torch.Generator.get_state``)."""


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from the train stream: this peer's shard.

    Its position (:meth:`state`) goes into the checkpoint, so a restarted peer continues its
    sequence of batches instead of replaying the ones it already trained on.

    Args:
        stream: 1-D int16 token stream.
        seq_len: tokens per training sequence (inputs); targets are shifted by one.
        batch_sequences: sequences per batch.
        seed: RNG seed (see :func:`peer_seed`).
    """

    def __init__(self, stream: torch.Tensor, *, seq_len: int, batch_sequences: int, seed: int):
        self.stream, self.seq_len, self.batch_sequences = stream, seq_len, batch_sequences
        self.seed, self.batches_drawn = seed, 0
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        """An int64 tensor of shape (batch_sequences, seq_len + 1)."""
        high = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (self.batch_sequences,), generator=self.generator)
        self.batches_drawn += 1
        offsets = torch.arange(self.seq_len + 1)
        return self.stream[starts[:, None] + offsets[None, :]].to(torch.int64)

    def state(self) -> SamplerState:
        """This sampler's position (a copy: later draws do not change it)."""
        return SamplerState(seed=self.seed, batches_drawn=self.batches_drawn, rng=self.generator.get_state())

    def load_state(self, state: SamplerState) -> None:
        """Continue from ``state``: the next batch is the one the saved sampler would have drawn next.

        Raises:
            ValueError: the state is of another seed (another peer's shard) or its generator state
                is malformed; this sampler is left unchanged.
        """
        if state.seed != self.seed:
            raise ValueError(f"the data position is of seed {state.seed}, this peer samples with seed {self.seed}")
        if state.batches_drawn < 0:
            raise ValueError(f"batches_drawn = {state.batches_drawn} is negative")
        generator = torch.Generator()
        try:
            generator.set_state(state.rng.contiguous())
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"the data position's generator state is malformed ({exc})") from exc
        self.generator, self.batches_drawn = generator, state.batches_drawn


def validation_batch(corpus: Corpus, spec: DataSpec) -> torch.Tensor:
    """The fixed validation subset: ``validation_sequences`` windows evenly spaced over the split.

    Returns an int64 tensor of shape (validation_sequences, seq_len_tokens + 1), identical for
    every peer of a run on the same interpreter version.
    """
    stream, width = corpus.validation, spec.seq_len_tokens + 1
    high = stream.numel() - width
    starts = torch.linspace(0, high, spec.validation_sequences).round().to(torch.int64)
    return stream[starts[:, None] + torch.arange(width)[None, :]].to(torch.int64)
