"""DHT access shared by peers and bootstrap nodes: bounded calls into the DHT process, this node's
addresses and stream handlers, announce and fetch run manifests, publish and read progress records
(starting a node: peer/net/dht_node.py).

Anyone can write to the DHT, so every read peers act on is bounded and screened:

* it returns within a timeout (:func:`read_value`: hivemind's ``DHT.get`` has none);
* a value that is not msgpack is skipped, not fatal: in hivemind 1.1.12 it raises inside the
  search's callback, whose future then never resolves, so every later read of that key hung. The
  DHT process of ``new_dht`` (peer/net/dht_node.py) decodes each found value on its own and reads an undecodable one
  as None, which every reader here rejects like any other invalid value;
* a value whose expiration lies further ahead than any honest writer sets
  (:data:`MAX_EXPIRATION_AHEAD_S`) is ignored;
* a node of ours stores and caches at most ``MAX_ENTRIES_STORED`` entries per key, the ones its reads
  prefer first, and a read merges a bounded number (peer/net/dht_storage.py), so a flood of validly
  signed records costs each node and each read a bounded amount;
* what remains is validated (manifests by hash and schema, records by schema and bounds, strings
  stripped of control characters: protocol/text.py) before use;
* what peers act on is signed (protocol/signing.py): a run is announced in the runs index as its
  manifest signed by the run's owner (protocol/manifest.py ``open_announcement``), and a peer's
  progress record is signed by the peer's identity key, stored under its peer id. A value whose
  signature does not match is ignored and counted (``signing.REJECTED``). Every node started here
  also refuses to store such values under the keys it protects (peer/net/validator.py), so an
  unsigned write can neither replace nor hide a signed one.

hivemind serializes DHT values with msgpack, never pickle.

Longer than 300 lines: it is the one module that reads and writes every DHT value of the protocol,
so each read's bounds and checks are in one place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from peer.net import dht_storage, selection
from peer.net.lifetime import exited
from peer.net.periodic import Periodic
from peer.net.selection import (
    MAX_EXPIRATION_AHEAD_S,
    MAX_RECORDS_READ as MAX_RECORDS_READ,  # re-exported: the bound readers cite
    MAX_RUNS_READ,
    entries,
    select_entries,
)
from protocol import keys
from protocol.errors import BadPeerAddress, BadSignature, ManifestError, ManifestNotFound, NetworkError, ProtocolError
from protocol.manifest import RunManifest, SignedManifest, open_announcement
from protocol.records import ProgressRecord
from protocol.signing import REJECTED, PeerSigner, open_record
from protocol.text import sanitize

logger = logging.getLogger(__name__)

MANIFEST_TTL_S = 300.0
"""How long a manifest announcement lives in the DHT; announcers refresh it every TTL/5."""

READ_TIMEOUT_S = 10.0
"""Longest a DHT read may take before it is given up (a round's reads must not stall it)."""

CALL_TIMEOUT_S = 30.0
"""Longest a DHT store, or a call run in the DHT process (``run_coroutine``), may take before it
is given up. hivemind waits on both without a limit, and its DHT process keeps no reference to
the tasks it starts: a task awaiting something nothing will resolve is garbage-collected ("Task
was destroyed but it is pending!") and its caller would wait for good (seen once in the chaos
test: a peer stopped between rounds)."""


DEAD_CHECK_S = 0.5
"""How often :func:`finish` checks that the DHT process running the call is alive, s."""


def finish(future, what: str, timeout_s: float = CALL_TIMEOUT_S, dht=None):
    """The result of ``future`` (the ``MPFuture`` of a hivemind DHT call made with
    ``return_future=True``) within ``timeout_s`` seconds; with ``dht`` (the DHT that runs the
    call), given up at once when its process has died (the call will never finish).

    Raises:
        NetworkError: no result in time, or the DHT process died (the call is cancelled; ``what``
            names it in the message). The command's HelperWatch (peer/net/lifetime.py) is what
            stops it when its DHT died.
        Whatever the call raised, unchanged.
    """
    deadline = time.monotonic() + timeout_s
    slice_s = timeout_s if dht is None else DEAD_CHECK_S
    while True:
        try:
            return future.result(timeout=min(slice_s, max(0.0, deadline - time.monotonic())))
        except TimeoutError as exc:
            died = dht is not None and exited(dht)
            if died or time.monotonic() >= deadline:
                future.cancel()
                raise NetworkError(
                    f"the DHT process died before finishing {what}"
                    if died
                    else f"the DHT did not finish {what} within {timeout_s:g} s"
                ) from exc


def call_in_dht(dht, coro: Callable, what: str, timeout_s: float = CALL_TIMEOUT_S):
    """``dht.run_coroutine(coro)`` that returns within ``timeout_s`` (:func:`finish`)."""
    return finish(dht.run_coroutine(coro, return_future=True), what, timeout_s, dht)


def store(
    dht, key: str, value, expiration: float, *, subkey: str | None = None, timeout_s: float = CALL_TIMEOUT_S
) -> bool:
    """``dht.store(...)`` that returns within ``timeout_s`` (:func:`finish`): whether a node
    accepted the value."""
    return bool(
        finish(
            dht.store(key, value, expiration, subkey=subkey, return_future=True),
            f"a store under {key!r}",
            timeout_s,
            dht,
        )
    )


MAX_RUN_NAME_CHARS = 128
"""Run names in the runs index longer than this are cut (a manifest's own name is at most 128)."""


def quiet_hivemind_logs() -> None:
    """Keep hivemind's own logs off a command's output (``-v`` leaves them on).

    locoswarm reports every failed sync itself, once, on the progress line; hivemind would also
    log each one with a traceback from its averager process.
    """
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)


