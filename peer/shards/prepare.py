"""``peer data prepare --shards DIR`` / ``--hub-repo``: the operator's side of a sharded corpus (shards
already cut; ``peer data prepare SOURCE --out DIR`` cuts them first: peer/shards/build.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from peer.shards.index import INDEX_NAME, ShardIndex, index_directory, index_hub_repo
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import DataSpec
from protocol.specs import SHARD_FIELDS


def prepare_shards(
    shards_dir: Path | None, base_url: str, hub_repo: str, hub_revision: str, validation_shards: int
) -> list[str]:
    """Build the shard list, write ``shards.json`` and return the lines to print: a comment, then
    the ``[data]`` section of the run.

    The list comes from hashing every shard under ``shards_dir``, or, with ``hub_repo``, from the
    repository's listing at ``hub_revision`` (nothing downloaded; ``shards.json`` then goes to
    ``shards_dir`` or the working directory, to be uploaded beside the shards).

    Raises:
        ConfigError: no directory nor repository, an unlistable repository, fewer than two shards,
            or a field the run would refuse (a bad URL or revision); nothing is written then.
    """
    if hub_repo:
        index = index_hub_repo(hub_repo, hub_revision, endpoint=os.environ.get("HF_ENDPOINT"))
        out_dir = shards_dir or Path(".")
    elif shards_dir is not None:
        index = index_directory(shards_dir.expanduser())
        out_dir = shards_dir.expanduser()
    else:
        raise ConfigError("name the shards: --shards DIR or --hub-repo OWNER/NAME --hub-revision COMMIT")
    lines = data_section(
        index, base_url=base_url, hub_repo=hub_repo, hub_revision=hub_revision, validation_shards=validation_shards
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INDEX_NAME).write_bytes(index.encode())
    where = f"{hub_repo}@{hub_revision}" if hub_repo else str(out_dir)
    return [
        f"# {len(index.shards):,} shards, {index.total_bytes:,} bytes in {where}; list written to "
        f"{out_dir / INDEX_NAME}" + (" (upload it beside the shards)" if hub_repo else ""),
        *lines,
    ]


def data_section(
    index: ShardIndex, *, base_url: str = "", hub_repo: str = "", hub_revision: str = "", validation_shards: int = 1
) -> list[str]:
    """The ``[data]`` section of a run on ``index``'s shards, as TOML lines (the fields left at their
    defaults omitted, ``validation_shards`` always given).

    Raises:
        ConfigError: a field the run would refuse (a bad URL or revision, too few shards).
    """
    try:
        spec = DataSpec(
            source="shards",
            shards_sha256=index.sha256,
            shard_count=len(index.shards),
            shards_bytes=index.total_bytes,
            validation_shards=validation_shards,
            base_url=base_url,
            hub_repo=hub_repo,
            hub_revision=hub_revision,
        )
    except ManifestError as exc:
        raise ConfigError(f"{exc} (from the peer data prepare flags)") from exc
    lines = ["[data]", 'source = "shards"']
    values = dataclasses.asdict(spec)
    for name in SHARD_FIELDS:
        if values[name] != getattr(DataSpec, name) or name == "validation_shards":
            value = values[name]
            lines.append(f'{name} = "{value}"' if isinstance(value, str) else f"{name} = {value}")
    return lines
