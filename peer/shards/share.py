"""A peer of a sharded run, or of a run with a BPE tokenizer, on the swarm's libp2p: serving the shard
files and the run's tokenizer.json it holds, and asking the run's other peers for the ones it needs
(protocol: peer/shards/serve.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from peer.net import dht as swarm_dht
from peer.pipeline.peer import LoopThread
from peer.shards.corpus import ShardedRun
from peer.shards.serve import PeerSource, listing, protocol_name, serve_stream, serving_slots
from peer.train.bpe import held_path
from protocol.errors import NetworkError

logger = logging.getLogger(__name__)


class ShardSharing:
    """Registers the shard protocol on this peer's libp2p daemon (replicated into this process);
    :attr:`source` asks the run's other peers for shards, :meth:`fetch_tokenizer` for the run's
    tokenizer. It serves the run's tokenizer (when held here) at once, shards only once
    :meth:`serve` names the run's data, and then only the files of the run's list, each by its hash;
    at most 4 streams at once, 2 per asking peer (peer/shards/serve.py ``serve_stream``).
    :meth:`close` removes the handler.

    Args:
        dht: the peer's hivemind DHT.
        run_id: the run (the protocol's prefix).
        peers: the other peers' ids to ask, e.g. from the swarm view's live records.
        tokenizer_sha256: the run's ``data.tokenizer_sha256``: the one tokenizer served ("" none).
        cache_dir: holds this machine's tokenizer store (peer/train/bpe.py ``store_path``).

    Raises:
        NetworkError: the daemon could not be reached from this process within 30 s.
    """

    def __init__(self, dht, run_id: str, peers, *, tokenizer_sha256: str = "", cache_dir: Path | None = None):
        from hivemind.p2p import PeerID

        self.loop = LoopThread("shard-sharing")
        self.name = protocol_name(run_id)
        self.data: ShardedRun | None = None
        self.tokenizer_file: Callable[[str], Path | None] = lambda sha256: (
            held_path(sha256, cache_dir) if cache_dir is not None and tokenizer_sha256 == sha256 else None
        )
        """What a tokenizer REQUEST is answered with: the file of that hash, or None (not held)."""
        self._served: tuple[ShardedRun, dict[str, str]] | None = None
        """The run's data and its list (name → SHA-256): what is served, set by :meth:`serve`."""
        self._slots = serving_slots()
        self._dht, self._run_id = dht, run_id
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
        # at join the swarm view is not up yet and the initial peers may be a bootstrap node holding
        # nothing: the live peers the run's progress records name are asked first
        self._tokenizer_source = PeerSource(self.loop.run, open_stream, lambda: [*self._recorded(), *peers()])

    def serve(self, data: ShardedRun) -> None:
        """Serve ``data``'s store (and its local directory), and ask the peers for its shards."""
        self.data = data
        self._served = (data, listing(data.index, data.spec.shards_sha256))
        data.add_peer_source(self.source)

    def fetch_tokenizer(self, sha256: str) -> bytes:
        """The tokenizer.json of hash ``sha256`` from the run's peers (peer/train/bpe.py ``AskPeers``):
        those of the run's progress records on the DHT, then ``peers``.

        Raises:
            FileNotFoundError: no peer gave those bytes (peer/shards/serve.py ``PeerSource.fetch_tokenizer``).
        """
        return self._tokenizer_source.fetch_tokenizer(sha256)

    def _recorded(self) -> list[str]:
        try:
            records = swarm_dht.read_progress(self._dht, self._run_id)
        except NetworkError as exc:
            logger.debug("reading the run's progress records: %s", exc)
            return []
        me = str(self._dht.peer_id)
        return [r.peer_id for r in records if r.peer_id != me]

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = self._served  # None: no shard served yet, the tokenizer is
        await serve_stream(
            self._slots,
            str(stream_info.peer_id),
            reader,
            writer,
            served[0].store if served is not None else None,
            served[0].local_dir if served is not None else None,
            listed=served[1] if served is not None else None,
            tokenizers=self.tokenizer_file,
        )

    def close(self) -> None:
        try:
            self.loop.run(self.p2p.remove_binary_stream_handler(self.name), timeout_s=5.0)
        except Exception as exc:  # the daemon may be gone already
            logger.debug("removing the shard handler: %s", exc)
        self.loop.stop()
