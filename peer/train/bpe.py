"""A byte-level BPE named by the SHA-256 of its ``tokenizer.json``: found, fetched and checked, never
trained at join.

A 'bpe' run pins ``data.tokenizer_sha256``, the SHA-256 of the bytes of a ``tokenizer.json`` (the
Hugging Face tokenizers format), so two peers tokenize alike whatever their ``tokenizers`` version.
A peer looks for those bytes, in this order:

1. the package's own tokenizers, ``peer/assets/tokenizers/*.json`` (the llama-* presets' is there,
   so a preset needs no download to start);
2. this machine's tokenizer store, ``<cache dir>/tokenizers/<sha256>.json``, filled by ``peer data
   prepare --train-tokenizer`` and by every earlier fetch;
3. the run's other peers, when the caller can ask them (``peers``: ``peer join`` once its DHT node
   is up, over the shard protocol, peer/shards/serve.py): every peer of the run holds the bytes it
   built its model from, and the hash makes their origin irrelevant, so they come before the source
   (as shards come from peers before a CDN) and a run needs no source once one peer holds the file;
4. ``data.tokenizer_source``: a file path, or a file of a Hugging Face repository at a pinned commit
   (``hf://datasets/OWNER/NAME@COMMIT/FILE``), fetched with ``huggingface_hub.hf_hub_download`` from
   ``$HF_ENDPOINT`` (default: the Hub).

What a peer or the source delivers is kept in the store. Bytes that hash otherwise are refused with
both hashes named: from the source with :class:`ConfigError` (exit 78); from a peer with a warning,
the next peer then asked. No place holding the bytes ends in one line naming what was tried: a run
without a source and no peer asked, :class:`ConfigError` (exit 78); the peers asked in vain or a
source that cannot be reached, :class:`TokenizerUnavailable` (exit 69). Training
(:func:`train_bpe`) runs only on the operator's side, once: ``peer data prepare --train-tokenizer N``.
Specials come first: id 0 BOS, 1 EOS, 2 PAD; then the 256 byte symbols, then the merges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from peer.train.cache import atomic_write
from peer.train.tokenizer import Tokenizer, byte_tokenizer
from protocol.errors import ConfigError, NetworkError
from protocol.manifest import DataSpec
from protocol.specs import HUB_FILE

logger = logging.getLogger(__name__)

SPECIALS = ("<bos>", "<eos>", "<pad>")
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizers"
"""The tokenizers shipped with the package (package data): ``*.json``, each beside a
``*.provenance.json`` that says what it was trained on."""
ENCODE_PIECE_CHARS = 1 << 20
"""A document longer than this (characters) is encoded in pieces of at most this many, each cut after
its last newline (:func:`encode_pieces`): the tokenizer holds about 80 bytes per token of one call
(with ``encode_batch_fast``; 400 with ``encode_batch``'s offsets), and a source tree's generated files
reach tens of MB in one document."""
MIN_FREQUENCY = 2
"""A pair is merged only when it occurs at least this often in the training text."""


AskPeers = Callable[[str], bytes]
"""``peers(sha256)``: the bytes of the tokenizer.json of that SHA-256 from the run's other peers
(peer/shards/serve.py ``PeerSource.fetch_tokenizer``); raises OSError naming each peer's failure."""


class TokenizerUnavailable(NetworkError):
    """``data.tokenizer_source`` could not be reached (no connection, a server error, not a Hub), or
    the run's peers were asked and none gave the tokenizer while the run names no source."""

    exit_code = 69  # sysexits EX_UNAVAILABLE, as BootstrapUnreachable


def train_bpe(texts: Iterator[str], vocab_size: int) -> Any:
    """Train a byte-level BPE on ``texts``; deterministic for equal input and ``tokenizers`` version.

    Returns:
        a ``tokenizers.Tokenizer`` of at most ``vocab_size`` ids (``.to_str()`` is its tokenizer.json).
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_for_run(spec: DataSpec, vocab_size: int, texts: Iterator[str], *, cache_dir: Path) -> tuple[DataSpec, Path]:
    """Train the run's BPE on ``texts`` (its training split), on the operator's side, and keep it here.

    Args:
        spec: the run's ``[data]`` section.
        vocab_size: ids of the new tokenizer, specials included.
        texts: the documents to train on, in a fixed order (the result depends on it).
        cache_dir: whose tokenizer store (``tokenizers/<sha256>.json``) receives the file.

    Returns:
        ``spec`` naming the new tokenizer (``tokenizer = 'bpe'``, ``vocab_size``, ``tokenizer_sha256``),
        and the file's path in the store.

    Raises:
        ConfigError: the store cannot be written (nothing partial is left).
    """
    logger.info("training a %d-id byte-level BPE on the training split", vocab_size)
    data = train_bpe(texts, vocab_size).to_str().encode("utf-8")
    try:
        path = keep(cache_dir, data)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the tokenizer store in {str(cache_dir)!r} ({exc.strerror or exc}): give a writable --cache-dir"
        ) from exc
    sha256 = hashlib.sha256(data).hexdigest()
    return dataclasses.replace(spec, tokenizer="bpe", vocab_size=vocab_size, tokenizer_sha256=sha256), path


def from_json(data: bytes, *, vocab_size: int, origin: str = "the tokenizer") -> Tokenizer:
    """A :class:`Tokenizer` from tokenizer.json bytes; its ``sha256`` is the SHA-256 of ``data``.

    Args:
        data: the file's bytes (UTF-8 JSON, Hugging Face tokenizers format).
        vocab_size: the run's ``data.vocab_size``: rows of the model's embedding, at least the file's ids.
        origin: how to name the file in errors (its path or source).

    Raises:
        ConfigError: not a tokenizer.json, specials other than :data:`SPECIALS` at ids 0-2, or more
            ids than ``vocab_size``.
    """
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises its own untyped Exception; UnicodeDecodeError too
        raise ConfigError(f"{origin} is not a tokenizer.json ({exc}): point data.tokenizer_source at one") from exc
    if [hf.token_to_id(s) for s in SPECIALS] != [0, 1, 2]:
        raise ConfigError(
            f"{origin} does not have the specials {SPECIALS} at ids 0, 1, 2: train it with "
            "`peer data prepare --train-tokenizer N`"
        )
    if hf.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"{origin} has {hf.get_vocab_size():,} ids, more than data.vocab_size = {vocab_size:,}: "
            f"set data.vocab_size to at least {hf.get_vocab_size()}"
        )
    token_bytes = np.zeros(vocab_size, dtype=np.int64)
    for token, index in hf.get_vocab().items():
        # Every character of a byte-level token stands for exactly one byte.
        token_bytes[index] = 0 if token in SPECIALS else len(token)

    def encode_batch(docs: list[bytes]) -> list[np.ndarray]:
        return encode_pieces(hf, [doc.decode("utf-8", errors="replace") for doc in docs])

    return Tokenizer(
        kind="bpe",
        vocab_size=vocab_size,
        bos_id=0,
        eos_id=1,
        pad_id=2,
        sha256=hashlib.sha256(data).hexdigest(),
        encode_batch=encode_batch,
        token_bytes=token_bytes,
    )


def _cuts(text: str, most: int) -> Iterator[str]:
    """``text`` in pieces of at most ``most`` characters, each ending after its last newline (at
    ``most`` characters where a piece has none)."""
    start = 0
    while len(text) - start > most:
        end = text.rfind("\n", start, start + most) + 1
        end = end if end > start else start + most
        yield text[start:end]
        start = end
    yield text[start:]


def encode_pieces(hf: Any, texts: list[str], *, most: int = ENCODE_PIECE_CHARS) -> list[np.ndarray]:
    """Token ids (int64, 1-D) per text by the Hugging Face tokenizer ``hf``, without specials, with
    ``encode_batch_fast`` (no offsets kept). A text over ``most`` characters is encoded in pieces cut
    after newlines (:func:`_cuts`) whose ids are joined: byte-level BPE decodes them to the same text;
    a token that would have spanned a cut is two tokens there. Memory: about 80 bytes per token of
    one call, so at most ``most`` characters' worth beyond the input and the ids."""
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in _cuts(text, most):
            pieces.append(piece)
            owner.append(i)
    encode = hf.encode_batch_fast  # tokenizers >= 0.20
    ids: list[list[np.ndarray]] = [[] for _ in texts]
    at = 0
    while at < len(pieces):  # calls of at most ``most`` characters, or one piece
        end, size = at, 0
        while end < len(pieces) and (end == at or size + len(pieces[end]) <= most):
            size += len(pieces[end])
            end += 1
        for i, e in zip(owner[at:end], encode(pieces[at:end], add_special_tokens=False)):
            ids[i].append(np.asarray(e.ids, dtype=np.int64))
        at = end
    return [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in ids]


@functools.cache
def packaged_tokenizers() -> dict[str, Path]:
    """The shipped tokenizer files by the SHA-256 of their bytes (hashed once per process)."""
    return {
        hashlib.sha256(path.read_bytes()).hexdigest(): path
        for path in sorted(PACKAGED_DIR.glob("*.json"))
        if not path.name.endswith(".provenance.json")
    }


def store_path(cache_dir: Path, sha256: str) -> Path:
    """Where this machine keeps the tokenizer.json of hash ``sha256``: ``<cache_dir>/tokenizers/<sha256>.json``."""
    return Path(cache_dir) / "tokenizers" / f"{sha256}.json"


def keep(cache_dir: Path, data: bytes) -> Path:
    """Put tokenizer.json bytes into this machine's store (atomically; an entry there whose bytes are
    not its name's is replaced) and return their path there.

    Raises:
        OSError: the store cannot be written; nothing partial is left.
    """
    sha256 = hashlib.sha256(data).hexdigest()
    path = store_path(cache_dir, sha256)
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(data))
    return path


