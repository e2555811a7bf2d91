"""``peer data prepare SOURCE --out DIR``: a corpus of one's own cut into a run's hashed shards.

SOURCE is one of:

- a directory tree of text files (prose, markup, source code; peer/shards/text.py): each file one
  document, HTML stripped to its text, binary or non-UTF-8 files skipped and counted;
- a directory (or one file) of ``.jsonl``/``.parquet`` records with a text field: each record one
  document (a tree may mix both);
- a Hugging Face dataset, ``hf://datasets/OWNER/NAME[@REVISION]``: its record files (else its text
  files, or those ``include`` names) downloaded by huggingface_hub's ``snapshot_download`` (the
  user's token from ``HF_TOKEN`` or ``hf auth login``, resumable, into the library's cache), at the
  commit the Hub reports for REVISION (default: its main branch), which ``prepared.json`` pins.

The documents are written in a deterministic order into parquet (zstd) or JSONL shards of about
``shard_mb`` MB of text each, ``part-00000.parquet``..., each with one ``text`` column; then the
shard list ``shards.json`` (peer/shards/index.py) is written beside them. ``peer swarm --data DIR``
trains on such a directory, and the printed ``[data]`` section names it in a run manifest.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from peer.progress import TransferProgress
from peer.shards.fetch import ShardUnavailable
from peer.shards.index import INDEX_NAME, ShardIndex, hub_errors, index_directory
from peer.shards.prepare import data_section
from peer.shards.text import TreeCount, documents, is_record_file, is_text_file, list_tree
from protocol.errors import ConfigError

HUB_PREFIX = "hf://datasets/"
PREPARED_NAME = "prepared.json"
"""Where the shards came from and how they were cut, beside ``shards.json`` (not a shard: not hashed)."""
FORMATS = ("parquet", "jsonl")
SMALL_CORPUS_SHARDS = 8
"""A corpus under this many shards' worth of input is cut into about this many shards instead, so
that one shard can be held out for validation and the rest trained on."""
_PART = re.compile(r"part-\d{5}\.(parquet|jsonl)(\.tmp)?")
_REPO = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """How ``peer data prepare SOURCE`` cuts shards."""

    shard_mb: float = 64.0
    """MB (10^6 bytes) of UTF-8 text per shard; a parquet shard is smaller on disk (zstd)."""
    format: str = "parquet"
    """``parquet`` or ``jsonl``."""
    text_field: str = "text"
    """The field of the input's ``.jsonl``/``.parquet`` records that holds the text (the shards' is ``text``)."""
    hub_revision: str = ""
    """Branch, tag or commit of a Hub dataset ('' : its main branch, or the ``@REVISION`` of SOURCE)."""
    include: tuple[str, ...] = ()
    """Glob patterns of a Hub dataset's files to read (default: its .jsonl/.parquet files, else its text files)."""
    validation_shards: int = 1
    """Shards held out for validation, for the printed ``[data]`` section."""
    base_url: str = ""
    """Where the shards will be served over HTTP(S), for the printed ``[data]`` section ('' : none)."""

    def __post_init__(self) -> None:
        if not 0.001 <= self.shard_mb <= 1024:
            raise ConfigError(f"--shard-mb {self.shard_mb:g} is outside 0.001 to 1024 MB of text per shard")
        if self.format not in FORMATS:
            raise ConfigError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if not self.text_field:
            raise ConfigError("--text-field is empty: name the field of the records that holds the text")


@dataclass(frozen=True)
class Prepared:
    """What ``peer data prepare SOURCE`` read and wrote."""

    source: str
    """The source as messages name it (a path, or ``hf://datasets/OWNER/NAME@COMMIT``)."""
    out: Path
    count: TreeCount
    text_bytes: int
    """UTF-8 bytes of text written into the shards."""
    index: ShardIndex
    lines: list[str] = field(default_factory=list)
    """The ``[data]`` section of a run on these shards."""

    def summary(self) -> str:
        """The final line: what was read and written, and how to train on it."""
        skipped = f", {len(self.count.skipped):,} skipped as binary or not UTF-8" if self.count.skipped else ""
        other = f", {self.count.other:,} of other kinds left out" if self.count.other else ""
        return (
            f"read {self.count.files:,} files{skipped}{other} of {self.source}: {self.count.documents:,} documents, "
            f"{_amount(self.text_bytes)} of text, into {len(self.index.shards):,} shards "
            f"({_amount(self.index.total_bytes)}) in {self.out}; train on them with "
            f"`peer swarm --data {self.out}`, or put the [data] section above in the run manifest and "
            f"give each peer `--data {self.out}` (or serve the directory at data.base_url)"
        )


