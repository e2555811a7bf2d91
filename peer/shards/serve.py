"""Shards from peers: a peer serves the shard files it holds to others over a libp2p stream, the
way state download works (peer/state/serve.py, download.py): bounded frames, every byte checked
(the fetcher hashes the whole file against the run's list before it is used).

One stream per file (framing: protocol/wire/framing.py)::

    asker → holder:  REQUEST  kind 32, 32 B SHA-256, u64 offset, then the file's name (UTF-8, ≤ 1 KiB)
    holder → asker:  MISSING  kind 33                       (not held)
                     SIZE     kind 34, u64 file size, then DATA frames from ``offset`` to the end:
                     DATA     kind 35, up to 1 MiB of the file

The asker closes after the last byte. A holder answers from its shard store (by hash) or its local
directory of the corpus (by name, ``peer join --data``); an asker resumes a cut file with ``offset``.

The run's tokenizer travels the same way (peer/train/bpe.py): a REQUEST naming
:data:`TOKENIZER_NAME` is answered by hash only, from the tokenizers the holder serves (the package's
and its store's, the run's hash alone: peer/shards/share.py), never from a directory by name; the
asker takes at most :data:`MAX_TOKENIZER_BYTES` and checks the hash before it keeps anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from peer.net import pacing
from peer.shards.index import INDEX_NAME, SUFFIXES, ShardIndex
from peer.shards.store import ShardStore
from protocol.errors import BadPayload
from protocol.text import sanitize
from protocol.version import PROTOCOL_VERSION
from protocol.wire import framing

logger = logging.getLogger(__name__)

REQUEST, MISSING, SIZE, DATA = 32, 33, 34, 35
KINDS = {REQUEST: "REQUEST", MISSING: "MISSING", SIZE: "SIZE", DATA: "DATA"}
_HEAD = struct.Struct(">B32sQ")
MAX_NAME_BYTES = 1024
DATA_BYTES = 1 << 20
TIMEOUT_S = 30.0
TOKENIZER_NAME = "tokenizer.json"
"""The name a REQUEST for a tokenizer.json gives (with the file's SHA-256)."""
MAX_TOKENIZER_BYTES = 64 << 20
"""Most bytes a peer takes as a tokenizer.json (one of a 16k-id BPE is about 1 MB)."""


def protocol_name(prefix: str) -> str:
    """The libp2p protocol of shard transfers under a DHT prefix."""
    return f"{prefix}.LocoShards.v{PROTOCOL_VERSION}"


def encode_request(sha256: str, offset: int, name: str) -> bytes:
    return _HEAD.pack(REQUEST, bytes.fromhex(sha256), offset) + name.encode("utf-8")


def parse_request(payload: bytes) -> tuple[str, int, str]:
    """(sha256 hex, offset, name) of a REQUEST.

    Raises:
        BadPayload: another kind, a short payload, a name too long, not UTF-8 or not a shard file's.
    """
    if len(payload) < _HEAD.size or payload[0] != REQUEST or len(payload) > _HEAD.size + MAX_NAME_BYTES:
        raise BadPayload(f"not a shard REQUEST ({len(payload)} bytes, kind {payload[:1].hex()})")
    _, digest, offset = _HEAD.unpack_from(payload)
    try:
        name = payload[_HEAD.size :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadPayload("shard REQUEST name is not UTF-8") from exc
    if name == TOKENIZER_NAME:
        return digest.hex(), offset, name
    if not (name.endswith(SUFFIXES) or name == INDEX_NAME) or ".." in name.split("/") or name.startswith("/"):
        raise BadPayload(f"shard REQUEST names {name[:80]!r}, not a shard file")
    return digest.hex(), offset, name


def _local_file(
    store: ShardStore | None,
    local_dir: Path | None,
    sha256: str,
    name: str,
    tokenizers: Callable[[str], Path | None] | None,
) -> Path | None:
    if name == TOKENIZER_NAME:  # by hash only
        return tokenizers(sha256) if tokenizers is not None else None
    if store is None:
        return None
    held = store.holds(sha256)
    if held is not None:
        return held
    if local_dir is not None and (local_dir / name).is_file():
        return local_dir / name  # the asker checks its hash
    index = store.root / f"index-{sha256}.json"
    return index if name == INDEX_NAME and index.is_file() else None


async def serve_shard(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    store: ShardStore | None,
    local_dir: Path | None,
    *,
    tokenizers: Callable[[str], Path | None] | None = None,
    timeout: float = TIMEOUT_S,
) -> int:
    """Answer one REQUEST, then close the stream. Returns the file bytes sent.

    Args:
        store, local_dir: the shards served (None: no shard is held, every shard REQUEST is MISSING).
        tokenizers: ``tokenizers(sha256)``: the tokenizer.json file served for that hash, or None
            (not held); None: no tokenizer is served.

    Never raises for what the asker does (a malformed request, silence, disconnect): it logs and closes.
    The file's bytes go out within the peer's upload cap (peer/net/pacing.py).
    """
    writer = pacing.paced(writer)
    sent = 0
    try:
        try:
            sha256, offset, name = parse_request(
                await framing.read_frame(reader, max_bytes=_HEAD.size + MAX_NAME_BYTES, timeout=timeout)
            )
        except (TimeoutError, BadPayload, asyncio.IncompleteReadError) as exc:
            logger.info("rejected a shard request: %s", framing.describe_failure(exc))
            return 0
        path = _local_file(store, local_dir, sha256, name, tokenizers)
        if path is None:
            writer.write(framing.frame(bytes([MISSING])))
        else:
            size = path.stat().st_size
            writer.write(framing.frame(struct.pack(">BQ", SIZE, size)))
            with path.open("rb") as handle:
                handle.seek(min(offset, size))
                while block := handle.read(DATA_BYTES):
                    writer.write(framing.frame(bytes([DATA]) + block))
                    sent += len(block)
                    await asyncio.wait_for(writer.drain(), timeout)
        await asyncio.wait_for(writer.drain(), timeout)
        await asyncio.wait_for(reader.read(1), timeout)  # the asker closes first
    except (TimeoutError, ConnectionError, OSError) as exc:
        logger.info("shard stream ended after %d bytes: %s", sent, framing.describe_failure(exc))
    finally:
        await _close(writer)
    return sent


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):  # closed by the other side already, or its daemon gone
        await asyncio.wait_for(writer.wait_closed(), 5.0)


async def fetch_shard(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    sha256: str,
    name: str,
    part: Path,
    max_size: int,
    timeout: float = TIMEOUT_S,
) -> bool:
    """Ask for one file on an open stream, appending to ``part`` from its current length.

    Returns:
        False when the holder does not hold it; True when the whole file (as the holder sized it)
        is in ``part`` (its hash is the caller's check).

    Raises:
        OSError: the holder sent a size over ``max_size``, a malformed frame, or stopped early;
            ``part`` keeps what arrived, for a resumed attempt.
    """
    have = part.stat().st_size if part.exists() else 0
    try:
        writer.write(framing.frame(encode_request(sha256, have, name)))
        await asyncio.wait_for(writer.drain(), timeout)
        head = await framing.read_frame(reader, max_bytes=9, timeout=timeout)
        if framing.kind_of(head, KINDS) == MISSING:
            return False
        if head[0] != SIZE or len(head) != 9:
            raise BadPayload(f"expected SIZE, got kind {head[0]}")
        (size,) = struct.unpack(">Q", head[1:])
        if size > max_size or have > size:
            raise BadPayload(f"the holder says {size:,} bytes, the asker allows {max_size:,}")
        with part.open("ab") as out:
            while have < size:
                frame = await framing.read_frame(reader, max_bytes=1 + min(DATA_BYTES, size - have), timeout=timeout)
                if frame[0] != DATA:
                    raise BadPayload(f"expected DATA, got kind {frame[0]}")
                out.write(frame[1:])
                have += len(frame) - 1
        return True
    except (TimeoutError, BadPayload, asyncio.IncompleteReadError) as exc:
        raise OSError(framing.describe_failure(exc)) from exc
    finally:
        await _close(writer)


class PeerSource:
    """The swarm's peers as a shard source (fetch.py's Source), and of the run's tokenizer
    (:meth:`fetch_tokenizer`): each peer ``peers()`` names is asked in turn until one holds the file.

    Args:
        run: ``run(coro, timeout_s)`` runs a coroutine on the loop of ``open_stream`` and returns its result.
        open_stream: ``await open_stream(peer_id)`` gives (reader, writer) of a new stream to that peer.
        peers: the peer ids to ask, most promising first (called once per file).
    """

    label = "the peers"

    def __init__(self, run: Callable, open_stream: Callable, peers: Callable[[], list[str]], *, max_peers: int = 8):
        self._run, self._open, self._peers, self.max_peers = run, open_stream, peers, max_peers
        self.sha256_of: dict[str, str] = {}
        """Name → SHA-256 of the files the fetcher will ask for (set from the run's list)."""

    def learn(self, index: ShardIndex | None, index_sha256: str) -> None:
        """Know the hashes of the run's files: its list's, and every shard's of ``index``."""
        self.sha256_of[INDEX_NAME] = index_sha256
        if index is not None:
            self.sha256_of.update((s.name, s.sha256) for s in index.shards)

    def fetch(self, name: str, part: Path, size: int) -> None:
        sha256 = self.sha256_of.get(name)
        if sha256 is None:
            raise FileNotFoundError(f"{name} is not in the run's list")
        reasons = []
        for peer in self._peers()[: self.max_peers]:
            try:
                if self._ask(peer, sha256, name, part, size):
                    return
                reasons.append(f"{peer[:12]}…: not held")
            except Exception as exc:  # whatever the transport raises: try the next peer
                reasons.append(f"{peer[:12]}…: {sanitize(framing.describe_failure(exc), max_chars=160)}")
        raise FileNotFoundError("; ".join(reasons) or "no peer known yet")

    def fetch_tokenizer(self, sha256: str) -> bytes:
        """The bytes of the tokenizer.json whose SHA-256 is ``sha256`` from the first peer that holds
        them (peer/train/bpe.py ``AskPeers``): each of at most :attr:`max_peers` peers is asked in
        turn, at most :data:`MAX_TOKENIZER_BYTES` taken from one, through a scratch file removed after.

        A peer that sends other bytes is refused with a warning naming both hashes, and the next
        peer asked.

        Raises:
            FileNotFoundError: no peer gave those bytes; names each peer's answer (not held, an
                error, wrong bytes with their hash).
        """
        reasons = []
        with tempfile.TemporaryDirectory(prefix="locoswarm-tokenizer-") as scratch:
            part = Path(scratch) / TOKENIZER_NAME
            for peer in list(dict.fromkeys(self._peers()))[: self.max_peers]:
                part.unlink(missing_ok=True)
                try:
                    if not self._ask(peer, sha256, TOKENIZER_NAME, part, MAX_TOKENIZER_BYTES):
                        reasons.append(f"{peer[:12]}…: not held")
                        continue
                except Exception as exc:  # whatever the transport raises: try the next peer
                    reasons.append(f"{peer[:12]}…: {sanitize(framing.describe_failure(exc), max_chars=160)}")
                    continue
                data = part.read_bytes()
                got = hashlib.sha256(data).hexdigest()
                if got == sha256:
                    return data
                logger.warning(
                    "refused the tokenizer from peer %s: it hashes to %s, the run pins data.tokenizer_sha256 = %s; "
                    "asking the next peer",
                    peer,
                    got,
                    sha256,
                )
                reasons.append(f"{peer[:12]}…: wrong bytes (sha256 {got})")
        raise FileNotFoundError("; ".join(reasons) or "no peer known yet")

    def _ask(self, peer: str, sha256: str, name: str, part: Path, max_size: int) -> bool:
        async def ask() -> bool:
            reader, writer = await asyncio.wait_for(self._open(peer), TIMEOUT_S)
            return await fetch_shard(reader, writer, sha256=sha256, name=name, part=part, max_size=max_size)

        return self._run(ask(), TIMEOUT_S * 4)