def held_path(sha256: str, cache_dir: Path) -> Path | None:
    """The file on this machine (the package's, else the store's) whose bytes hash to ``sha256``, or
    None. A store entry that hashes otherwise is logged and not returned (a fetch replaces it)."""
    held = _held(sha256, cache_dir)
    return None if held is None else held[1]


def _held(sha256: str, cache_dir: Path) -> tuple[bytes, Path] | None:
    for path in (packaged_tokenizers().get(sha256), store_path(cache_dir, sha256)):
        if path is not None and path.is_file():
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                return data, path
            logger.warning("%s does not hash to its name; fetching the tokenizer again", path)
    return None


def is_held(spec: DataSpec, *, cache_dir: Path) -> bool:
    """Whether the run's tokenizer needs nothing fetched: 'bytes', a 'bpe' pinning no hash (refused
    by :func:`tokenizer_bytes` wherever it looks), or one the package or this machine's store holds."""
    return (
        spec.tokenizer != "bpe" or not spec.tokenizer_sha256 or held_path(spec.tokenizer_sha256, cache_dir) is not None
    )


def prefetch(spec: DataSpec, *, cache_dir: Path, peers: AskPeers) -> None:
    """Get a 'bpe' run's tokenizer into this machine's store, asking ``peers`` before
    ``data.tokenizer_source``, so that a later :func:`load_tokenizer` without peers (the data
    loaders') finds it there; nothing is asked for when :func:`is_held`.

    Raises:
        What :func:`tokenizer_bytes` raises.
    """
    if not is_held(spec, cache_dir=cache_dir):
        tokenizer_bytes(spec, cache_dir=cache_dir, peers=peers)


