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

Other keys (hivemind's matchmaking, other runs' records) pass unchecked: their readers check them.
hivemind gives the validator a key's DHTID only, not its name, so a key is protected by its id.
"""

from __future__ import annotations

import functools
import logging

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from protocol import keys
from protocol.manifest import open_announcement
from protocol.signing import open_record

logger = logging.getLogger(__name__)


def key_id(key: str) -> bytes:
    """The DHTID bytes hivemind stores ``key`` under (what a validator sees as ``record.key``)."""
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    """Refuses values under protected keys that are not signed as protocol/signing.py requires."""

    def __init__(self):
        self._protected: dict[bytes, tuple[str, str]] = {}
        self.protect(keys.RUNS_KEY, "runs")

    def protect(self, key: str, kind: str) -> None:
        """Check every value stored under ``key`` from now on as ``kind`` ("runs" or "record")."""
        self._protected[key_id(key)] = (kind, key)

    def protect_run(self, run_id: str) -> None:
        """Protect ``run_id``'s progress records, published addresses and device records."""
        from protocol.addresses import addresses_key
        from protocol.devices import devices_key

        self.protect(keys.progress_key(run_id), "record")
        self.protect(addresses_key(run_id), "record")
        self.protect(devices_key(run_id), "record")

    def validate(self, record: DHTRecord) -> bool:
        """True for a value under an unprotected key, or a value that verifies under a protected one."""
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
    """Make ``dht``'s node (started by protocol/dht.py ``new_dht``) refuse unsigned records of ``run_id``.

    Raises whatever ``hivemind.DHT.run_coroutine`` raises (the DHT is not running).
    """
    dht.run_coroutine(functools.partial(_protect_run, run_id=run_id))