def _amount(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 1e6 else f"{size:,} bytes"


def prepare_source(source: str, out: Path, config: PrepareConfig, *, stream: TextIO | None = None) -> Prepared:
    """Cut ``source`` into shards in ``out`` and write their list (module docstring).

    Args:
        source: a directory or file path, or ``hf://datasets/OWNER/NAME[@REVISION]``.
        out: the output directory: new, empty, or holding only an earlier output of this command
            (whose shards are replaced).
        stream: where the progress bar or lines go (default: stderr).

    Returns:
        What was read and written, with the ``[data]`` section of a run on it.

    Raises:
        ConfigError: a missing source, one with no text, an output directory holding other files,
            a Hub dataset that does not exist, is gated or private without an account's token
            allowed to read it, or holds nothing to read; the shards written so far are removed.
        ShardUnavailable: the Hub could not be reached (exit 69).
    """
    out = out.expanduser().resolve()
    revision = ""
    if source.startswith(HUB_PREFIX):
        repo, _, at = source.removeprefix(HUB_PREFIX).partition("@")
        if config.hub_revision and at and at != config.hub_revision:
            raise ConfigError(f"{source} names revision {at!r} and --hub-revision {config.hub_revision!r}: give one")
        root, files, revision = download_hub(repo, at or config.hub_revision, config.include)
        other, where = 0, f"{HUB_PREFIX}{repo}@{revision}"
    else:
        root = Path(source).expanduser()
        if not root.exists():
            raise ConfigError(
                f"{source!r} does not exist: name a directory of text files, a directory of .jsonl/.parquet "
                "files, or a dataset as hf://datasets/OWNER/NAME"
            )
        files, other = list_tree(root, exclude=out)
        where = str(root)
    if not files:
        raise ConfigError(
            f"{where} holds no text, .jsonl or .parquet file ({other:,} of other kinds): "
            "name a directory that holds some"
        )
    total = sum(p.stat().st_size for p in files)
    target = int(config.shard_mb * 1e6)
    if total < SMALL_CORPUS_SHARDS * target:
        target = max(1, total // SMALL_CORPUS_SHARDS)
    _clear_out(out)
    writer = ShardWriter(out, target, config.format)
    count = TreeCount(other=other)
    progress = TransferProgress(where, total, stream=stream, verb="reading")
    done = 0
    try:
        for text, size in documents(root, files, count, text_field=config.text_field):
            if text:
                writer.add(text)
            if size:
                done += size
                progress.update(done, f"{count.documents:,} documents, {writer.written:,} shards")
        writer.close()
    except BaseException:
        writer.discard()
        raise
    finally:
        progress.close()
    if writer.written < 2:
        writer.discard()
        raise ConfigError(
            f"{where} gives {count.documents:,} document(s), {writer.text_bytes:,} bytes of text: too little for "
            "two shards (one to validate on, one to train on); add text"
        )
    index = index_directory(out)
    (out / INDEX_NAME).write_bytes(index.encode())
    record = {"source": where, "format": config.format, "shard_mb": config.shard_mb, "text_field": config.text_field}
    if revision:
        record["revision"] = revision
    (out / PREPARED_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    lines = data_section(index, base_url=config.base_url, validation_shards=config.validation_shards)
    return Prepared(where, out, count, writer.text_bytes, index, lines)


class ShardWriter:
    """Documents into numbered shard files of about ``shard_bytes`` of text each.

    A shard is written when its text reaches ``shard_bytes`` (so it holds at least one document),
    first as ``<name>.tmp``, renamed when whole.
    """

    def __init__(self, out: Path, shard_bytes: int, fmt: str):
        self.out, self.shard_bytes, self.fmt = out, shard_bytes, fmt
        self.pending: list[str] = []
        self.pending_bytes = self.text_bytes = self.written = 0

    def add(self, text: str) -> None:
        size = len(text.encode("utf-8"))
        self.pending.append(text)
        self.pending_bytes += size
        self.text_bytes += size
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def close(self) -> None:
        self._flush()

    def discard(self) -> None:
        """Remove every shard written (an incomplete output must not look like a corpus)."""
        _clear_out(self.out)

    def _flush(self) -> None:
        if not self.pending:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"part-{self.written:05d}.{self.fmt}"
        tmp = path.with_name(path.name + ".tmp")
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": pa.array(self.pending, pa.string())}), tmp, compression="zstd")
        else:
            with tmp.open("w", encoding="utf-8", newline="\n") as handle:
                for text in self.pending:
                    handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        self.written += 1
        self.pending, self.pending_bytes = [], 0


def _clear_out(out: Path) -> None:
    """Make ``out`` ready for new shards: remove an earlier output of this command there.

    Raises:
        ConfigError: ``out`` is a file, or holds anything this command did not write.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file: name a new or empty directory")
    entries = sorted(out.iterdir())
    foreign = [p.name for p in entries if not (_PART.fullmatch(p.name) or p.name in (INDEX_NAME, PREPARED_NAME))]
    if foreign:
        raise ConfigError(
            f"--out {str(out)!r} holds files this command did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): name a new or empty directory"
        )
    for path in entries:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def download_hub(repo: str, revision: str, include: tuple[str, ...]) -> tuple[Path, list[Path], str]:
    """Download the files to read of a Hub dataset (``huggingface_hub.snapshot_download``, into the
    library's cache, resumable, with the user's token; ``$HF_ENDPOINT`` names a mirror).

    Returns:
        ``(root, files, commit)``: the snapshot's directory, the files to read in it (ordered by the
        SHA-256 of their paths), the commit the Hub reported for ``revision``.

    Raises:
        ConfigError: a malformed name; no such dataset or revision; a gated or private one this
            machine's token (if any) may not read; none of its files to read.
        ShardUnavailable: the Hub did not answer (exit 69).
    """
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if not _REPO.fullmatch(repo):
        raise ConfigError(f"{HUB_PREFIX}{repo}: name a dataset as {HUB_PREFIX}OWNER/NAME[@REVISION]")
    endpoint = os.environ.get("HF_ENDPOINT")  # read now: huggingface_hub reads it once, at its import
    where = f"dataset {repo}" + (f" at {revision}" if revision else "")
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        info = HfApi(endpoint=endpoint).dataset_info(repo, revision=revision or None)
        names = [s.rfilename for s in info.siblings or []]
        chosen = _choose(names, include, where)
        folder = snapshot_download(
            repo, repo_type="dataset", revision=info.sha, allow_patterns=chosen, endpoint=endpoint
        )
    except GatedRepoError as exc:
        raise ConfigError(f"{where} is gated: accept its terms on the Hub with your account, then {login}") from exc
    except RevisionNotFoundError as exc:
        raise ConfigError(f"{where}: the Hub has no such revision; name a branch, tag or commit") from exc
    except RepositoryNotFoundError as exc:
        raise ConfigError(
            f"{where}: the Hub has no such dataset, or it is private and no token that may read it is set ({login})"
        ) from exc
    except hub_errors() as exc:
        raise ShardUnavailable(
            f"cannot download {where} from {endpoint or 'the Hub'} ({type(exc).__name__}: {exc}); run the command "
            "again to resume"
        ) from exc
    root = Path(folder)
    files = sorted(
        (root / n for n in chosen),
        key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode("utf-8")).digest(),
    )
    return root, files, str(info.sha)


def _choose(names: list[str], include: tuple[str, ...], where: str) -> list[str]:
    if include:
        chosen = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in include)]
    else:
        records = [n for n in names if is_record_file(Path(n))]
        texts = [n for n in names if is_text_file(Path(n)) and n != "README.md" and not n.startswith(".")]
        chosen = records or texts
    if not chosen:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigError(
            f"{where} holds no file to read ({shown or 'no files'})"
            + (f" matching --include {' '.join(include)}" if include else ": no .jsonl/.parquet or text files")
        )
    return sorted(chosen)
