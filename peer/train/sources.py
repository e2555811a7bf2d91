"""The documents of a corpus, streamed one at a time from the source a run's ``[data]`` section names.

Every source yields :class:`Document` values in a deterministic order (files sorted by relative path,
records in file order), so every machine with the same corpus sees the same sequence and computes
the same corpus hash. Nothing holds more than one file's text (or one record batch) in memory.

Sources: ``python-stdlib`` (the interpreter's own ``.py`` files, read as raw bytes as they always
were), ``files`` (text files), ``jsonl``, ``parquet`` (read with pyarrow, batch by batch) and
``hf-dataset`` (a dataset saved with ``datasets``' ``save_to_disk``; nothing is downloaded).
Bad input raises :class:`~protocol.errors.ConfigError` naming the file, line or column and what to do,
except a binary or non-UTF-8 file of a ``files`` or ``jsonl`` source: that file is skipped (a stray
PDF named ``*.txt`` must not stop a volunteer, nor be trained on) and counted in
:class:`SkippedFiles`, which the caller logs once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import ConfigError, NotText
from protocol.manifest import DataSpec

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SUFFIXES = {"python-stdlib": (".py",), "files": TEXT_SUFFIXES, "jsonl": (".jsonl",), "parquet": (".parquet",)}
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Document:
    """One document of a corpus."""

    name: str
    """What the train/validation split hashes: the relative path of a file, or the SHA-256 (hex) of a
    record's text, so a record and its duplicates always land in the same split."""
    data: bytes
    """The text as UTF-8 bytes (raw bytes for python-stdlib, whose few non-UTF-8 files are kept as they are)."""


@dataclass
class SkippedFiles:
    """The files one pass of :func:`iter_documents` skipped as binary or non-UTF-8."""

    paths: list[str] = field(default_factory=list)
    """Their paths relative to the source's root, in corpus order."""
    reasons: list[str] = field(default_factory=list)
    """Why each was skipped ('binary (holds NUL bytes)', 'not UTF-8 (byte 3)')."""

    def summary(self, spec: DataSpec) -> str:
        """One line for the log, e.g. ``skipped 2 binary or non-UTF-8 files of files at '/d' (a.txt: binary ...)``."""
        first = f"{self.paths[0]}: {self.reasons[0]}" if self.paths else ""
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return (
            f"skipped {len(self.paths)} binary or non-UTF-8 file(s) of {describe(spec)} ({first}{more}); "
            "they are not trained on"
        )


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def describe(spec: DataSpec) -> str:
    """The source and path for messages, e.g. ``jsonl at '/data/web.jsonl'``."""
    if spec.source == "shards":
        where = [f"directory {spec.path!r}"] if spec.path else []
        where += [spec.base_url] if spec.base_url else []
        where += [f"dataset {spec.hub_repo}@{spec.hub_revision[:12]}"] if spec.hub_repo else []
        return (
            f"{spec.shard_count:,} shards ({spec.shards_bytes / 1e6:,.1f} MB) from {', '.join(where + ['the peers'])}"
        )
    path = str(stdlib_root()) if spec.source == "python-stdlib" else spec.path
    return f"{spec.source} at {path!r}"


