"""The documents of a tree of one's own files, for ``peer data prepare SOURCE`` (peer/shards/build.py).

A text file (prose, markup, source code: :data:`TEXT_SUFFIXES`) is one document; an HTML file is
stripped to its text first (:func:`html_to_text`); a ``.jsonl``/``.parquet`` file gives one document
per record (peer/train/sources.py ``shard_documents``). A binary or non-UTF-8 text file is skipped
and counted, as the ``files`` source does: a stray PDF named ``*.txt`` must not stop the command,
nor be trained on.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from peer.shards.index import SUFFIXES as RECORD_SUFFIXES
from peer.train.sources import shard_documents

HTML_SUFFIXES = (".html", ".htm", ".xhtml")
TEXT_SUFFIXES = frozenset(
    (".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".csv", ".tsv", *HTML_SUFFIXES)
    + (".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".js", ".mjs", ".jsx", ".ts")
    + (".tsx", ".rs", ".go", ".java", ".kt", ".scala", ".swift", ".cs", ".rb", ".php", ".pl", ".lua", ".r")
    + (".jl", ".hs", ".ml", ".ex", ".exs", ".erl", ".clj", ".dart", ".zig", ".nim", ".sh", ".bash", ".zsh")
    + (".fish", ".ps1", ".sql", ".css", ".scss", ".toml", ".yaml", ".yml", ".ini", ".cfg", ".proto", ".cmake")
)
"""Suffixes read as text, one document a file (matched case-insensitively)."""
TEXT_NAMES = frozenset(("Makefile", "Dockerfile", "README", "LICENSE", "COPYING", "CMakeLists.txt"))
"""Files without such a suffix read as text all the same."""
_SKIP_DIRS = frozenset(("node_modules", "__pycache__", "site-packages", "dist-packages"))
_DROP_TAGS = frozenset(("script", "style", "noscript", "template", "svg", "head"))
_BLOCK_TAGS = frozenset(
    "p div br li ul ol tr td th table h1 h2 h3 h4 h5 h6 pre blockquote section article header footer "
    "nav aside hr dd dt dl figure figcaption main title".split()
)


@dataclass
class TreeCount:
    """What one pass over a tree read and left out."""

    files: int = 0
    """Files read: text files and record files."""
    documents: int = 0
    skipped: list[str] = field(default_factory=list)
    """Text files left out as binary or non-UTF-8, each ``path: reason``."""
    other: int = 0
    """Files of other kinds (images, archives, ...), never read."""


class _TextOf(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.dropping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _DROP_TAGS:
            self.dropping += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROP_TAGS:
            self.dropping = max(0, self.dropping - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.dropping:
            self.parts.append(data)


def html_to_text(markup: str) -> str:
    """The text of an HTML page: tags gone, entities decoded, scripts, styles and the head dropped,
    block elements on their own lines, runs of blank lines and spaces collapsed."""
    parser = _TextOf()
    parser.feed(markup)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def is_text_file(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES or path.name in TEXT_NAMES


def is_record_file(path: Path) -> bool:
    return path.name.endswith(RECORD_SUFFIXES)


def list_tree(root: Path, *, exclude: Path | None = None) -> tuple[list[Path], int]:
    """The text and record files under ``root`` (a directory, or one file), and how many other files.

    Hidden files and directories, ``node_modules``, ``__pycache__`` and ``site-packages`` are never
    entered; nor is ``exclude`` (the output directory, when it lies inside the tree). Symlinked
    directories are not followed. The files come in the order of the SHA-256 of their relative paths:
    deterministic, and mixing the tree's directories across shards rather than one directory a shard.
    """
    if root.is_file():
        return ([root], 0) if is_text_file(root) or is_record_file(root) else ([], 1)
    keep, other = [], 0
    skip = exclude.resolve() if exclude is not None else None
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS and (here / d).resolve() != skip]
        for name in names:
            path = here / name
            if name.startswith(".") or not path.is_file():
                continue
            if is_text_file(path) or is_record_file(path):
                keep.append(path)
            else:
                other += 1
    keep.sort(key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode("utf-8")).digest())
    return keep, other


def documents(root: Path, files: Iterable[Path], count: TreeCount, *, text_field: str) -> Iterator[tuple[str, int]]:
    """Yield ``(text, file_bytes)`` per document of ``files`` (under ``root``), in their order, and
    count them in ``count``. ``file_bytes`` is a file's size with its last document, else 0 (for a
    progress bar); ``text`` is empty for a file that gave none (skipped, empty): only its bytes count.

    Raises:
        ConfigError: a ``.jsonl``/``.parquet`` file that is unreadable or lacks ``text_field``.
    """
    base = root if root.is_dir() else root.parent
    for path in files:
        rel = path.relative_to(base).as_posix()
        size = path.stat().st_size
        count.files += 1
        if is_record_file(path):
            pending: str | None = None
            for doc in shard_documents(path, rel, text_field):
                if pending is not None:
                    count.documents += 1
                    yield pending, 0
                pending = doc.data.decode("utf-8")
            if pending is not None:
                count.documents += 1
            yield (pending or ""), size
            continue
        text = _read_text(path, rel, count)
        if text is not None and path.suffix.lower() in HTML_SUFFIXES:
            text = html_to_text(text)
        if text and text.strip():
            count.documents += 1
        yield (text or "") if text and text.strip() else "", size


def _read_text(path: Path, rel: str, count: TreeCount) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        count.skipped.append(f"{rel}: unreadable ({exc.strerror})")
        return None
    if b"\0" in raw:
        count.skipped.append(f"{rel}: binary (holds NUL bytes)")
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        count.skipped.append(f"{rel}: not UTF-8 (byte {exc.start})")
        return None
