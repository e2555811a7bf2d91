"""A stock hivemind DHT node that asks another node to store raw bytes (any bytes, any expiration),
the way any stranger on the swarm can. The victim's record validator (peer/net/validator.py) may
refuse; :meth:`Attacker.store_raw` says whether it did."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer


async def _raw_store(dht, node, *, target, key: str, value: bytes, subkey, ttl_s: float, expiration: float | None):
    sub = None if subkey is None else MSGPackSerializer.dumps(subkey)
    expiration = get_dht_time() + ttl_s if expiration is None else expiration
    ok = await node.protocol.call_store(target, [DHTID.generate(source=key)], [value], expiration, subkeys=[sub])
    return None if ok is None else [bool(x) for x in ok]


class Attacker:
    def __init__(self, victim):
        self.victim = victim
        self.dht = hivemind.DHT(
            initial_peers=[str(m) for m in victim.get_visible_maddrs()],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
        )

    def store_raw(
        self,
        key: str,
        value: bytes,
        *,
        subkey=None,
        ttl_s: float = 60.0,
        expiration: float | None = None,
    ) -> bool:
        """Ask the victim to store ``value`` (bytes as they travel) under ``key`` (and ``subkey``) until
        ``expiration`` (default: ``ttl_s`` from now). Returns whether the victim accepted it (its
        record validator may refuse)."""
        ok = self.dht.run_coroutine(
            functools.partial(
                _raw_store,
                target=self.victim.peer_id,
                key=key,
                value=value,
                subkey=subkey,
                ttl_s=ttl_s,
                expiration=expiration,
            )
        )
        assert ok is not None and len(ok) == 1, ok  # the victim answered
        return ok[0]

    def store(self, key: str, value, *, subkey=None, ttl_s: float = 60.0, expiration: float | None = None) -> bool:
        """Ask the victim to store a msgpack value of the attacker's choice; returns whether it accepted."""
        return self.store_raw(key, MSGPackSerializer.dumps(value), subkey=subkey, ttl_s=ttl_s, expiration=expiration)

    def shutdown(self) -> None:
        self.dht.shutdown()


@contextlib.contextmanager
def victim_and_attacker(identity=None):
    """An honest DHT node of ours (``peer.net.dht_node.start_dht``, with ``identity`` if given) and an
    :class:`Attacker` connected to it; both shut down on exit, whatever happened."""
    from peer.net import dht_node

    peer = attacker = None
    try:
        peer = dht_node.start_dht() if identity is None else dht_node.start_dht(identity_path=str(identity))
        attacker = Attacker(peer)
        yield peer, attacker
    finally:
        if attacker is not None:
            attacker.shutdown()
        if peer is not None:
            peer.shutdown()


def sybil_signers(count: int, *, primes: int | None = None) -> list:
    """``count`` distinct RSA identities (``protocol.signing.PeerSigner``), made the way an attacker
    makes them cheaply: a few RSA keys' primes, every pair of them one 1024-bit key (a distinct
    modulus, so a distinct peer id). 20,000 identities take a few seconds; one real key each would
    take ~40 ms apiece."""
    import itertools

    from cryptography.hazmat.primitives.asymmetric import rsa

    from protocol.signing import PeerSigner

    pool: list[int] = []
    while len(pool) < (primes or 2 + int((2 * count) ** 0.5)):
        numbers = rsa.generate_private_key(public_exponent=65537, key_size=1024).private_numbers()
        pool += [numbers.p, numbers.q]
    out = []
    for p, q in itertools.islice(itertools.combinations(pool, 2), count):
        e, phi = 65537, (p - 1) * (q - 1)
        d = pow(e, -1, phi)
        private = rsa.RSAPrivateNumbers(
            p,
            q,
            d,
            rsa.rsa_crt_dmp1(d, p),
            rsa.rsa_crt_dmq1(d, q),
            rsa.rsa_crt_iqmp(p, q),
            rsa.RSAPublicNumbers(e, p * q),
        ).private_key(unsafe_skip_rsa_key_validation=True)
        out.append(PeerSigner(private))
    if len(out) < count:
        raise ValueError(f"{len(pool)} primes make {len(out)} identities, fewer than {count}")
    return out


async def _store_many(_dht, node, *, key: str, values: list, subkeys: list, expirations: list, chunk: int):
    stored = 0
    for i in range(0, len(values), chunk):
        result = await node.store_many(
            [key] * len(values[i : i + chunk]),
            values[i : i + chunk],
            expirations[i : i + chunk],
            subkeys=subkeys[i : i + chunk],
        )
        stored += sum(bool(ok) for ok in result.values()) if isinstance(result, dict) else 0
    return stored


async def _store_direct(_dht, node, *, key: str, values: list, subkeys: list, expiration: float, targets: int):
    """In the attacker's DHT process: store ``values`` under ``key`` on the ``targets`` nodes nearest
    to it, one request per node, without a lookup per request (hivemind's ``store_many`` looks the
    key up first, and each lookup's answers carry every record stored so far)."""
    key_id = DHTID.generate(source=key)
    nearest = list(node.protocol.routing_table.get_nearest_neighbors(key_id, targets, exclude=node.node_id))
    results = await asyncio.gather(
        *(
            node.protocol.call_store(
                peer_id, [key_id] * len(values), values, [expiration] * len(values), subkeys=list(subkeys)
            )
            for _, peer_id in nearest
        )
    )
    return sum(1 for ok in results if ok is not None and any(ok))


async def _learn_nodes(_dht, node, *, key: str) -> int:
    """In the attacker's DHT process: look ``key`` up once, which fills the routing table with the
    nodes nearest to it; returns how many nodes it knows."""
    await node.find_nearest_nodes([DHTID.generate(source=key)])
    return len(node.protocol.routing_table.uid_to_peer_id)


def flood_records(
    dht, key: str, signers, record_wire: dict, *, ttl_s: float = 600.0, chunk: int = 25, targets: int = 5
) -> int:
    """Store, from ``dht`` (the attacker's node), one record per signer under ``key``, each validly
    signed by its own identity (the envelope of ``protocol.signing.PeerSigner.seal``), on the
    ``targets`` nodes nearest to ``key`` (hivemind's ``num_replicas``, what its ``store`` reaches),
    ``chunk`` records per request (hivemind's pipe to the DHT process refuses messages of
    megabytes). The key is looked up once, not per request: hivemind's ``store_many`` looks it up
    each time, and each lookup's answers carry every record stored so far, so a flood of 20,000
    through it is quadratic. Returns how many requests some node accepted (at least one record)."""
    from hivemind.utils import get_dht_time

    dht.run_coroutine(functools.partial(_learn_nodes, key=key))
    expiration = get_dht_time() + ttl_s
    stored = 0
    for i in range(0, len(signers), chunk):
        part = signers[i : i + chunk]
        stored += dht.run_coroutine(
            functools.partial(
                _store_direct,
                key=key,
                values=[MSGPackSerializer.dumps(signer.seal(key, expiration, record_wire)) for signer in part],
                subkeys=[s.peer_id for s in part],
                expiration=expiration,
                targets=targets,
            )
        )
    return stored
