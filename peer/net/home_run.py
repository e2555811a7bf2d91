"""The run a bootstrap node announces as its own, signed by the node's identity (issue #51, item 5).

Owner keys cost nothing, so anyone can announce validly signed runs of its own beside the swarm's:
a plain ``peer join`` must not have to guess among them. The bootstrap node it dialed is the one
node it already trusts (the ``/p2p/PEER_ID`` of ``--initial-peers`` names it), so ``bootstrap run``
stores, under :data:`protocol.keys.HOME_KEY` with its peer id as subkey, the id of the run it serves,
signed by its libp2p identity key (protocol/signing.py ``PeerSigner``: the same envelope as a progress
record). A joiner reads that one entry (:func:`read_home_run`) and checks the signature against the
peer id it dialed: a stranger cannot write a home run for a node whose key it does not hold, and every
node of ours refuses unsigned values under the key (peer/net/validator.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from peer.net import dht as swarm_dht
from peer.net.periodic import Periodic
from protocol import keys
from protocol.errors import BadSignature
from protocol.signing import REJECTED, PeerSigner, open_record

logger = logging.getLogger(__name__)

HOME_TTL_S = 300.0
"""How long a home-run record lives in the DHT, s; the node stores it again every ttl/5."""


def _is_run_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


class HomeRunAnnouncer(Periodic):
    """Keeps ``{"run_id": run_id}``, signed by ``signer``, under :data:`protocol.keys.HOME_KEY`
    (subkey: the signer's peer id) until :meth:`stop`.

    Raises:
        ValueError: ``run_id`` is not a run id (1 to 64 lowercase hex digits).
    """

    def __init__(self, dht, signer: PeerSigner, run_id: str, ttl_s: float = HOME_TTL_S):
        if not _is_run_id(run_id):
            raise ValueError(f"run id {run_id!r}: expected 1 to 64 lowercase hex digits")
        super().__init__(period_s=ttl_s / 5 if ttl_s > 5 else 1.0, name="home-run-announcer")
        self.dht, self.signer, self.run_id, self.ttl_s = dht, signer, run_id, ttl_s

    def tick(self) -> None:
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + self.ttl_s
        value = self.signer.seal(keys.HOME_KEY, expiration, {"run_id": self.run_id})
        if not swarm_dht.store(self.dht, keys.HOME_KEY, value, expiration, subkey=self.signer.peer_id):
            logger.debug("no DHT node accepted the home-run record; retrying")


def bootstrap_ids(initial_peers: Sequence[str]) -> list[str]:
    """The peer ids (``/p2p/ID``) of the multiaddrs in ``initial_peers``, in order, without repeats;
    malformed addresses are skipped (``peer.net.dht.parse_initial_peers`` refuses them earlier)."""
    out: list[str] = []
    for address in initial_peers:
        parts = str(address).split("/")
        for i, part in enumerate(parts[:-1]):
            if part == "p2p" and parts[i + 1] and parts[i + 1] not in out:
                out.append(parts[i + 1])
    return out


def read_home_run(dht, peer_ids: Sequence[str], *, timeout_s: float = swarm_dht.READ_TIMEOUT_S) -> str | None:
    """The run id that the first of ``peer_ids`` to announce one announces as its own, signed by it;
    None when none does (a node of an older version, one without a run, or no answer in time).

    Reads only the entry of each peer id (``peer.net.dht.read_entries`` with ``only``); an entry whose
    signature does not verify against its peer id is ignored and counted (``signing.REJECTED["home"]``).
    No errors: a failed read is None.
    """
    for peer_id in peer_ids:
        try:
            found = swarm_dht.read_entries(dht, keys.HOME_KEY, timeout_s=timeout_s, only=peer_id)
        except Exception as exc:  # NetworkError, or a DHT shutting down
            logger.debug("reading the home run of %s failed: %r", peer_id, exc)
            continue
        for subkey, value, expiration in found:
            try:
                data = open_record(keys.HOME_KEY, subkey, expiration, value)
            except BadSignature as exc:
                REJECTED.note("home", peer_id, exc)
                continue
            run_id = data.get("run_id") if isinstance(data, dict) else None
            if _is_run_id(run_id):
                return run_id
    return None