def parse_initial_peers(addresses: Sequence[str]) -> list[str]:
    """Check that each address is a multiaddr ending in /p2p/PEER_ID.

    Raises:
        BadPeerAddress: names the bad address and shows the expected form.
    """
    from hivemind.utils.multiaddr import Multiaddr

    parsed = []
    for address in addresses:
        try:
            maddr = Multiaddr(address)
            peer_id = maddr.value_for_protocol("p2p")
        except Exception as exc:
            raise BadPeerAddress(
                f"--initial-peers {address!r} is not a valid multiaddr ({exc}); expected the form "
                "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as printed by `bootstrap run` or `peer join`"
            ) from exc
        if not peer_id:
            raise BadPeerAddress(
                f"--initial-peers {address!r} has no /p2p/PEER_ID part; copy the full address printed "
                "by `bootstrap run` or `peer join`"
            )
        parsed.append(str(maddr))
    return parsed


def visible_maddrs(dht, *, latest: bool = False, timeout_s: float = CALL_TIMEOUT_S) -> list[str]:
    """This node's multiaddrs as libp2p sees them (``latest``: ask p2pd afresh; when it does not
    answer within :data:`DAEMON_CALL_TIMEOUT_S`, the addresses it gave last, with a warning).

    Raises:
        NetworkError: no answer within ``timeout_s``.
    """
    return [
        str(m)
        for m in call_in_dht(
            dht, functools.partial(_visible_maddrs, latest=latest), "reading this node's addresses", timeout_s
        )
    ]


DAEMON_CALL_TIMEOUT_S = 10.0
"""Longest a call from the DHT process to p2pd's control socket (identify, list peers) may take:
an identify's answer may never come (its task can be garbage-collected), and the caller must not
wait for it forever."""


async def _visible_maddrs(_dht, node, latest: bool):  # in the DHT process
    if latest:
        try:
            return await asyncio.wait_for(node.get_visible_maddrs(latest=True), DAEMON_CALL_TIMEOUT_S)
        except TimeoutError:
            logger.warning(
                "p2pd did not say this node's addresses within %.0f s; using the ones it said at the start",
                DAEMON_CALL_TIMEOUT_S,
            )
    return await node.get_visible_maddrs(latest=False)  # no daemon call: the addresses identify last gave


