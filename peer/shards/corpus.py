"""A run's data as the peer reads it: a whole corpus (peer/train/data.py) or its shards (this package).

:func:`load_data` is what ``peer join`` calls. For ``data.source = "shards"`` it fetches the shard
list (checked against ``data.shards_sha256``), the validation shards every peer evaluates on
(tokenized into one stream), and returns a :class:`~peer.train.data.Corpus` whose
``make_sampler`` starts the peer's own :class:`~peer.shards.stream.ShardSampler`; nothing of the
training shards is read before the sampler starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peer.shards.fetch import Fetcher, HttpSource, LocalSource, Source, hub_source
from peer.shards.index import INDEX_NAME, MAX_INDEX_BYTES, Shard, ShardIndex, parse_index
from peer.shards.serve import PeerSource
from peer.shards.store import ShardStore
from peer.shards.stream import ShardSampler, tokenize_file
from peer.train.bpe import load_tokenizer
from peer.train.cache import default_cache_dir
from peer.train.data import Corpus, load_corpus
from peer.train.sources import describe
from peer.train.tokenizer import Tokenizer
from protocol.errors import ConfigError
from protocol.manifest import DataSpec

logger = logging.getLogger(__name__)

DEFAULT_CACHE_GB = 20.0
"""``--data-cache-gb`` when not given: disk for shards of one run on this machine."""


def sources_of(spec: DataSpec, *, peers: list[PeerSource] | None = None) -> list[Source]:
    """The sources of a sharded run, in the order they are tried: the local directory
    (``data.path`` / ``--data``), the peers, ``data.base_url``, then ``data.hub_repo``."""
    out: list[Source] = []
    if spec.path:
        out.append(LocalSource(Path(spec.path).expanduser()))
    out += peers or []
    if spec.base_url:
        out.append(HttpSource(spec.base_url, label=spec.base_url))
    if spec.hub_repo:
        out.append(hub_source(spec.hub_repo, spec.hub_revision, endpoint=os.environ.get("HF_ENDPOINT")))
    return out


def fetch_index(spec: DataSpec, fetcher: Fetcher, store_root: Path) -> ShardIndex:
    """The run's shard list, from the first source holding the bytes ``data.shards_sha256`` names.

    Raises:
        ShardUnavailable: no source holds it (exit 69).
        ConfigError: the list is malformed, or disagrees with ``data.shard_count`` / ``data.shards_bytes``.
    """
    cached = store_root / f"index-{spec.shards_sha256}.json"
    if cached.is_file():
        data = cached.read_bytes()
    else:
        data = fetcher.fetch_bytes(INDEX_NAME, spec.shards_sha256, MAX_INDEX_BYTES, store_root / f"{INDEX_NAME}.part")
        store_root.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, cached)
    index = parse_index(data, expected_sha256=spec.shards_sha256, where=describe(spec))
    if len(index.shards) != spec.shard_count or index.total_bytes != spec.shards_bytes:
        raise ConfigError(
            f"the shard list {spec.shards_sha256[:16]}... holds {len(index.shards)} shards of {index.total_bytes:,} bytes, "
            f"the run says data.shard_count = {spec.shard_count}, data.shards_bytes = {spec.shards_bytes:,}: fix the run's [data]"
        )
    return index


def load_sharded(
    spec: DataSpec,
    *,
    cache_dir: Path | None = None,
    cache_bytes: int | None = None,
    peers: list[PeerSource] | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> Corpus:
    """The shard list, the validation stream and a sampler factory of a sharded run.

    Args:
        cache_dir: shards go to ``<cache_dir>/shards``; default: the user cache dir.
        cache_bytes: the disk cap (``--data-cache-gb``); default :data:`DEFAULT_CACHE_GB`.
        peers: peer sources (peer/shards/serve.py), tried after the local directory.
        on_refused: gets each line about a shard refused for its hash (default: a log warning).

    Raises:
        ShardUnavailable: the list or a validation shard could not be had from any source (exit 69).
        ConfigError: a malformed list, a cap below the validation shards, a shard unreadable as
            parquet/jsonl, a validation split shorter than one sequence, or a BPE run without a
            tokenizer pinned by hash.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cap = int(cache_bytes if cache_bytes is not None else DEFAULT_CACHE_GB * 1e9)
    fetcher = Fetcher(sources_of(spec, peers=peers))
    if on_refused is not None:
        fetcher.on_refused = on_refused
    store = ShardStore(cache_dir / "shards", cap)
    for peer_source in peers or []:
        peer_source.learn(None, spec.shards_sha256)  # the list itself may come from a peer
    index = fetch_index(spec, fetcher, store.root)
    for peer_source in peers or []:
        peer_source.learn(index, spec.shards_sha256)
    tokenizer = load_tokenizer(spec, cache_dir=cache_dir)  # by hash (peer/train/bpe.py): never trained at join
    parts, text_bytes = [], 0
    held_out = index.held_out(spec.validation_shards)
    for shard in held_out:
        path = store.get(shard, fetcher, pin=True)  # every peer evaluates on these: kept
        tokens, size = tokenize_file(path, shard.name, spec.text_field, tokenizer)
        parts.append(tokens)
        text_bytes += size
    validation = np.concatenate(parts)
    if validation.size < spec.seq_len_tokens + 1:
        raise ConfigError(
            f"the {len(held_out)} validation shard(s) hold {validation.size} tokens, fewer than one sequence of "
            f"{spec.seq_len_tokens + 1}: raise data.validation_shards"
        )
    training = index.training(spec.validation_shards)
    make_sampler = ShardedRun(
        training=training, index=index, store=store, fetcher=fetcher, tokenizer=tokenizer, spec=spec
    )
    return Corpus(
        train=torch.zeros(0, dtype=torch.int64),
        validation=torch.from_numpy(validation),
        train_files=len(training),
        validation_files=len(held_out),
        corpus_sha256=spec.shards_sha256,
        corpus_bytes=index.total_bytes,
        tokenizer=tokenizer,
        make_sampler=make_sampler,
    )


