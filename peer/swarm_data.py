"""What `peer swarm` trains on: the run's data read here, once, before any process starts.

A corpus on this machine (``--data PATH``, or the run file's ``data.path``) never travels: the run is
announced with ``data.path = ""`` and its corpus named by content (``data.corpus_sha256`` of the copy
read here, or a sharded run's ``data.shards_sha256``), and each peer, a process of this launcher on
this machine, is told the path (``peer join --data PATH``). A peer joining over the network from
elsewhere passes its own copy the same way; a remote ``data.path`` stays refused (peer/net/dht.py).

The launcher's options (:class:`SwarmConfig`) are defined here, as the data steps take and return
them; peer/swarm.py imports them from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from peer.shards.index import INDEX_NAME, parse_index
from peer.train.cache import default_cache_dir
from protocol.errors import ConfigError
from protocol.manifest import RunManifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    num_peers: int = 3
    rounds: int = 10
    manifest: RunManifest = dataclasses.field(default_factory=RunManifest)
    eval_every_rounds: int = 5
    """Every k rounds one peer evaluates φ (0: each peer at its start and end only)."""
    summary_path: Path | None = None
    workdir: Path | None = None
    """Identities, checkpoints and logs; None: a temporary directory, removed at the end unless
    ``keep`` or a peer failed."""
    keep: bool = False
    threads_per_peer: int | None = None
    bootstrap_timeout_s: float = 60.0
    device: str = "auto"
    """Every peer's ``--device`` (a per-peer fact, not in the manifest)."""
    data_path: Path | None = None
    """The corpus on this machine every peer reads (``peer join --data``); None: the run's own
    ``data.path`` (a run file's), or none (python-stdlib). :func:`with_swarm_data` sets it."""

    def __post_init__(self) -> None:
        if self.num_peers < 1:
            raise ValueError(f"num_peers = {self.num_peers}: must be >= 1")
        if self.rounds < 1:
            raise ValueError(f"rounds = {self.rounds}: must be >= 1")
        stages = self.manifest.pipeline.stages
        if stages > 1 and self.num_peers < stages:
            raise ValueError(
                f"num_peers = {self.num_peers}: run {self.manifest.run_id} has {stages} pipeline stages, "
                f"so at least {stages} peers (one per stage; {2 * stages} for two replicas each)"
            )


def check_data(manifest: RunManifest):
    """Read (and cache the tokens of) the run's data, as every peer will, before any process starts:
    a whole corpus (peer/train/data.py), or a sharded run's shard list and validation shards
    (peer/shards/corpus.py; the training shards are each peer's own, fetched as it trains).

    Returns:
        The corpus (peer/train/data.py ``Corpus``).

    Raises:
        ConfigError: the data is missing or is not what the run pins (peer/train/data.py, peer/shards/).
        ShardUnavailable: no source of a sharded run holds its shard list or a validation shard (exit 69).
    """
    from peer.shards.corpus import load_data

    return load_data(manifest.data, cache_dir=default_cache_dir())


def check_data_path(data_path: Path | None) -> None:
    """Refuse a ``--data`` path that does not exist, with one line naming it, before anything starts.

    Raises:
        ConfigError: ``data_path`` does not exist.
    """
    if data_path is not None and not Path(data_path).exists():
        raise ConfigError(
            f"--data {str(data_path)!r}: no such file or directory; point --data at the corpus "
            "(a file or directory of text, .jsonl or .parquet) the local swarm should train on"
        )


def source_of(path: Path) -> str:
    """The ``data.source`` a corpus at ``path`` is read as when the run names none (python-stdlib):
    'jsonl' or 'parquet' for such a file or a directory holding only such files, else 'files'."""
    for kind in ("jsonl", "parquet"):
        if path.is_file() and path.suffix == f".{kind}":
            return kind
        if path.is_dir():
            names = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
            if names and all(p.suffix == f".{kind}" for p in names):
                return kind
    return "files"