async def _add_stream_handler(_dht, node, protocol: str, handler) -> None:
    await node.p2p.add_binary_stream_handler(protocol, handler)


def serve_stream(dht, protocol: str, handler) -> None:
    """Serve ``protocol`` with ``handler(stream_info, reader, writer)`` (a module-level coroutine
    function) on ``dht``'s libp2p host, in the DHT's process, from now on.

    Raises:
        Whatever hivemind raises when the handler cannot be added (a DHT that is shutting down);
        ``NetworkError`` when the DHT process does not add it within :data:`CALL_TIMEOUT_S`.
    """
    call_in_dht(
        dht,
        functools.partial(_add_stream_handler, protocol=protocol, handler=handler),
        f"adding the {protocol} handler",
    )


def store_manifest(dht, signed: SignedManifest, ttl_s: float = MANIFEST_TTL_S) -> bool:
    """Announce a signed manifest in the runs index (subkey: its run id) for ``ttl_s`` seconds.

    Anyone may store an announcement they read (peers keep their run's alive): the owner's
    signature travels with it. Returns whether a node accepted it.
    """
    from hivemind.utils import get_dht_time

    return store(dht, keys.RUNS_KEY, signed.to_wire(), get_dht_time() + ttl_s, subkey=signed.run_id)


def read_value(dht, key: str, *, timeout_s: float = READ_TIMEOUT_S):
    """``dht.get(key, latest=True)`` that returns within ``timeout_s``, without a plain value whose
    expiration is implausibly far ahead (entries of a value with subkeys: :func:`entries`).

    Returns:
        hivemind's ``ValueWithExpiration`` (for a key with subkeys, ``value`` is a dict of subkey →
        ``ValueWithExpiration``), or None when nothing (plausible) is stored.

    Raises:
        NetworkError: no answer within ``timeout_s`` or the DHT failed; the search is cancelled.
    """
    from hivemind.utils import get_dht_time

    try:
        found = finish(dht.get(key, latest=True, return_future=True), f"a read of {key!r}", timeout_s, dht)
    except NetworkError:
        raise
    except Exception as exc:
        raise NetworkError(f"DHT read of {key!r} failed: {type(exc).__name__}: {exc}") from exc
    expiration = getattr(found, "expiration_time", None)
    if found is None or not isinstance(expiration, (int, float)):
        return None
    # a value with subkeys expires with its latest entry: :func:`entries` judges each entry instead
    if not isinstance(found.value, dict) and expiration > get_dht_time() + MAX_EXPIRATION_AHEAD_S:
        logger.warning(
            "ignoring the DHT value of %r: it expires %.0f s from now, more than %.0f s",
            key,
            expiration - get_dht_time(),
            MAX_EXPIRATION_AHEAD_S,
        )
        return None
    return found


async def _read_selected(_dht, node, key: str, max_ahead_s: float, select: dict, only: str | None):
    """In the DHT process: the entries of ``key`` a reader keeps, and how many were left there. The
    node's storage learns what this reader prefers, and keeps those entries first (peer/net/dht_storage.py)."""
    if select["prefer"]:
        dht_storage.prefer(node, key, select["prefer"])
    found = await node.get(key, latest=True)
    out = entries(found, max_ahead_s=max_ahead_s)
    if only is not None:
        kept = [e for e in out if e[0] == only]
    else:
        kept = select_entries(out, **select)
    return kept, len(out) - len(kept)


