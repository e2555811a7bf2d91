"""Shards from peers: a peer serves the shard files it holds to others over a libp2p stream, the
way state download works (peer/state/serve.py, download.py): bounded frames, every byte checked.

One stream per file (framing: protocol/wire/framing.py)::

    asker → holder:  REQUEST  kind 32, 32 B SHA-256, u64 offset, then the file's name (UTF-8, ≤ 1 KiB)
    holder → asker:  MISSING  kind 33                       (not held)
                     SIZE     kind 34, u64 file size, then DATA frames from ``offset`` to the end:
                     DATA     kind 35, up to 1 MiB of the file

The asker closes after the last byte. A holder serves only the files of the run's list, each by the
SHA-256 the list gives its name (:func:`listing`): a shard from its store (by hash) or its local
directory of the corpus (``peer join --data``, hashed once before it is first served), and the list
``shards.json`` itself; a name not in the list, or a hash the list does not give it, is MISSING.
Streams are capped at :data:`MAX_SERVED_STREAMS` at once and :data:`MAX_STREAMS_PER_PEER` per asking
peer (:func:`serve_stream`; more are closed unanswered), and an asker that sends no REQUEST, stops
reading or does not close for :data:`IDLE_TIMEOUT_S` loses its stream.

The asker (:class:`PeerSource`) keeps each holder's bytes in that holder's own partial file
(:func:`holder_part`), resumes a cut transfer once from the same holder, and checks the file's hash
before it takes it: a holder that lies costs one holder's attempt, and the next holder starts afresh.

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
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from peer.net import pacing
from peer.net.limits import StreamSlots
from peer.shards.index import INDEX_NAME, SUFFIXES, ShardIndex, file_sha256
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
"""Seconds one step of a transfer may take in all: opening a stream, one DATA frame's drain (paced at
the upload cap), one frame read by the asker."""
IDLE_TIMEOUT_S = 5.0
"""Seconds a served stream may sit without the asker's part: its REQUEST after the stream opens, its
reading (the holder's unsent bytes not moving), its close after the last byte."""
MAX_SERVED_STREAMS = 4
"""Shard streams a holder serves at once; a stream beyond them is closed unanswered (the asker tries
another holder)."""
MAX_STREAMS_PER_PEER = 2
"""Shard streams a holder serves to one asking peer at once; more from that peer are closed unanswered."""
TOKENIZER_NAME = "tokenizer.json"
"""The name a REQUEST for a tokenizer.json gives (with the file's SHA-256)."""
MAX_TOKENIZER_BYTES = 64 << 20
"""Most bytes a peer takes as a tokenizer.json (one of a 16k-id BPE is about 1 MB)."""
_MAX_VERIFIED = 4096
_verified: dict[tuple[str, int, int], str] = {}
"""(path, size, mtime in ns) → SHA-256 of the local-directory files hashed before serving them."""


def protocol_name(prefix: str) -> str:
    """The libp2p protocol of shard transfers under a DHT prefix."""
    return f"{prefix}.LocoShards.v{PROTOCOL_VERSION}"


def listing(index: ShardIndex | None, index_sha256: str) -> dict[str, str]:
    """Name → SHA-256 of the run's files: its list ``shards.json`` (``data.shards_sha256``) and,
    given ``index``, every shard of it. What a holder serves, and what an asker asks for."""
    out = {INDEX_NAME: index_sha256}
    if index is not None:
        out.update((s.name, s.sha256) for s in index.shards)
    return out


def holder_part(part: Path, peer: str) -> Path:
    """The partial file of ``part`` that holds the bytes of holder ``peer`` only:
    ``<part>.<16 hex digits of SHA-256(peer id)>``."""
    return part.with_name(f"{part.name}.{hashlib.sha256(peer.encode('utf-8')).hexdigest()[:16]}")


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


async def _local_file(
    store: ShardStore | None,
    local_dir: Path | None,
    listed: Mapping[str, str] | None,
    sha256: str,
    name: str,
    tokenizers: Callable[[str], Path | None] | None,
) -> Path | None:
    if name == TOKENIZER_NAME:  # by hash only
        return tokenizers(sha256) if tokenizers is not None else None
    if store is None or listed is None or listed.get(name) != sha256:
        return None  # only the run's files, each by the hash its list gives it
    if name == INDEX_NAME:
        index = store.root / f"index-{sha256}.json"  # fetch_index keeps the list's bytes under its hash
        return index if index.is_file() else None
    held = store.holds(sha256)
    if held is not None:
        return held
    if local_dir is not None and (local_dir / name).is_file():
        path = local_dir / name
        return path if await _hashes_to(path, sha256) else None
    return None


async def _hashes_to(path: Path, sha256: str) -> bool:
    """Whether ``path`` hashes to ``sha256``: hashed once per size and modification time, off the loop."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _verified:
        digest = await asyncio.to_thread(file_sha256, path)
        if len(_verified) >= _MAX_VERIFIED:
            _verified.clear()
        _verified[key] = digest
    if _verified[key] != sha256:
        logger.warning("not serving %s: it hashes to %s, the run's list says %s", path, _verified[key], sha256)
        return False
    return True


async def serve_stream(
    slots: StreamSlots,
    peer: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    store: ShardStore | None,
    local_dir: Path | None,
    **kwargs,
) -> int | None:
    """:func:`serve_shard` within ``slots`` (:data:`MAX_SERVED_STREAMS` in all,
    :data:`MAX_STREAMS_PER_PEER` for ``peer``): a stream over either cap is closed unanswered.

    Returns:
        The file bytes sent; None when the stream was refused.
    """
    if not slots.acquire(peer):
        logger.info(
            "refused a shard stream from %s: %d open in all, at most %d at once and %d per peer",
            sanitize(peer, max_chars=60),
            slots.open,
            slots.total,
            slots.per_peer,
        )
        await _close(writer)
        return None
    try:
        return await serve_shard(reader, writer, store, local_dir, **kwargs)
    finally:
        slots.release(peer)


def serving_slots() -> StreamSlots:
    """A holder's slots: :data:`MAX_STREAMS_PER_PEER` per asking peer, :data:`MAX_SERVED_STREAMS` in all."""
    return StreamSlots(per_peer=MAX_STREAMS_PER_PEER, total=MAX_SERVED_STREAMS)


async def serve_shard(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    store: ShardStore | None,
    local_dir: Path | None,
    *,
    listed: Mapping[str, str] | None = None,
    tokenizers: Callable[[str], Path | None] | None = None,
    timeout: float = TIMEOUT_S,
) -> int:
    """Answer one REQUEST, then close the stream. Returns the file bytes sent.

    Args:
        store, local_dir: where the shards served are (store None: every shard REQUEST is MISSING).
        listed: the run's files, name → SHA-256 (:func:`listing`): only these are served, each by
            that hash; None: no shard and no list is served.
        tokenizers: ``tokenizers(sha256)``: the tokenizer.json file served for that hash, or None
            (not held); None: no tokenizer is served.
        timeout: seconds one DATA frame's drain may take in all (:data:`TIMEOUT_S`); the asker may
            stay silent or stop reading for :data:`IDLE_TIMEOUT_S`.

    Never raises for what the asker does (a malformed request, silence, disconnect): it logs and closes.
    The file's bytes go out within the peer's upload cap (peer/net/pacing.py).
    """
    idle_s = IDLE_TIMEOUT_S
    raw, writer = writer, pacing.paced(writer)
    sent = 0
    try:
        try:
            sha256, offset, name = parse_request(
                await framing.read_frame(reader, max_bytes=_HEAD.size + MAX_NAME_BYTES, timeout=idle_s)
            )
        except (TimeoutError, BadPayload, asyncio.IncompleteReadError) as exc:
            logger.info("rejected a shard request: %s", framing.describe_failure(exc))
            return 0
        path = await _local_file(store, local_dir, listed, sha256, name, tokenizers)
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
                    await _drain(writer, raw, idle_s=idle_s, limit_s=timeout)
        await _drain(writer, raw, idle_s=idle_s, limit_s=timeout)
        await asyncio.wait_for(reader.read(1), idle_s)  # the asker closes first
    except (TimeoutError, ConnectionError, OSError) as exc:
        logger.info("shard stream ended after %d bytes: %s", sent, framing.describe_failure(exc))
        transport = getattr(raw, "transport", None)
        if isinstance(exc, TimeoutError) and transport is not None:
            transport.abort()  # what the asker does not read is dropped, not flushed for minutes
    finally:
        await _close(writer)
    return sent


async def _drain(writer, raw: asyncio.StreamWriter, *, idle_s: float, limit_s: float) -> None:
    """``writer.drain()`` within ``limit_s`` seconds, failing sooner when the bytes ``raw``'s transport
    holds have not moved for ``idle_s`` seconds (the asker stopped reading). Time the pacer makes the
    writer wait is not idle: the transport holds nothing then.

    Raises:
        TimeoutError: over ``limit_s``, or stalled.
    """
    transport = getattr(raw, "transport", None)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    drained = asyncio.ensure_future(writer.drain())
    last = -1
    try:
        while True:
            done, _ = await asyncio.wait({drained}, timeout=max(0.0, min(idle_s, deadline - loop.time())))
            if done:
                return drained.result()
            if loop.time() >= deadline:
                raise TimeoutError
            held = transport.get_write_buffer_size() if transport is not None else -1
            if held > 0 and held == last:
                raise TimeoutError
            last = held
    finally:
        drained.cancel()


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
        self.sha256_of.update(listing(index, index_sha256))

    def fetch(self, name: str, part: Path, size: int) -> None:
        """Put the file ``name`` at ``part`` (replacing what is there) once a peer gave bytes that
        hash to the run's SHA-256 of it; at most ``size`` bytes are taken from one peer.

        Each peer's bytes go to its own :func:`holder_part` of ``part``: a cut transfer resumes once
        from that peer's bytes, never from another's; a peer whose file hashes otherwise is refused with
        a warning naming both hashes and its partial file removed, and the next peer asked afresh.

        Raises:
            FileNotFoundError: not in the run's list, or no peer gave those bytes (each peer's answer:
                not held, an error, wrong bytes); no partial file of a peer is left.
        """
        sha256 = self.sha256_of.get(name)
        if sha256 is None:
            raise FileNotFoundError(f"{name} is not in the run's list")
        reasons = []
        for peer in list(dict.fromkeys(self._peers()))[: self.max_peers]:
            mine = holder_part(part, peer)
            reason = self._fetch_from(peer, sha256, name, mine, size)
            if reason is None:
                os.replace(mine, part)
                return
            reasons.append(f"{peer[:12]}…: {reason}")
        raise FileNotFoundError("; ".join(reasons) or "no peer known yet")

    def _fetch_from(self, peer: str, sha256: str, name: str, mine: Path, size: int) -> str | None:
        """None when ``mine`` holds ``name``'s exact bytes from ``peer``; else why not (``mine`` removed)."""
        for attempt in range(2):  # a cut transfer resumes once, from this peer's own bytes
            try:
                if not self._ask(peer, sha256, name, mine, size):
                    reason = "not held"
                    break
            except Exception as exc:  # whatever the transport raises: resume once, then the next peer
                reason = sanitize(framing.describe_failure(exc), max_chars=160)
                if attempt == 0 and mine.is_file() and mine.stat().st_size > 0:
                    logger.info(
                        "%s from peer %s cut after %d bytes (%s); resuming", name, peer, mine.stat().st_size, reason
                    )
                    continue
                break
            got = file_sha256(mine)
            if got == sha256:
                return None
            logger.warning(
                "refused %s from peer %s: %d bytes hashing to %s, the run's list says %s; asking the next peer",
                name,
                peer,
                mine.stat().st_size,
                got,
                sha256,
            )
            reason = f"wrong bytes (sha256 {got[:16]}...)"
            break
        mine.unlink(missing_ok=True)
        return reason

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
