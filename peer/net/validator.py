"""The record validator every DHT node of ours runs: unsigned values under protected keys are refused.

hivemind keeps one value per (key, subkey) in a node's storage, the one with the latest
expiration, and a plain value may replace a whole dictionary. Without a check on store, a stranger
who writes garbage (or a record signed by someone else) under a run's announcement or a peer's
record, with a later expiration, hides the real one from every reader. hivemind runs a node's
record validators on every value another node asks it to store and on every value another node
returns to one of its reads (hivemind.dht.protocol ``rpc_store``, ``call_find``); a dictionary
returned with one invalid entry is dropped whole, so a node that stores anything (a stock node)
cannot feed our readers either.

Protected keys, each only with subkeys and only with values that verify (protocol/signing.py):

* ``locoswarm_runs`` (protocol/keys.py ``RUNS_KEY``), protected from the start: subkey a run id,
  value that run's manifest signed by its owner (protocol/manifest.py ``open_announcement``);
* a run's progress, addresses and devices keys, once the node knows its run (:func:`protect_run`): subkey
  a peer id, value a record signed by that peer (``open_record``).

* the run's matchmaking keys (hivemind's averager declarations, ``f"{prefix}.0b{group bits}"``) for
  a window of rounds around the node's current round (:func:`protect_round`, called by the
  averager each round): subkey the bytes of a libp2p peer id, value a bool (hivemind's
  "looking for group"). A plain value there (hivemind lets a plain value with a later expiration
  replace the whole dictionary of declarations) or junk entries would otherwise stop every group
  from forming in those rounds.

Other keys (other runs' records, matchmaking keys outside the window) pass unchecked: their readers
check them. hivemind gives the validator a key's DHTID only, not its name, so a key is protected by
its id.
"""

from __future__ import annotations

import functools
import logging

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from peer.net.dht import call_in_dht
from protocol import keys
from protocol.manifest import open_announcement
from protocol.signing import open_record

logger = logging.getLogger(__name__)


MATCHMAKING_ROUNDS_BEHIND = 2
"""Rounds before the current one whose matchmaking keys stay protected (a peer one or two rounds
behind still matches under them)."""

MATCHMAKING_ROUNDS_AHEAD = 8
"""Rounds after the current one whose matchmaking keys are protected in advance: an attacker who
poisons keys before a peer reaches them finds every node of ours already refusing."""

MATCHMAKING_ATTEMPTS = 2
"""Attempts per round (protocol/keys.py ``round_group_bits``): the first and the retry
(``NetworkTransport.RETRIES`` = 1)."""

MATCHMAKING_GROUP_INDEXES = 16
"""With random groups (NoLoCo), group indexes 0..15 of each round are protected; keys of groups
with a higher index are not (documented limit: a run with more than 16 random groups per round is
protected only for its first 16)."""

_MAX_PEER_ID_BYTES = 64


def is_peer_id_bytes(data) -> bool:
    """True for the bytes of a libp2p peer id: a multihash, either sha2-256 (0x12 0x20, 32 bytes:
    RSA and other large keys) or identity (0x00, length, the protobuf public key: Ed25519)."""
    if not isinstance(data, bytes) or not 2 < len(data) <= _MAX_PEER_ID_BYTES:
        return False
    if data[0] == 0x12:
        return data[1] == 0x20 and len(data) == 34
    return data[0] == 0x00 and data[1] == len(data) - 2


def matchmaking_keys(prefix: str, round_: int) -> list[str]:
    """The matchmaking keys of ``prefix`` (protocol/keys.py ``averager_prefix``) for rounds
    ``round_ - MATCHMAKING_ROUNDS_BEHIND .. round_ + MATCHMAKING_ROUNDS_AHEAD``, every attempt,
    without a group index (DiLoCo) and with indexes ``0 .. MATCHMAKING_GROUP_INDEXES - 1`` (NoLoCo)."""
    out = []
    for r in range(round_ - MATCHMAKING_ROUNDS_BEHIND, round_ + MATCHMAKING_ROUNDS_AHEAD + 1):
        for index in (None, *range(MATCHMAKING_GROUP_INDEXES)):
            for attempt in range(MATCHMAKING_ATTEMPTS):
                out.append(f"{prefix}.0b{keys.round_group_bits(r, index, attempt)}")
    return out