def _walk(root: Path) -> Iterator[Path]:
    """Every file under ``root`` outside the skipped directories, which are never entered (an
    interpreter's site-packages may hold 50,000 files); symlinked directories are not followed."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in names:
            yield Path(folder) / name


def list_files(spec: DataSpec) -> tuple[Path, list[Path]]:
    """Root directory and the sorted files of a file-based source (all but hf-dataset).

    Raises:
        ConfigError: the path does not exist, or the directory holds no file of the source's kind.
    """
    suffixes = _SUFFIXES[spec.source]
    if spec.source == "python-stdlib":
        root = stdlib_root()
    else:
        if not spec.path:  # never the working directory: a run named by content is read from --data
            raise ConfigError(
                f"data.path is empty for data.source = {spec.source!r}: pass --data PATH pointing at "
                "your copy of the run's corpus"
            )
        root = Path(spec.path).expanduser()
        if not root.exists():
            raise ConfigError(
                f"data.path {str(root)!r} does not exist: point it at a {'/'.join(suffixes)} "
                "file or a directory of them"
            )
    if root.is_file():
        return root.parent, [root]
    files = sorted(p for p in _walk(root) if p.suffix in suffixes and p.is_file())
    if not files:
        raise ConfigError(
            f"no {', '.join(suffixes)} files under data.path {str(root)!r}: point data.path at a "
            f"directory that holds some, or set data.source to the kind of files it holds"
        )
    return root, files


def iter_documents(spec: DataSpec, skipped: SkippedFiles | None = None) -> Iterator[Document]:
    """Stream the corpus's documents in their deterministic order. Each call starts a fresh pass.

    Args:
        skipped: collects the binary or non-UTF-8 files this pass skipped (``files`` and ``jsonl``
            sources); None: skip them silently (a later pass over the same corpus).

    Raises:
        ConfigError: a missing path, an empty directory, an unreadable file, a JSONL line that is not a
            JSON object with a string ``text_field``, a parquet file or dataset without that column.
    """
    if spec.source == "hf-dataset":
        yield from _hf_documents(spec)
        return
    root, files = list_files(spec)
    reader = {"python-stdlib": _stdlib_file, "files": _text_file, "jsonl": _jsonl_file, "parquet": _parquet_file}[
        spec.source
    ]
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            # readers decode a whole file before its first document, so a skip never splits a file
            yield from reader(path, rel, spec.text_field)
        except NotText as exc:
            if skipped is not None:
                skipped.paths.append(rel)
                skipped.reasons.append(str(exc))


def _record(text: str) -> Document:
    data = text.encode("utf-8")
    return Document(hashlib.sha256(data).hexdigest(), data)


def _stdlib_file(path: Path, rel: str, _field: str) -> Iterator[Document]:
    try:
        yield Document(rel, path.read_bytes())
    except OSError as exc:
        logger.warning("skipping unreadable corpus file %s: %s", path, exc.strerror)


def _read_utf8(path: Path, what: str) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read corpus file {str(path)!r}: {exc.strerror}") from exc
    if b"\0" in raw:
        raise NotText(f"binary (holds NUL bytes), not {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotText(f"not UTF-8 (byte {exc.start})") from exc


def _text_file(path: Path, rel: str, _field: str) -> Iterator[Document]:
    yield Document(rel, _read_utf8(path, "UTF-8 text").encode("utf-8"))


def _jsonl_file(path: Path, _rel: str, field: str) -> Iterator[Document]:
    # One file's text at a time: JSONL shards are typically tens to hundreds of MB.
    for number, line in enumerate(_read_utf8(path, "JSON lines").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number} is not JSON ({exc.msg}): fix or drop that line") from exc
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ConfigError(
                f"{path}:{number} has no string field {field!r}: set data.text_field to the key "
                "that holds the text, or fix that line"
            )
        if record[field]:
            yield _record(record[field])


def _parquet_file(path: Path, _rel: str, field: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(
            f"corpus file {str(path)!r} is not a readable parquet file ({exc}): remove it from data.path"
        ) from exc
    columns = handle.schema_arrow.names
    if field not in columns:
        raise ConfigError(
            f"parquet file {str(path)!r} has no column {field!r} (columns: {', '.join(columns)}): "
            "set data.text_field to the column that holds the text"
        )
    kind = handle.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            f"column {field!r} of parquet file {str(path)!r} holds {kind}, not strings: "
            "set data.text_field to the column that holds the text"
        )
    for batch in handle.iter_batches(batch_size=_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text:
                yield _record(text)


def _hf_documents(spec: DataSpec) -> Iterator[Document]:
    if not spec.path:
        raise ConfigError(
            "data.path is empty for data.source = 'hf-dataset': pass --data PATH pointing at your "
            "copy of the run's dataset"
        )
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise ConfigError(
            f"data.path {str(path)!r} does not exist: point it at a directory written by datasets' Dataset.save_to_disk"
        )
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError("data.source = 'hf-dataset' needs the datasets library: pip install 'locoswarm[hf]'") from exc
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(
            f"data.path {str(path)!r} is not a dataset saved with save_to_disk ({exc}): for raw "
            "files use data.source = 'jsonl', 'parquet' or 'files'"
        ) from exc
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(
                f"dataset {str(path)!r} has splits {sorted(dataset)} and no 'train': "
                "save the split to train on by itself"
            )
        dataset = dataset["train"]
    if spec.text_field not in dataset.column_names:
        raise ConfigError(
            f"dataset {str(path)!r} has no column {spec.text_field!r} (columns: "
            f"{', '.join(dataset.column_names)}): set data.text_field to the column with the text"
        )
    for batch in dataset.select_columns([spec.text_field]).iter(batch_size=_BATCH_ROWS):
        for text in batch[spec.text_field]:
            if text is not None and not isinstance(text, str):
                raise ConfigError(
                    f"column {spec.text_field!r} of dataset {str(path)!r} holds "
                    f"{type(text).__name__}, not strings: set data.text_field to the text column"
                )
            if text:
                yield _record(text)


def shard_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    """The documents of one shard file (``.parquet`` or ``.jsonl``; peer/shards/), in file order.

    Raises:
        ConfigError: the file is not readable as its kind, or lacks ``text_field``.
    """
    if name.endswith(".parquet"):
        yield from _parquet_file(path, name, text_field)
    else:
        try:
            yield from _jsonl_file(path, name, text_field)
        except NotText as exc:
            raise ConfigError(f"shard {name} is {exc}: the run's shard list names a broken file") from exc
