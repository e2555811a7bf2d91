"""A stock hivemind DHT node that asks another node to store raw bytes (any bytes, any expiration),
the way any stranger on the swarm can. The victim's record validator (peer/net/validator.py) may
refuse; :meth:`Attacker.store_raw` says whether it did."""

from __future__ import annotations

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