def key_id(key: str) -> bytes:
    """The DHTID bytes hivemind stores ``key`` under (what a validator sees as ``record.key``)."""
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    """Refuses values under protected keys that are not signed as protocol/signing.py requires."""

    def __init__(self):
        self._protected: dict[bytes, tuple[str, str]] = {}
        self._matchmaking: dict[bytes, str] = {}  # DHTID → key, the current window (protect_round)
        self._matchmaking_at: tuple[str, int] | None = None
        self.protect(keys.RUNS_KEY, "runs")
        self.protect(keys.HOME_KEY, "record")  # a bootstrap node's home run, signed by it (peer/net/home_run.py)

    def protect(self, key: str, kind: str) -> None:
        """Check every value stored under ``key`` from now on as ``kind`` ("runs" or "record")."""
        self._protected[key_id(key)] = (kind, key)

    def protect_run(self, run_id: str) -> None:
        """Protect ``run_id``'s progress records, published addresses and device records."""
        self.protect(keys.progress_key(run_id), "record")
        self.protect(keys.addresses_key(run_id), "record")
        self.protect(keys.devices_key(run_id), "record")

    def protect_round(self, prefix: str, round_: int) -> None:
        """Protect the matchmaking keys of ``prefix`` around ``round_`` (:func:`matchmaking_keys`),
        replacing the previous window (keys of rounds left behind are no longer checked). The key
        ids are computed once per (prefix, round): a few hundred SHA-1 hashes."""
        if self._matchmaking_at == (prefix, round_):
            return
        self._matchmaking = {key_id(key): key for key in matchmaking_keys(prefix, round_)}
        self._matchmaking_at = (prefix, round_)

    def _validate_declaration(self, key: str, record: DHTRecord) -> bool:
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY):
            logger.debug("refusing a plain value over the matchmaking key %s", key)
            return False
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
            value = msgpack.unpackb(record.value, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            logger.debug("refusing an undecodable entry under the matchmaking key %s: %r", key, exc)
            return False
        if not is_peer_id_bytes(subkey) or not isinstance(value, bool):
            logger.debug("refusing an entry under the matchmaking key %s: not a peer id and a bool", key)
            return False
        return True

    def validate(self, record: DHTRecord) -> bool:
        """True for a value under an unprotected key, or a value that verifies under a protected one."""
        declaration_key = self._matchmaking.get(record.key)
        if declaration_key is not None:
            return self._validate_declaration(declaration_key, record)
        protected = self._protected.get(record.key)
        if protected is None:
            return True
        kind, key = protected
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY):
            logger.debug("refusing a plain value over the protected key %s", key)
            return False
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
            value = msgpack.unpackb(record.value, raw=False, strict_map_key=True)
            if kind == "runs":
                if not isinstance(subkey, str):
                    return False
                open_announcement(value, expected_run_id=subkey)
            else:
                open_record(key, subkey, record.expiration_time, value)
        except Exception as exc:  # msgpack, BadSignature, ManifestError...: all mean "not ours to store"
            logger.debug("refusing a value under the protected key %s: %r", key, exc)
            return False
        return True


async def _protect_run(dht, node, run_id: str) -> None:  # in the DHT process
    validator = node.protocol.record_validator
    for v in getattr(validator, "_validators", [validator]):
        if isinstance(v, SwarmRecordValidator):
            v.protect_run(run_id)


def protect_run(dht, run_id: str) -> None:
    """Make ``dht``'s node (started by peer/net/dht.py ``new_dht``) refuse unsigned records of ``run_id``.

    Raises ``NetworkError`` when the DHT process does not do it within ``peer.net.dht.CALL_TIMEOUT_S``,
    and whatever ``hivemind.DHT.run_coroutine`` raises (the DHT is not running).
    """
    call_in_dht(dht, functools.partial(_protect_run, run_id=run_id), "protecting the run's keys")


async def _protect_round(dht, node, prefix: str, round_: int) -> None:  # in the DHT process
    validator = node.protocol.record_validator
    for v in getattr(validator, "_validators", [validator]):
        if isinstance(v, SwarmRecordValidator):
            v.protect_round(prefix, round_)


def protect_round(dht, prefix: str, round_: int) -> None:
    """Make ``dht``'s node refuse anything but peer declarations (peer id → bool) under the
    matchmaking keys of ``prefix`` around ``round_`` (:meth:`SwarmRecordValidator.protect_round`).
    A node without a :class:`SwarmRecordValidator` is left as it is.

    Raises ``NetworkError`` when the DHT process does not do it within ``peer.net.dht.CALL_TIMEOUT_S``,
    and whatever ``hivemind.DHT.run_coroutine`` raises (the DHT is not running).
    """
    call_in_dht(dht, functools.partial(_protect_round, prefix=prefix, round_=round_), "protecting a round's keys")
