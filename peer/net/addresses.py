"""Where the peers of a run can be dialled: each peer publishes its own visible multiaddrs.

One DHT value per run, :func:`addresses_key`, subkey = peer id (base58), value = a list of that
peer's full multiaddrs (``/ip4/HOST/tcp/PORT/p2p/PEER_ID``), signed by the peer's identity key
like its progress record (protocol/signing.py): an entry whose signature does not match its peer
id is ignored and counted (``signing.REJECTED["addresses"]``), so no one can publish addresses in
another peer's name. A peer keeps its entry alive from a background thread
(peer/state/address_book.py), apart from its progress record, whose schema stays as it is.
Readers validate every address as a multiaddr ending in the publishing peer's own id and skip the
rest, so a malformed entry costs nothing but itself.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from peer.net import dht as swarm_dht
from peer.net.dht import parse_initial_peers, read_signed
from protocol.errors import BadPeerAddress
from protocol.keys import addresses_key
from protocol.signing import PeerSigner

logger = logging.getLogger(__name__)

ADDRESSES_TTL_S = 300.0
"""How long a peer's published addresses live in the DHT; the peer refreshes them well before."""

MAX_ADDRESSES_PER_PEER = 8
"""A peer publishes at most this many multiaddrs; readers ignore the rest."""

MAX_ADDRESS_CHARS = 512
"""Longer strings are not taken for multiaddrs."""


def check_peer_maddr(address: object) -> tuple[str, str]:
    """Validate one dialable peer address.

    Returns:
        ``(canonical multiaddr, peer id)``.

    Raises:
        BadPeerAddress: not a string, too long, not a multiaddr, or without a /p2p/PEER_ID part.
    """
    from hivemind.utils.multiaddr import Multiaddr

    if not isinstance(address, str) or not address or len(address) > MAX_ADDRESS_CHARS:
        raise BadPeerAddress(f"{address!r:.80} is not a multiaddr string of at most {MAX_ADDRESS_CHARS} characters")
    [canonical] = parse_initial_peers([address])
    return canonical, Multiaddr(canonical).value_for_protocol("p2p")


def valid_addresses(peer_id: str, value: object) -> list[str]:
    """The valid multiaddrs of ``peer_id`` in a published ``value`` (at most MAX_ADDRESSES_PER_PEER)."""
    if not isinstance(value, list):
        return []
    out = []
    for item in value[:MAX_ADDRESSES_PER_PEER]:
        try:
            canonical, owner = check_peer_maddr(item)
        except BadPeerAddress as exc:
            logger.debug("ignoring an address published by %s: %s", peer_id, exc)
            continue
        if owner == peer_id and canonical not in out:
            out.append(canonical)
    return out


def publish_addresses(
    dht, run_id: str, signer: PeerSigner, maddrs: Sequence[str], ttl_s: float = ADDRESSES_TTL_S
) -> bool:
    """Store this peer's multiaddrs under the run's addresses key, signed by ``signer`` under its
    peer id. Returns whether a node accepted them."""
    from hivemind.utils import get_dht_time

    key, expiration = addresses_key(run_id), get_dht_time() + ttl_s
    value = [str(m) for m in maddrs][:MAX_ADDRESSES_PER_PEER]
    return swarm_dht.store(dht, key, signer.seal(key, expiration, value), expiration, subkey=signer.peer_id)


def read_addresses(dht, run_id: str, *, prefer: Collection[str] = ()) -> dict[str, list[str]]:
    """Every peer's published multiaddrs (validated): peer id → addresses; peers with none valid,
    or whose entry expires further ahead than a peer publishes, are left out.

    At most ``MAX_RECORDS_READ`` entries are verified and kept (peer/net/dht.py ``select_entries``:
    ``prefer`` first, then a per-process keyed hash of the peer id): a flood of records signed by
    fresh identities costs a bounded number of signature checks.

    Raises:
        NetworkError: the DHT did not answer in time (peer/net/dht.py ``read_value``).
    """
    found = read_signed(
        dht, addresses_key(run_id), "addresses", valid_addresses, max_ahead_s=ADDRESSES_TTL_S + 600, prefer=prefer
    )
    return {peer_id: addresses for peer_id, addresses, _ in found if addresses}