def tokenizer_bytes(spec: DataSpec, *, cache_dir: Path, peers: AskPeers | None = None) -> tuple[bytes, str]:
    """The bytes of the tokenizer.json the run pins, and where they came from.

    Looks in the package, then in this machine's store, then asks ``peers`` (when given), then
    ``data.tokenizer_source`` (what the peers or the source deliver is kept in the store, so it is
    fetched once per machine).

    Args:
        peers: asks the run's other peers (:data:`AskPeers`); None: they are not asked.

    Returns:
        (the file's bytes, whose SHA-256 is ``spec.tokenizer_sha256``; a description of their origin).

    Raises:
        ConfigError: the run pins no hash; no peer asked and no source; the source's bytes hash
            otherwise (both hashes named); the Hub has no such repository, commit or file.
        TokenizerUnavailable: the source could not be reached, or the peers were asked, none gave
            the file and the run names no source (each peer's answer named).
    """
    want = spec.tokenizer_sha256
    if not want:
        raise ConfigError(
            "data.tokenizer = 'bpe' needs data.tokenizer_sha256, the hash of the run's tokenizer.json: "
            "train one with `peer data prepare --run RUN.toml --train-tokenizer N` and add the [data] lines it prints"
        )
    held = _held(want, cache_dir)
    if held is not None:
        return held[0], str(held[1])
    here = f"neither shipped with this package nor in {store_path(cache_dir, want).parent}"
    asked = ""
    if peers is not None:
        try:
            data = peers(want)
        except OSError as exc:
            asked = str(exc) or type(exc).__name__
            logger.info("no peer gave the tokenizer %s (%s)", want, exc)
        else:
            got = hashlib.sha256(data).hexdigest()
            if got == want:
                _keep_quietly(cache_dir, data)
                return data, "the run's peers"
            asked = f"bytes hashing to {got}"
    source = spec.tokenizer_source
    if not source and asked:
        raise TokenizerUnavailable(
            f"no tokenizer.json of SHA-256 {want} here ({here}) nor from the run's peers ({asked}), and the run "
            "names no data.tokenizer_source: start again once a peer of the run that holds it is up, or set "
            "data.tokenizer_source to the file's path or its hf://datasets/OWNER/NAME@COMMIT/FILE"
        )
    if not source:
        raise ConfigError(
            f"no tokenizer.json of SHA-256 {want} here ({here}) and the run names no data.tokenizer_source: set it "
            "to the file's path or its hf://datasets/OWNER/NAME@COMMIT/FILE, or install the locoswarm release the "
            "run was made with"
        )
    try:
        data = _fetch(source, cache_dir=cache_dir)
    except TokenizerUnavailable as exc:
        if not asked:
            raise
        raise TokenizerUnavailable(f"{exc} (the run's peers, asked first: {asked})") from exc
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise ConfigError(
            f"the tokenizer at {source} hashes to {got}, the run pins data.tokenizer_sha256 = {want}: "
            "point data.tokenizer_source at the run's tokenizer.json (`peer data prepare` prints its hash)"
        )
    _keep_quietly(cache_dir, data)
    return data, source


