"""Getting one shard file onto this machine, from the first source that delivers its exact bytes.

Sources, tried in order: a local directory (``--data`` / ``data.path``), the peers of the swarm
(peer/shards/serve.py), an HTTP(S) base URL (``data.base_url``), a Hugging Face dataset repository
at a pinned commit (``data.hub_repo`` at ``data.hub_revision``; ``$HF_ENDPOINT`` points the client
at a mirror). The Hub's files come through huggingface_hub (the user's token, its retries and
resumption: :class:`HubSource`); other HTTP downloads go through the standard library (urllib): a
download cut mid-way leaves ``<name>.part`` and the next attempt asks for the rest with an HTTP
Range request. The peers
keep each holder's bytes apart, in ``<name>.part.<holder>`` (serve.py ``holder_part``), and hand
over only a file that hashes right; partial files of holders left by an earlier process are removed
once the shard is had or given up. Every file is hashed before it is renamed into place, only when
its SHA-256 and size are the list's; a file that differs is refused with its name, source and hash,
and the next source tried.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import http.client
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from peer.shards.index import Shard, hub_errors
from protocol.errors import NetworkError
from protocol.text import sanitize

logger = logging.getLogger(__name__)

_BLOCK = 1 << 20
TIMEOUT_S = 30.0
"""Seconds an HTTP connection or read may stall before the source counts as failed."""


class ShardUnavailable(NetworkError):
    """No source delivered a shard (or the shard list) with the bytes the run names."""

    exit_code = 69  # sysexits EX_UNAVAILABLE, as BootstrapUnreachable


class Source(Protocol):
    """A place shards can be had from."""

    @property
    def label(self) -> str:
        """How messages name it."""
        ...

    def fetch(self, name: str, part: Path, size: int) -> None:
        """Write the file ``name`` to ``part`` (appending when ``part`` holds a prefix of it).

        Raises:
            OSError (urllib.error.URLError included), ValueError: the source failed; ``part`` may
            hold a prefix of the file, kept for a resumed attempt.
        """
        ...


@dataclass(frozen=True)
class LocalSource:
    """A directory holding the shards under their names (``peer join --data``)."""

    root: Path
    label: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", f"directory {str(self.root)!r}")

    def fetch(self, name: str, part: Path, size: int) -> None:
        src = self.root / name
        if not src.is_file():
            raise FileNotFoundError(f"no file {name} there")
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
        shutil.copyfile(src, part)


@dataclass(frozen=True)
class HttpSource:
    """Files under a base URL: ``<base>/<name>`` (a CDN, a web server, a hub's resolve URL)."""

    base: str
    label: str = ""

    def url(self, name: str) -> str:
        return self.base.rstrip("/") + "/" + urllib.parse.quote(name)

    def fetch(self, name: str, part: Path, size: int) -> None:
        http_get(self.url(name), part, size)


@dataclass(frozen=True)
class HubSource:
    """The files of a Hugging Face dataset repository at a pinned commit, downloaded by
    huggingface_hub's ``hf_hub_download``: it sends this machine's token (``HF_TOKEN``, ``hf auth
    login``), so a gated or private repository the user may read works, retries, and resumes a cut
    download from its ``.incomplete`` file on the next attempt.

    The download goes to a staging folder beside ``part`` (``.hub/``, the library's ``local_dir``
    mode), not the library's shared cache, and is then renamed onto ``part``: the shard cache's
    ``--data-cache-gb`` cap stays the only disk a run's shards take.
    """

    repo: str
    revision: str
    endpoint: str | None = None
    label: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", f"dataset {self.repo}@{self.revision[:12]}")

    def fetch(self, name: str, part: Path, size: int) -> None:
        from huggingface_hub import hf_hub_download

        staging = part.parent / ".hub" / self.repo.replace("/", "--") / self.revision
        try:
            got = Path(
                hf_hub_download(
                    self.repo,
                    name,
                    repo_type="dataset",
                    revision=self.revision,
                    endpoint=self.endpoint,
                    local_dir=staging,
                )
            )
        except hub_errors() as exc:
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        if got.stat().st_size > size:
            got.unlink()
            raise OSError(f"{name} holds more than the list's {size:,} bytes")
        os.replace(got, part)


def hub_source(repo: str, revision: str, *, endpoint: str | None = None) -> HubSource:
    """A dataset repository at a pinned commit as a source (``$HF_ENDPOINT`` when ``endpoint`` is None)."""
    return HubSource(repo, revision, endpoint or os.environ.get("HF_ENDPOINT"))


def http_get(url: str, part: Path, size: int) -> None:
    """Download ``url`` into ``part``, continuing after the bytes ``part`` already holds (Range).

    Raises:
        OSError: connection failed, an HTTP error status, more bytes than ``size``, or a server
            that ignored the Range of a resumed download (``part`` is then restarted next time).
    """
    have = part.stat().st_size if part.exists() else 0
    if have >= size:
        have = 0
        part.unlink(missing_ok=True)
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)  # http(s) only: DataSpec checks base_url
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} for {url}") from exc
    except http.client.HTTPException as exc:
        raise OSError(f"{url}: {type(exc).__name__}") from exc
    try:
        _write_body(response, part, have, size, url)
    except http.client.HTTPException as exc:  # IncompleteRead: the connection was cut mid-body
        raise OSError(f"download of {url} cut ({type(exc).__name__})") from exc