def with_swarm_data(cfg: SwarmConfig) -> tuple[SwarmConfig, Any]:
    """Read the run's corpus here, once, and say how the swarm trains on it.

    A corpus on this machine (``cfg.data_path``, else the run's ``data.path``) is announced by content:
    the returned config's manifest has ``data.path = ""`` and (unless the run pins them already) the
    copy's ``corpus_sha256`` and ``corpus_bytes``, and its ``data_path`` is the absolute path each local peer gets as ``--data``.
    A run without a path (python-stdlib) is returned as it is. With ``--data`` and a python-stdlib run
    (a preset), the corpus replaces the standard library (``data.source`` from :func:`source_of`).

    Returns:
        ``(cfg, corpus)``: the config to run, the corpus read.

    Raises:
        ConfigError: ``--data`` does not exist; the run names its corpus by content and no ``--data``
            was given; the corpus is unreadable or not the one the run pins.
    """
    from peer.train.data import with_local_data

    manifest = cfg.manifest
    check_data_path(cfg.data_path)
    run = f"run {manifest.run_id} ({manifest.name})"
    data = manifest.data
    if data.source == "shards" or (
        cfg.data_path is not None and data.source == "python-stdlib" and shard_list_in(cfg.data_path)
    ):
        return with_sharded_data(cfg)
    if cfg.data_path is not None:
        path = Path(cfg.data_path).expanduser().resolve()
        source = source_of(path) if data.source == "python-stdlib" else data.source
        data = dataclasses.replace(data, source=source, path=str(path))
    else:
        data = with_local_data(data, None, run=run)  # a run named by content needs --data
        if data.path:
            path = Path(data.path).expanduser().resolve()
            check_data_path(path)
            data = dataclasses.replace(data, path=str(path))
    corpus = check_data(manifest.replace(data=dataclasses.asdict(data)))
    if not data.path:  # python-stdlib: every peer reads its own, nothing to pass
        return cfg, corpus
    pinned = {"path": "", "source": data.source}
    if not manifest.data.corpus_sha256:  # a run file that pins its corpus keeps its run id
        pinned.update(corpus_sha256=corpus.corpus_sha256, corpus_bytes=corpus.corpus_bytes)
    announced = manifest.replace(data=pinned)
    return dataclasses.replace(cfg, manifest=announced, data_path=Path(data.path)), corpus


def shard_list_in(path: Path) -> bool:
    """Whether ``path`` is a directory holding a shard list (``shards.json``, ``peer data prepare``)."""
    return Path(path).expanduser().is_dir() and (Path(path).expanduser() / INDEX_NAME).is_file()


def with_sharded_data(cfg: SwarmConfig) -> tuple[SwarmConfig, Any]:
    """:func:`with_swarm_data` for a sharded corpus (``data.source = "shards"``, peer/shards/).

    The shards come from a directory of this machine (``cfg.data_path``, else the run's
    ``data.path``), else from the run's ``data.base_url`` / ``data.hub_repo``; the shard list and the
    validation shards are fetched and checked here, once. A directory is never announced: the
    returned manifest has ``data.path = ""`` (its shards stay bound to the run by
    ``data.shards_sha256``) and each local peer gets the directory as ``--data``, the first source
    it reads shards from. With ``--data DIR`` and a python-stdlib run (a preset), ``DIR``'s
    ``shards.json`` (``peer data prepare --shards DIR``) makes the run a sharded one, one
    validation shard held out, the preset's tokenizer and model unchanged.

    Returns:
        ``(cfg, corpus)``: the config to run, the corpus read (its ``train`` empty, its
        ``corpus_sha256`` the shard list's hash).

    Raises:
        ConfigError: no directory and no URL or repository to fetch the shards from; a malformed
            list or one the run does not pin; a shard unreadable as parquet/jsonl.
        ShardUnavailable: no source holds the list or a validation shard (exit 69).
    """
    manifest, data = cfg.manifest, cfg.manifest.data
    where = cfg.data_path if cfg.data_path is not None else (Path(data.path) if data.path else None)
    path = None if where is None else Path(where).expanduser().resolve()
    if path is not None and cfg.data_path is None and not path.exists():
        raise ConfigError(
            f"data.path {str(path)!r} of run {manifest.run_id} ({manifest.name}) does not exist: point it (or "
            "--data) at the directory of the run's shards"
        )
    if data.source != "shards":  # --data DIR of prepared shards with a preset
        assert path is not None
        raw = (path / INDEX_NAME).read_bytes()
        listed = hashlib.sha256(raw).hexdigest()  # what a peer checks the file it fetches against
        index = parse_index(raw, expected_sha256=listed, where=str(path / INDEX_NAME))
        data = dataclasses.replace(
            data,
            source="shards",
            shards_sha256=listed,
            shard_count=len(index.shards),
            shards_bytes=index.total_bytes,
            validation_shards=1,
        )
    elif path is None and not (data.base_url or data.hub_repo):
        raise ConfigError(
            f"run {manifest.run_id} ({manifest.name}) names its shards by hash only (data.shards_sha256 = "
            f"{data.shards_sha256}) and no place this machine can fetch them from: pass --data DIR (the "
            "directory `peer data prepare --shards DIR` indexed), or set data.base_url or data.hub_repo"
        )
    local = data if path is None else dataclasses.replace(data, path=str(path))
    corpus = check_data(manifest.replace(data=dataclasses.asdict(local)))
    announced = manifest.replace(data={**dataclasses.asdict(data), "path": ""})
    return dataclasses.replace(cfg, manifest=announced, data_path=path), corpus