@dataclass
class ShardedRun:
    """What a peer of a sharded run holds: its list, store and fetcher; called, it builds the peer's
    :class:`ShardSampler` (``Corpus.make_sampler``)."""

    training: tuple[Shard, ...]
    index: ShardIndex
    store: ShardStore
    fetcher: Fetcher
    tokenizer: Tokenizer
    spec: DataSpec

    def __call__(self, *, peer_id: str, run_key: str, seq_len: int, batch_sequences: int) -> ShardSampler:
        return ShardSampler(
            self.training,
            run_key=run_key,
            peer_id=peer_id,
            store=self.store,
            fetcher=self.fetcher,
            tokenizer=self.tokenizer,
            text_field=self.spec.text_field,
            seq_len=seq_len,
            batch_sequences=batch_sequences,
        )

    @property
    def local_dir(self) -> Path | None:
        return Path(self.spec.path).expanduser() if self.spec.path else None

    def add_peer_source(self, source: PeerSource) -> None:
        """Ask ``source`` (the swarm's peers) for shards after the local directory, before HTTP."""
        source.learn(self.index, self.spec.shards_sha256)
        if source in self.fetcher.sources:
            return
        at = 1 if self.spec.path else 0
        self.fetcher.sources = [*self.fetcher.sources[:at], source, *self.fetcher.sources[at:]]


def load_data(spec: DataSpec, *, cache_dir: Path | None = None, cache_bytes: int | None = None, **kwargs) -> Corpus:
    """:func:`load_sharded` for ``data.source = "shards"``, else :func:`peer.train.data.load_corpus`."""
    if spec.source == "shards":
        return load_sharded(spec, cache_dir=cache_dir, cache_bytes=cache_bytes, **kwargs)
    return load_corpus(spec, cache_dir=cache_dir)