def _write_body(response, part: Path, have: int, size: int, url: str) -> None:
    with response:
        if have and response.status != 206:
            have = 0  # the server sent the whole file: start over
        with part.open("r+b" if have else "wb") as out:
            out.seek(have)
            out.truncate()
            written = have
            length = response.headers.get("Content-Length")
            expected = have + int(length) if length and length.isdigit() else None
            while block := response.read(_BLOCK):
                written += len(block)
                if written > size:
                    raise OSError(f"{url} sent more than the list's {size:,} bytes")
                out.write(block)
            if expected is not None and written < expected:  # the connection closed mid-body
                raise OSError(f"download of {url} cut after {written:,} of {expected:,} bytes")


@dataclass
class Fetcher:
    """Gets shards into a directory, trying each source in order.

    Args:
        sources: tried in this order for every shard.
        on_refused: called with a line naming a shard a source delivered with the wrong bytes.
    """

    sources: Sequence[Source]
    on_refused: Callable[[str], None] = logger.warning
    refused: list[str] = field(default_factory=list)
    """Every refusal line so far (shard, source, hash)."""

    def fetch(self, shard: Shard, dest: Path) -> str:
        """Place ``shard``'s exact bytes at ``dest``; return the label of the source that gave them.

        A source that wrote part of ``dest``'s ``.part`` file and was cut is asked once more to
        continue it (HTTP: Range); a wrong file is deleted and the next source tried. Holders' partial
        files (``.part.<holder>``) are removed when the shard is had or given up.

        Raises:
            ShardUnavailable: every source failed; names the shard and each source's failure.
        """
        part = dest.with_name(dest.name + ".part")
        failures = []
        for source in self.sources:
            for attempt in range(2):  # a cut download resumes once from the same source
                before = _size(part)
                try:
                    source.fetch(shard.name, part, shard.size)
                except (OSError, ValueError) as exc:
                    reason = f"{source.label}: {_reason(exc)}"
                    if attempt == 0 and _size(part) != before and 0 < _size(part) < shard.size:  # gave bytes, then cut
                        logger.info(
                            "shard %s cut after %d bytes (%s); resuming", shard.name, part.stat().st_size, reason
                        )
                        continue
                    failures.append(reason)
                    break
                digest, size = _hash(part)
                if digest == shard.sha256 and size == shard.size:
                    os.replace(part, dest)
                    _remove_holder_parts(part)
                    return source.label
                part.unlink(missing_ok=True)
                line = (
                    f"refused shard {shard.name} from {source.label}: {size:,} bytes hashing to {digest}, "
                    f"the run's list says {shard.size:,} bytes, {shard.sha256}; trying the next source"
                )
                self.refused.append(line)
                self.on_refused(line)
                failures.append(f"{source.label}: wrong bytes (sha256 {digest[:16]}...)")
                break
        part.unlink(missing_ok=True)
        _remove_holder_parts(part)
        tried = "; ".join(failures) if failures else "no source configured"
        raise ShardUnavailable(
            f"shard {shard.name} of the run's corpus could not be had ({tried}): check that a source is "
            "reachable (data.base_url, data.hub_repo, --data) or that peers holding it are up"
        )

    def fetch_bytes(self, name: str, sha256: str, max_bytes: int, scratch: Path) -> bytes:
        """A small file of unknown size (the shard list) checked against ``sha256``.

        Raises:
            ShardUnavailable: no source gave those bytes.
        """
        failures = []
        for source in self.sources:
            scratch.unlink(missing_ok=True)
            try:
                source.fetch(name, scratch, max_bytes)
                data = scratch.read_bytes()
            except (OSError, ValueError) as exc:
                failures.append(f"{source.label}: {_reason(exc)}")
                continue
            finally:
                scratch.unlink(missing_ok=True)
                _remove_holder_parts(scratch)
            if hashlib.sha256(data).hexdigest() == sha256:
                return data
            line = f"refused {name} from {source.label}: it hashes to {hashlib.sha256(data).hexdigest()}, the run pins {sha256}"
            self.refused.append(line)
            self.on_refused(line)
            failures.append(f"{source.label}: wrong bytes")
        tried = "; ".join(failures) if failures else "no source configured"
        raise ShardUnavailable(
            f"the run's shard list {name} (sha256 {sha256}) could not be had ({tried}): check that a source "
            "is reachable (data.base_url, data.hub_repo, --data)"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _remove_holder_parts(part: Path) -> None:
    """Remove the partial files of single holders beside ``part`` (``<part>.<holder>``)."""
    for stale in part.parent.glob(glob.escape(part.name) + ".*"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def _hash(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return f"cannot connect ({sanitize(str(exc.reason), max_chars=120)})"
    return sanitize(str(exc) or type(exc).__name__, max_chars=400)