def read_entries(
    dht,
    key: str,
    *,
    timeout_s: float = READ_TIMEOUT_S,
    max_ahead_s: float = MAX_EXPIRATION_AHEAD_S,
    prefer: Collection[str] = (),
    cap: int | None = None,
    signed: bool = True,
    only: str | None = None,
) -> list[tuple[str, object, float]]:
    """:func:`entries` of ``key``, at most ``cap`` of them (:func:`select_entries`; with ``only``,
    that subkey's entry alone), chosen in the DHT process: the rest never reach this process, so a
    flood under ``key`` costs this process nothing but the DHT process's transient decode. A DHT
    object without ``run_coroutine`` (a test's stand-in) is read whole and selected here.

    Raises:
        NetworkError: no answer within ``timeout_s``; the search is cancelled.
    """
    cap = selection.MAX_RECORDS_READ if cap is None else cap
    prefer = prefer if isinstance(prefer, (set, frozenset)) else frozenset(prefer)
    select: dict[str, Any] = {"prefer": prefer, "cap": cap, "signed": signed}
    if not hasattr(dht, "run_coroutine"):
        out = entries(read_value(dht, key, timeout_s=timeout_s), max_ahead_s=max_ahead_s)
        return [e for e in out if e[0] == only] if only is not None else select_entries(out, **select)
    call = functools.partial(_read_selected, key=key, max_ahead_s=max_ahead_s, select=select, only=only)
    try:
        kept, left = call_in_dht(dht, call, f"a read of {key!r}", timeout_s)
    except NetworkError:
        raise
    except Exception as exc:
        raise NetworkError(f"DHT read of {key!r} failed: {type(exc).__name__}: {exc}") from exc
    if left:
        logger.debug("read %d entries of %r, left %d unread", len(kept), key, left)
    return kept


def list_announced(
    dht, *, timeout_s: float = READ_TIMEOUT_S, only: str | None = None, prefer: Collection[str] = ()
) -> dict[str, SignedManifest]:
    """Announced runs whose manifest is signed by the owner it names: run id → signed manifest.

    At most :data:`MAX_RUNS_READ` announcements are verified (``prefer``: run ids kept first, e.g.
    the bootstrap node's run and runs this peer holds checkpoints of; the others by a keyed hash);
    with ``only``, that run's entry alone is read and verified. An unsigned or wrongly signed
    announcement, or one stored under another run id, is ignored and counted in
    ``signing.REJECTED["manifest"]`` (logged once per run id).

    Raises:
        NetworkError: the DHT did not answer within ``timeout_s``.
    """
    runs = {}
    found = read_entries(
        dht, keys.RUNS_KEY, timeout_s=timeout_s, prefer=prefer, cap=MAX_RUNS_READ, signed=False, only=only
    )
    for run_id, value, _ in found:
        writer = sanitize(run_id, max_chars=64)
        if not _is_run_id(run_id):
            REJECTED.note("manifest", writer, "the subkey is not a run id")
            continue
        try:
            runs[run_id] = open_announcement(value, expected_run_id=run_id)
        except (ProtocolError, ManifestError) as exc:  # unsigned, wrongly signed, not a manifest, another version
            REJECTED.note("manifest", writer, sanitize(str(exc), max_chars=200))
    return runs


def list_runs(dht, *, timeout_s: float = READ_TIMEOUT_S) -> dict[str, str]:
    """Announced runs with a valid owner signature (:func:`list_announced`): run id → name
    (stripped of control characters, at most 128 characters).

    Raises:
        NetworkError: the DHT did not answer within ``timeout_s``.
    """
    return {
        run_id: sanitize(signed.manifest.name, max_chars=MAX_RUN_NAME_CHARS)
        for run_id, signed in list_announced(dht, timeout_s=timeout_s).items()
    }


_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def _is_peer_id(text: str) -> bool:
    return 0 < len(text) <= 128 and all(c in _BASE58 for c in text)


def _is_run_id(text: str) -> bool:
    return 0 < len(text) <= 64 and all(c in "0123456789abcdef" for c in text)