def _keep_quietly(cache_dir: Path, data: bytes) -> None:
    try:
        keep(cache_dir, data)
    except OSError as exc:
        logger.warning("could not keep the tokenizer in %s (%s); it is fetched again next time", cache_dir, exc)


def _fetch(source: str, *, cache_dir: Path) -> bytes:
    """The bytes at ``data.tokenizer_source``: a local file, or a Hub file at a pinned commit."""
    match = HUB_FILE.fullmatch(source)
    if match is None:
        try:
            return Path(source).expanduser().read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the tokenizer at data.tokenizer_source = {source!r} ({exc.strerror or exc}): "
                "point it at the run's tokenizer.json"
            ) from exc
    datasets, repo_id, revision, filename = match.groups()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not when huggingface_hub was imported
    where = endpoint or "the Hugging Face Hub"
    logger.info("fetching the tokenizer %s from %s", source, where)
    try:
        with _quiet_hub_retries():
            path = hf_hub_download(
                repo_id,
                filename,
                repo_type="dataset" if datasets else "model",
                revision=revision,
                cache_dir=Path(cache_dir) / "hub",
                endpoint=endpoint,
            )
        return Path(str(path)).read_bytes()
    except LocalEntryNotFoundError as exc:  # no answer, and nothing cached: before EntryNotFoundError
        raise TokenizerUnavailable(
            f"cannot reach {where} for the tokenizer {source} (no connection, or not a Hub): check the "
            "network or $HF_ENDPOINT, then start again"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise ConfigError(
            f"{where} has no {source} ({type(exc).__name__}): point data.tokenizer_source at the "
            "repository, commit and file the run's tokenizer.json was uploaded to"
        ) from exc
    except OSError as exc:  # HfHubHTTPError (e.g. 5xx after retries), connection and file errors
        raise TokenizerUnavailable(
            f"cannot fetch the tokenizer {source} from {where} ({first_line(exc)}): try again later"
        ) from exc


@contextlib.contextmanager
def _quiet_hub_retries() -> Iterator[None]:
    """Hide the Hub client's warnings (two lines per retry, for about 25 s when the Hub cannot be
    reached) unless this module logs at DEBUG, so a failed fetch ends in the one error line."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first non-empty line (the Hub client's run over several)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def load_tokenizer(spec: DataSpec, *, cache_dir: Path, peers: AskPeers | None = None) -> Tokenizer:
    """The run's tokenizer: byte-level, or the BPE whose tokenizer.json ``data.tokenizer_sha256`` names
    (found or fetched as :func:`tokenizer_bytes` says; nothing is trained here).

    Args:
        cache_dir: holds this machine's tokenizer store (``tokenizers/``) and the Hub client's cache (``hub/``).
        peers: asks the run's other peers for the file (:data:`AskPeers`); None: they are not asked.

    Raises:
        ConfigError: a 'bytes' run pins another hash than the byte tokenizer's, or see
            :func:`tokenizer_bytes` and :func:`from_json`.
        TokenizerUnavailable: ``data.tokenizer_source`` could not be reached, or no peer asked gave
            the file and the run names no source.
    """
    if spec.tokenizer == "bytes":
        tokenizer = byte_tokenizer()
        if spec.tokenizer_sha256 and tokenizer.sha256 != spec.tokenizer_sha256:
            raise ConfigError(
                f"the bytes tokenizer hashes to {tokenizer.sha256}, the run pins data.tokenizer_sha256 = "
                f"{spec.tokenizer_sha256}: install the locoswarm release the run was made with"
            )
        return tokenizer
    data, origin = tokenizer_bytes(spec, cache_dir=cache_dir, peers=peers)
    return from_json(data, vocab_size=spec.vocab_size, origin=f"the tokenizer from {origin}")
