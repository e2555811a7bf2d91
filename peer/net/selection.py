"""Which entries of a DHT key with subkeys a reader keeps: the bound on what one read costs.

Identities are free: 20,000 records signed by 20,000 fresh identities once made every later round
"no group formed" and cost each peer ~500 MB (issue #51). A read (peer/net/dht.py ``read_entries``)
keeps at most :data:`MAX_RECORDS_READ` entries per key, chosen in the DHT process, this peer's
vouched peers first (:func:`select_entries`), so memory and signature checks per read are bounded
by count whatever is stored.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection

from protocol.signing import REJECTED, peer_id_of
from protocol.text import sanitize

logger = logging.getLogger(__name__)

MAX_EXPIRATION_AHEAD_S = 8 * 86400.0
"""A value expiring further ahead is ignored. The longest-lived honest value is a progress record
of a run at the manifest's largest sync timeouts (protocol/liveness.py ``record_ttl_s``: three
worst-case syncs, under 7 days); an attacker's 10-year expiry no longer pins its value."""


def entries(found, *, max_ahead_s: float = MAX_EXPIRATION_AHEAD_S) -> list[tuple[str, object, float]]:
    """``(subkey, value, expiration)`` of a value with subkeys as :func:`read_value` returned it:
    string subkeys only, without entries expiring more than ``max_ahead_s`` from now; ``[]`` for
    anything else (a plain value stored over a key that holds subkeys, say)."""
    from hivemind.utils import get_dht_time

    if found is None or not isinstance(found.value, dict):
        return []
    latest = get_dht_time() + max_ahead_s
    out = []
    for subkey, item in found.value.items():
        expiration = getattr(item, "expiration_time", None)
        if not isinstance(subkey, str) or not isinstance(expiration, (int, float)):
            continue
        if expiration > latest:
            logger.debug("ignoring the entry %r: it expires %.0f s from now", subkey[:64], expiration - latest)
            continue
        out.append((subkey, getattr(item, "value", None), float(expiration)))
    return out


MAX_RECORDS_READ = 256
"""The most entries a reader keeps (and verifies) from one read of a key with subkeys (a run's
progress, addresses, devices). Identities are free: 20,000 records signed by 20,000 fresh identities
once made every later round "no group formed" and cost each peer ~500 MB (issue #51). Only this
many cross from the DHT process to the reader (:func:`read_entries`), so its memory and its RSA checks
per read are bounded by count; the reader's vouched peers come first (:func:`select_entries`). A run
whose honest peers outnumber this is beyond what one reader tracks: its matchmaking still groups
whoever comes, its expected group size is bounded by what it reads."""

MAX_RUNS_READ = 64
"""The most announcements of the runs index verified per read (:func:`list_announced`): a few
thousand validly signed runs of an attacker's own once made the index's read overrun its deadline."""

_SELECTION_SALT = os.urandom(16)
"""Per-process key of :func:`select_entries`'s ordering: an attacker cannot compute which of its
subkeys a given reader keeps, and different readers keep different ones."""


def _rank(subkey: str) -> bytes:
    return hashlib.blake2b(subkey.encode("utf-8", "surrogatepass"), key=_SELECTION_SALT, digest_size=16).digest()


def rank_of(subkey) -> bytes:
    """The keyed-hash rank of any subkey (a str as :func:`select_entries` ranks it; bytes and other
    msgpack values by their msgpack encoding), 16 bytes: lower ranks are kept first."""
    if isinstance(subkey, str):
        return _rank(subkey)
    import msgpack

    try:
        data = msgpack.packb(subkey)
    except Exception:  # not msgpack-encodable: ranks last
        return b"\xff" * 16
    return hashlib.blake2b(b"\x00" + data, key=_SELECTION_SALT, digest_size=16).digest()


def _bound_to_subkey(subkey: str, value) -> bool:
    """Cheap pre-check (a hash, no RSA): ``value`` is an envelope whose public key's peer id is
    ``subkey``. Records that fail it are rejected by ``open_record`` anyway; here they do not take
    a place among the :data:`MAX_RECORDS_READ` kept."""
    try:
        return isinstance(value, dict) and isinstance(key := value.get("k"), bytes) and peer_id_of(key) == subkey
    except Exception:  # BadSignature, or anything a malformed value makes the encoder raise
        return False


def select_entries(
    found: list[tuple[str, object, float]],
    *,
    prefer: Collection[str] = (),
    cap: int | None = None,
    kind: str | None = None,
    signed: bool = True,
) -> list[tuple[str, object, float]]:
    """At most ``cap`` (default :data:`MAX_RECORDS_READ`) of ``found`` (:func:`entries`), the
    ones a reader should verify and keep, in their original order.

    With ``signed`` (per-peer records), entries whose envelope's key is not the subkey's identity
    are dropped first (cheap: a hash; counted in ``signing.REJECTED[kind]`` when ``kind`` is given).
    Of the rest, entries whose subkey is in ``prefer`` (this peer, its vouched peers) come first; when
    they alone would fill the cap, they get ``cap - cap // 2`` places and the others ``cap // 2``,
    so that a reader that once kept a flood's records still makes room for other peers. Within
    each group the order is a keyed hash of the subkey (:data:`_SELECTION_SALT`, per process), not
    the expiration: a writer chooses its expiration, so "newest" would keep the flood. No errors:
    anything malformed is dropped.
    """
    cap = MAX_RECORDS_READ if cap is None else cap
    if len(found) <= cap:
        return found
    bound = []
    for entry in found:
        if isinstance(entry[0], str) and (not signed or _bound_to_subkey(entry[0], entry[1])):
            bound.append(entry)
        elif kind is not None:
            REJECTED.note(kind, sanitize(str(entry[0]), max_chars=64), "the record is not signed by its subkey's peer")
    if len(bound) <= cap:
        return bound
    prefer = prefer if isinstance(prefer, (set, frozenset, dict)) else set(prefer)
    preferred = sorted((e for e in bound if e[0] in prefer), key=lambda e: _rank(e[0]))
    others = sorted((e for e in bound if e[0] not in prefer), key=lambda e: _rank(e[0]))
    if len(preferred) > cap - min(len(others), cap // 2):
        preferred = preferred[: cap - min(len(others), cap // 2)]
    kept = preferred + others[: cap - len(preferred)]
    position = {id(entry): i for i, entry in enumerate(found)}
    return sorted(kept, key=lambda e: position[id(e)])