def fetch_manifest(
    dht, run_id: str | None = None, *, timeout_s: float = READ_TIMEOUT_S, allow_data_path: bool = False
) -> RunManifest:
    """Fetch and verify a run manifest from the DHT (:func:`fetch_signed` without the signature)."""
    return fetch_signed(dht, run_id, timeout_s=timeout_s, allow_data_path=allow_data_path).manifest


def fetch_signed(
    dht, run_id: str | None = None, *, timeout_s: float = READ_TIMEOUT_S, allow_data_path: bool = False
) -> SignedManifest:
    """Fetch a run's announcement from the DHT, signed by the owner its run id binds.

    A manifest from the network can never name a local path: one whose ``data.path`` is set is
    refused (:func:`refuse_local_data_path`) unless ``allow_data_path`` (for readers that only
    show it, like the monitor), since a joiner would read whatever that path holds on its own
    machine.

    Args:
        run_id: the run to fetch; if None, the only run announced in the swarm.
        timeout_s: bound of each DHT read.
        allow_data_path: return a manifest with ``data.path`` set (never to train on).

    Raises:
        ManifestNotFound: no validly signed announcement of such a run (unsigned, wrongly signed
            and malformed ones are ignored), no run at all, several runs and none chosen, or the
            DHT did not answer in time.
        ManifestError: the manifest names a data path (one line telling the volunteer to pass
            ``--run``).
    """
    try:
        signed = _fetch_signed(dht, run_id, timeout_s)
    except NetworkError as exc:
        raise ManifestNotFound(f"no run manifest read: {exc}; retry, or check --initial-peers") from exc
    if not allow_data_path:
        refuse_local_data_path(signed.manifest)
    return signed


def refuse_local_data_path(manifest: RunManifest) -> None:
    """Refuse a manifest received from the network that names a local data path.

    Whoever announces a run chooses its ``data.path``; a joiner that trained on it would read its
    own files there (its home directory, say). A volunteer's data location is theirs alone: it
    comes from their own ``--run`` file.

    Raises:
        ManifestError: ``manifest.data.path`` is not empty.
    """
    if manifest.data.path:
        raise ManifestError(
            f"run {manifest.run_id} ({manifest.name}) reads data.source = {manifest.data.source!r} from "
            f"data.path = {sanitize(manifest.data.path, max_chars=200)!r}, a path this peer will not take from "
            "the network: pass --run FILE.toml with the run's manifest and your own data location"
        )


def _fetch_signed(dht, run_id: str | None, timeout_s: float) -> SignedManifest:
    runs = list_announced(dht, timeout_s=timeout_s, only=run_id)  # a run id given: its entry alone
    if run_id is None:
        if not runs:
            raise ManifestNotFound("the swarm announces no run yet; retry in a few seconds or pass --run-id")
        if len(runs) > 1:
            listing = ", ".join(
                f"{rid} ({sanitize(s.manifest.name, max_chars=MAX_RUN_NAME_CHARS)})" for rid, s in sorted(runs.items())
            )
            raise ManifestNotFound(f"the swarm announces several runs: {listing}; choose one with --run-id")
        run_id = next(iter(runs))
    if run_id not in runs:
        raise ManifestNotFound(
            f"no manifest signed by its owner for run id {run_id} in the DHT; check the id "
            "with `peer status` or ask the run's owner"
        )
    return runs[run_id]


class ManifestAnnouncer(Periodic):
    """Keeps a signed manifest alive in the DHT (stored again every ttl/5) until :meth:`stop`."""

    def __init__(self, dht, signed: SignedManifest, ttl_s: float = MANIFEST_TTL_S):
        super().__init__(period_s=ttl_s / 5 if ttl_s > 5 else 1.0, name="manifest-announcer")
        self.dht, self.signed, self.ttl_s = dht, signed, ttl_s

    def tick(self) -> None:
        if not store_manifest(self.dht, self.signed, self.ttl_s):
            logger.debug("no DHT node accepted the manifest announcement; retrying")


