"""A peer of a sharded run on the swarm's libp2p: serving the shard files it holds, and asking the
run's other peers for the ones it needs (protocol: peer/shards/serve.py)."""

from __future__ import annotations

import asyncio
import logging

from peer.pipeline.peer import LoopThread
from peer.shards.corpus import ShardedRun
from peer.shards.serve import PeerSource, protocol_name, serve_shard
from protocol.errors import NetworkError

logger = logging.getLogger(__name__)

MAX_SERVED_STREAMS = 4
"""Shard streams served at once; a stream beyond them is closed unanswered (the asker tries another)."""


class ShardSharing:
    """Registers the shard protocol on this peer's libp2p daemon (replicated into this process);
    :attr:`source` asks the run's other peers. It serves nothing until :meth:`serve` names the
    run's data; :meth:`close` removes the handler.

    Args:
        dht: the peer's hivemind DHT.
        run_id: the run (the protocol's prefix).
        peers: the other peers' ids to ask, e.g. from the swarm view's live records.

    Raises:
        NetworkError: the daemon could not be reached from this process within 30 s.
    """

    def __init__(self, dht, run_id: str, peers):
        from hivemind.p2p import PeerID

        self.loop = LoopThread("shard-sharing")
        self.name = protocol_name(run_id)
        self.data: ShardedRun | None = None
        self._slots = asyncio.Semaphore(MAX_SERVED_STREAMS)
        try:
            self.p2p = self.loop.run(dht.replicate_p2p(), timeout_s=30.0)
            self.loop.run(self.p2p.add_binary_stream_handler(self.name, self._handle), timeout_s=30.0)
        except Exception as exc:
            self.loop.stop()
            raise NetworkError(f"could not reach this peer's libp2p daemon to share shards: {exc}") from exc

        async def open_stream(peer_id: str):
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.name)
            return reader, writer

        self.source = PeerSource(self.loop.run, open_stream, peers)

    def serve(self, data: ShardedRun) -> None:
        """Serve ``data``'s store (and its local directory), and ask the peers for its shards."""
        self.data = data
        data.add_peer_source(self.source)

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = self.data
        if data is None or self._slots.locked():
            logger.info(
                "refused a shard stream from %s: not serving yet, or %d at once",
                stream_info.peer_id,
                MAX_SERVED_STREAMS,
            )
            writer.close()
            return
        async with self._slots:
            await serve_shard(reader, writer, data.store, data.local_dir)

    def close(self) -> None:
        try:
            self.loop.run(self.p2p.remove_binary_stream_handler(self.name), timeout_s=5.0)
        except Exception as exc:  # the daemon may be gone already
            logger.debug("removing the shard handler: %s", exc)
        self.loop.stop()
