"""The sampler of a sharded run: this peer's shards, one at a time, tokenized ahead of the inner loop.

A background thread fetches the peer's next shard (peer/shards/assign.py, store.py, fetch.py),
has its hash checked, tokenizes it (every document followed by EOS) and hands the token array
over through a queue of one: while the inner loop trains on shard k, shard k + 1 is downloaded
and tokenized. A shard's tokens are cut into windows of ``seq_len + 1`` tokens starting every
``seq_len`` tokens, read in an order drawn from a generator seeded per (run, peer, shard
ordinal); a batch that runs past a shard's last window continues in the next shard.

The position, (shards consumed, windows read in the current shard, that shard's generator state),
is the :class:`~peer.train.data.SamplerState` the checkpoint keeps; :meth:`ShardSampler.load_state`
continues there, re-fetching that one shard.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peer.shards.assign import ring, shard_at, window_seed
from peer.shards.fetch import Fetcher, ShardUnavailable
from peer.shards.index import Shard
from peer.shards.store import ShardStore
from peer.train.data import SamplerState
from peer.train.sources import shard_documents
from peer.train.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ENCODE_BYTES = 4 << 20  # documents per encode_batch call


def tokenize_file(path: Path, name: str, text_field: str, tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """The token stream of one shard file (1-D, ``tokenizer.token_dtype``; each document + EOS) and
    its UTF-8 text bytes.

    Raises:
        ConfigError: the file is not readable as its kind (peer/train/sources.py ``shard_documents``).
    """
    parts: list[np.ndarray] = []
    pending: list[bytes] = []
    size = text_bytes = 0
    eos: np.ndarray = np.asarray([tokenizer.eos_id], dtype=tokenizer.token_dtype)

    def flush() -> None:
        for ids in tokenizer.encode_batch(pending):
            parts.append(np.asarray(ids, dtype=tokenizer.token_dtype))
            parts.append(eos)
        pending.clear()

    for doc in shard_documents(path, name, text_field):
        pending.append(doc.data)
        size += len(doc.data)
        text_bytes += len(doc.data)
        if size >= _ENCODE_BYTES:
            flush()
            size = 0
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=tokenizer.token_dtype)
    return tokens, text_bytes


@dataclass
class _Loaded:
    consumed: int
    shard: Shard
    tokens: torch.Tensor


class ShardSampler:
    """Batches of this peer's shards, the interface of :class:`~peer.train.data.BatchSampler`.

    Args:
        shards: the run's training shards (``ShardIndex.training``).
        run_key: the run's identity (its run id); with ``peer_id`` it decides the shards read.
        store, fetcher: where shards are kept and how they are fetched.
        text_field: the parquet column or JSON key of the text.
        seq_len, batch_sequences: the batch shape, int64 (batch_sequences, seq_len + 1).

    Errors of the loader thread (a shard no source delivers, after two retries: ShardUnavailable, exit 69; a cap too
    small: ConfigError) are raised by the :meth:`next_batch` that needs the shard.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        run_key: str,
        peer_id: str,
        store: ShardStore,
        fetcher: Fetcher,
        tokenizer: Tokenizer,
        text_field: str,
        seq_len: int,
        batch_sequences: int,
    ):
        self.ring = ring(shards, run_key)
        self.run_key, self.peer_id, self.store, self.fetcher = run_key, peer_id, store, fetcher
        self.tokenizer, self.text_field = tokenizer, text_field
        self.seq_len, self.batch_sequences = seq_len, batch_sequences
        self.seed = int.from_bytes(hashlib.sha256(f"{run_key}\0{peer_id}".encode()).digest()[:8], "big") >> 1
        self.batches_drawn = 0
        self.consumed = 0
        """Shards finished (the current one not counted)."""
        self.offset = 0
        """Windows read from the current shard."""
        self.tokens_loaded = 0
        self.current: _Loaded | None = None
        self.order = torch.zeros(0, dtype=torch.int64)
        self.generator_state = torch.Generator().get_state()
        self._start_worker(0)

    # -- the loader thread ------------------------------------------------------------------------

    def _start_worker(self, first: int) -> None:
        self._stop = threading.Event()
        self._queue: queue.Queue[_Loaded | BaseException] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(
            target=self._load_from, args=(first, self._stop, self._queue), daemon=True, name="shard-loader"
        )
        self._thread.start()

    def _load_from(self, first: int, stop: threading.Event, out: queue.Queue) -> None:
        k = first
        while not stop.is_set():
            shard = shard_at(self.ring, self.peer_id, self.run_key, k)
            try:
                path = self._get(shard, stop)
                array, _ = tokenize_file(path, shard.name, self.text_field, self.tokenizer)
            except BaseException as exc:  # handed to the training thread, which raises it
                self._put(out, exc, stop)
                return
            finally:
                self.store.unpin(shard)  # tokenized: kept for other peers until room is needed
            if not self._put(out, _Loaded(k, shard, torch.from_numpy(array)), stop):
                return
            k += 1

    def _get(self, shard: Shard, stop: threading.Event) -> Path:
        """The shard's file; a shard no source delivers is tried again after 10 and 30 s (a CDN or
        a peer down for a moment) before the error goes to the training thread."""
        for wait in (10.0, 30.0):
            try:
                return self.store.get(shard, self.fetcher, pin=True)
            except ShardUnavailable as exc:
                logger.warning("%s; trying again in %.0f s", exc, wait)
                if stop.wait(wait):
                    raise
        return self.store.get(shard, self.fetcher, pin=True)

    @staticmethod
    def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the loader thread (a download in flight finishes or fails first)."""
        self._stop.set()
        self._thread.join(timeout=60)

    # -- drawing batches -------------------------------------------------------------------------

    def _windows(self, loaded: _Loaded) -> int:
        return max(0, (loaded.tokens.numel() - 1) // self.seq_len)

    def _take_next_shard(self, expected: int) -> None:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        assert item.consumed == expected, "the loader hands shards over in order"
        self.current = item
        windows = self._windows(item)
        generator = torch.Generator().manual_seed(window_seed(self.peer_id, self.run_key, item.consumed))
        self.generator_state = generator.get_state()
        self.order = torch.randperm(windows, generator=generator) if windows else torch.zeros(0, dtype=torch.int64)
        self.tokens_loaded += item.tokens.numel()
        if not windows:
            logger.warning("shard %s holds fewer than %d tokens: skipped", item.shard.name, self.seq_len + 1)

    def next_batch(self) -> torch.Tensor:
        """An int64 tensor of shape (batch_sequences, seq_len + 1).

        Raises:
            ShardUnavailable, ConfigError: the next shard could not be had (see the class).
        """
        rows: list[torch.Tensor] = []
        while len(rows) < self.batch_sequences:
            if self.current is None:
                self._take_next_shard(self.consumed)
                continue
            assert self.current is not None
            if self.offset >= len(self.order):
                self.consumed += 1
                self.offset = 0
                self.current = None
                continue
            start = int(self.order[self.offset]) * self.seq_len
            rows.append(self.current.tokens[start : start + self.seq_len + 1])
            self.offset += 1
        self.batches_drawn += 1
        return torch.stack(rows).to(torch.int64)

    @property
    def current_shard(self) -> Shard:
        """The shard being read (or read next)."""
        return shard_at(self.ring, self.peer_id, self.run_key, self.consumed)

    def state(self) -> SamplerState:
        """The position: shards consumed, windows read in the current one, its generator state."""
        return SamplerState(
            seed=self.seed,
            batches_drawn=self.batches_drawn,
            rng=self.generator_state.clone(),
            shard=self.consumed,
            shard_offset=self.offset,
        )

    def load_state(self, state: SamplerState) -> None:
        """Continue at ``state``: its shard is fetched again and read on from its offset.

        Raises:
            ValueError: a state of another peer or run (seed), or not a sharded position; this
                sampler is left unchanged.
        """
        if state.seed != self.seed:
            raise ValueError(
                f"the data position is of seed {state.seed}, this peer reads its shards with seed {self.seed}"
            )
        if state.shard < 0 or state.shard_offset < 0 or state.batches_drawn < 0:
            raise ValueError(
                f"the data position (shard {state.shard}, offset {state.shard_offset}) is not a position in shards"
            )
        generator = torch.Generator()
        try:
            generator.set_state(state.rng.contiguous())
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"the data position's generator state is malformed ({exc})") from exc
        self.close()
        self.consumed, self.offset, self.batches_drawn = state.shard, state.shard_offset, state.batches_drawn
        self.current = None
        self._start_worker(self.consumed)
        self._take_next_shard(self.consumed)
        assert self.current is not None
        windows = self._windows(self.current)
        self.generator_state = generator.get_state()
        self.order = torch.randperm(windows, generator=generator) if windows else torch.zeros(0, dtype=torch.int64)