def publish_progress(dht, run_id: str, signer: PeerSigner, record: ProgressRecord, ttl_s: float, *, wait: bool = True):
    """Store this peer's record, signed by ``signer`` under its peer id; with ``wait=False`` returns
    at once (the store finishes in the DHT process)."""
    from hivemind.utils import get_dht_time

    key, expiration = keys.progress_key(run_id), get_dht_time() + ttl_s
    value = signer.seal(key, expiration, record.to_wire())
    if wait:
        return store(dht, key, value, expiration, subkey=signer.peer_id)
    return dht.store(key, value, expiration, subkey=signer.peer_id, return_future=True)


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    record: ProgressRecord
    expiration: float


def read_signed(
    dht,
    key: str,
    kind: str,
    decode: Callable[[str, Any], Any],
    *,
    timeout_s: float = READ_TIMEOUT_S,
    max_ahead_s: float = MAX_EXPIRATION_AHEAD_S,
    prefer: Collection[str] = (),
) -> list[tuple[str, Any, float]]:
    """The signed per-peer values under ``key`` (progress records, addresses, devices), checked.

    Entries whose subkey is not a peer id are counted in ``signing.REJECTED[kind]``; at most
    :data:`MAX_RECORDS_READ` of the rest are verified (:func:`select_entries`: ``prefer`` first);
    an entry whose signature does not match its subkey is counted too; ``decode(peer_id, data)``
    turns the signed data into the value returned, and whatever it raises (``BadPayload`` or an
    undocumented decoder error) skips that entry with a debug log: one bad value never hides the
    others.

    Returns:
        ``(peer id, decoded value, expiration)`` per entry kept.

    Raises:
        NetworkError: the DHT did not answer within ``timeout_s``.
    """
    out = []
    for peer_id, value, expiration in read_entries(
        dht, key, timeout_s=timeout_s, max_ahead_s=max_ahead_s, prefer=prefer
    ):
        if not _is_peer_id(peer_id):  # printed by `peer status` and the monitor: base58 only
            REJECTED.note(kind, sanitize(str(peer_id), max_chars=64), "the subkey is not a peer id")
            continue
        try:
            out.append((peer_id, decode(peer_id, open_record(key, peer_id, expiration, value)), expiration))
        except BadSignature as exc:
            REJECTED.note(kind, peer_id, exc)
        except Exception as exc:  # BadPayload, or a decoder's undocumented error
            logger.debug("ignoring the %s entry of %s: %r", kind, peer_id, exc)
    return out


def read_progress(
    dht,
    run_id: str,
    *,
    timeout_s: float = READ_TIMEOUT_S,
    max_ttl_s: float = MAX_EXPIRATION_AHEAD_S,
    prefer: Collection[str] = (),
) -> list[PeerProgress]:
    """Live peers' latest progress records, each signed by the peer whose id it is stored under.

    At most :data:`MAX_RECORDS_READ` records are verified and returned (:func:`select_entries`):
    with more entries under the key (a flood of fresh identities), the peers in ``prefer`` (this
    peer's id, peers it has seen) are kept first, the others by a per-process keyed hash of their
    id; records left out by the cap are neither verified nor counted as rejected.

    A record that is unsigned, signed by another peer than its subkey names, or whose signature
    does not verify is ignored and counted in ``signing.REJECTED["progress"]`` (logged once per
    subkey); malformed records (whatever their decoder raises), and records expiring more than
    ``max_ttl_s`` from now, are skipped with a debug log.

    Raises:
        NetworkError: the DHT did not answer within ``timeout_s``.
    """
    return [
        PeerProgress(peer_id=peer_id, record=record, expiration=expiration)
        for peer_id, record, expiration in read_signed(
            dht,
            keys.progress_key(run_id),
            "progress",
            lambda _, data: ProgressRecord.from_wire(data),
            timeout_s=timeout_s,
            max_ahead_s=max_ttl_s,
            prefer=prefer,
        )
    ]
