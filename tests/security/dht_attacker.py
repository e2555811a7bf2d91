"""A stock hivemind DHT node that writes raw bytes (any bytes, any expiration) into another node's
storage, the way any stranger on the swarm can."""

from __future__ import annotations

import functools

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer


async def _raw_store(dht, node, *, target, key: str, value: bytes, subkey, ttl_s: float):
    sub = None if subkey is None else MSGPackSerializer.dumps(subkey)
    ok = await node.protocol.call_store(target, [DHTID.generate(source=key)], [value], get_dht_time() + ttl_s,
                                        subkeys=[sub])
    return None if ok is None else [bool(x) for x in ok]


class Attacker:
    def __init__(self, victim):
        self.victim = victim
        self.dht = hivemind.DHT(initial_peers=[str(m) for m in victim.get_visible_maddrs()],
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)

    def store_raw(self, key: str, value: bytes, *, subkey=None, ttl_s: float = 60.0) -> None:
        """Put ``value`` (bytes as they travel) under ``key`` (and ``subkey``) in the victim's storage."""
        ok = self.dht.run_coroutine(functools.partial(_raw_store, target=self.victim.peer_id, key=key, value=value,
                                                      subkey=subkey, ttl_s=ttl_s))
        assert ok == [True], ok

    def store(self, key: str, value, *, subkey=None, ttl_s: float = 60.0) -> None:
        """Put a msgpack value of the attacker's choice there."""
        self.store_raw(key, MSGPackSerializer.dumps(value), subkey=subkey, ttl_s=ttl_s)

    def shutdown(self) -> None:
        self.dht.shutdown()
