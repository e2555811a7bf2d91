"""The state-transfer half of the averager: serve snapshots to joiners, download from donors.

Mixed into :class:`peer.sync.averager.LocoAverager` (a hivemind ``DecentralizedAverager``), which
runs in its own forked process and provides ``_p2p``, ``peer_id``, ``prefix``, ``serializer``,
``next_chunk_timeout``, ``_get_current_state_from_host_process`` and ``_call_in_averager``. The
host process holds the snapshots (peer/state/snapshot.py); the averager process asks it for them
when a joiner requests one it has not cached, and serves them (peer/state/serve.py). Downloads
run in the averager process too, where the libp2p streams are (peer/state/download.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from peer.net.limits import ServeBudget, StreamSlots
from peer.progress import TransferProgress
from peer.state import download
from peer.state.download import DownloadResult
from peer.state.serve import serve_state
from peer.state.snapshot import StateSnapshot, plan_chunks
from protocol.errors import StateDownloadFailed
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

StateProvider = Callable[[], list[StateSnapshot]]
"""Returns the snapshots this peer serves to joiners (peer/state/snapshot.py), newest last."""

STATE_STREAMS_PER_PEER = 2
"""State streams one joiner may hold open at once: a download opens one per donor per pass, and
one more covers a stream still closing when the next pass opens its own."""
STATE_STREAMS_TOTAL = 8
"""State streams all joiners may hold open at once; each holds at most one chunk (1 MiB) in
three copies while it is written, so 8 streams stay under ~25 MiB."""
STATES_PER_PEER = 1.0
"""Full states one joiner may download from this peer per ``STATE_PERIOD_S``: one join or
re-sync (a retried pass asks only for what is still missing)."""
STATES_TOTAL = 4.0
"""Full states all joiners together may download from this peer per ``STATE_PERIOD_S``: a joiner
spreads its download over every donor, so four full states a minute serve dozens of joiners."""
STATE_PERIOD_S = 60.0
"""Seconds in which the serve budgets refill."""
MIN_STATE_BYTES = 64 * 1024 * 1024
"""Budgets count a state as at least 64 MiB, so a small state (tests, tiny models) may be
downloaded often; what a request can buy is bounded by 64 MiB a minute per joiner either way."""


class StateSharing:
    """Serves this peer's state snapshots on ``<prefix>.LocoState.v<N>`` and downloads others'."""

    # from the hivemind DecentralizedAverager this mixes into (see the module docstring)
    prefix: str
    peer_id: Any
    serializer: Any
    next_chunk_timeout: float | None
    _call_in_averager: Callable[..., Any]
    _get_current_state_from_host_process: Callable[..., Any]

    def _init_state_sharing(self) -> None:
        """Call in ``__init__`` before the averager process forks."""
        self._state_provider: StateProvider | None = None
        self._state_lock = threading.Lock()
        self._served: dict[bytes, tuple[torch.Tensor, ...]] = {}  # host process: copies handed over, by digest
        # set in the averager process
        self._snapshots: dict[bytes, StateSnapshot] = {}
        self._snapshots_fetched_at = 0.0
        self._state_slots = StreamSlots(per_peer=STATE_STREAMS_PER_PEER, total=STATE_STREAMS_TOTAL)
        self._serve_budget = ServeBudget(
            per_peer_states=STATES_PER_PEER,
            total_states=STATES_TOTAL,
            period_s=STATE_PERIOD_S,
            min_state_bytes=MIN_STATE_BYTES,
        )

    @property
    def state_protocol(self) -> str:
        return f"{self.prefix}.LocoState.v{PROTOCOL_VERSION}"

    def set_state_provider(self, provider: StateProvider | None) -> None:
        with self._state_lock:
            self._state_provider = provider

    def get_current_state(self):
        """The snapshots to serve, for the averager process: (metadata, their tensors, None).

        Runs in the host process, in hivemind's background thread, when the averager process asks
        for the snapshots it serves (never for hivemind's own state download: state sharing is off).
        The tensors are copies: hivemind's pipe pickles them with torch's reductions, which move a
        tensor's storage into shared memory in place (its old memory freed), and a snapshot's tensors
        are the live φ and outer state (peer/round/state.py), which the training, sync and checkpoint
        threads read meanwhile; moved under them, they would read freed memory. Each snapshot is copied
        once: its copies are kept (by digest, while it is still served) and handed over again as they
        are, already in shared memory (the averager process maps the same pages), so a joiner asking
        again and again costs no copy.
        """
        with self._state_lock:
            snapshots = self._state_provider() if self._state_provider is not None else []
            served = {s.digest: self._served.get(s.digest) or tuple(t.clone() for t in s.tensors) for s in snapshots}
            self._served = served
        metadata = {
            "snapshots": [
                {"meta": s.meta, "hashes": list(s.chunk_hashes), "digest": s.digest, "tensors": len(s.tensors)}
                for s in snapshots
            ]
        }
        return metadata, [t for s in snapshots for t in served[s.digest]], None

    def download_state(
        self, donors: Sequence[str], digest: bytes, shapes: Sequence[torch.Size], run_id: str, timeout_s: float
    ) -> DownloadResult:
        """Download the state named ``digest`` from ``donors`` (peer id strings) at once, in the
        averager process (peer/state/download.py). Blocks until done.

        Raises:
            StateDownloadFailed: no donor delivered the remaining chunks; nothing is returned.
        """
        bound = self.download_bound_s(len(donors), timeout_s, 4 * sum(math.prod(shape) for shape in shapes))
        try:
            return self._call_in_averager(
                "_download_state",
                timeout=bound + 5,
                donors=list(donors),
                digest=digest,
                shapes=list(shapes),
                run_id=run_id,
                timeout_s=timeout_s,
                bound_s=bound,
            )
        except TimeoutError:
            raise StateDownloadFailed(f"state {digest.hex()} not downloaded within {bound:.0f} s", {}) from None

    @staticmethod
    def download_bound_s(donors: int, timeout_s: float, state_bytes: int) -> float:
        """Longest a state download may take, s: a silent-donor timeout for each of up to 3 passes
        (a pass ends when its donors delivered or failed), plus the bytes at 1 MB/s."""
        return timeout_s * min(donors + 1, 3) + state_bytes / 1e6 + 5

    # ---- in the averager process ----------------------------------------------------------
    async def _download_state(self, donors, digest, shapes, run_id, timeout_s, bound_s, future) -> None:
        from hivemind.p2p import PeerID

        async def open_stream(peer_id):
            _, reader, writer = await self._p2p.call_binary_stream_handler(
                PeerID.from_base58(peer_id), self.state_protocol
            )
            return reader, writer

        # a bar on the peer's stderr (this process shares it): a long download is no silent wait
        total_bytes = 4 * sum(math.prod(shape) for shape in shapes)  # φ and the outer state, fp32
        progress = TransferProgress("the swarm's state", total_bytes)

        def on_progress(chunks_done: int, chunks_total: int, bytes_read: int, donors_delivering: int) -> None:
            progress.update(
                int(total_bytes * chunks_done / max(1, chunks_total)), detail=f"from {donors_delivering} peer(s)"
            )

        try:
            result = await asyncio.wait_for(
                download.download_state(
                    [d for d in donors if d != str(self.peer_id)],
                    open_stream,
                    digest=digest,
                    shapes=shapes,
                    run_id=run_id,
                    timeout=timeout_s,
                    on_progress=on_progress,
                ),
                bound_s,
            )
            if not future.done():
                future.set_result(result)
        except TimeoutError:
            if not future.done():
                future.set_exception(
                    StateDownloadFailed(f"state {digest.hex()} not downloaded within {bound_s:.0f} s", {})
                )
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
        finally:
            progress.close()  # the last state of the transfer, also when it failed

    async def _snapshot_for(self, digest: bytes) -> StateSnapshot | None:
        """The snapshot named ``digest``, asking the host process for its current ones when it is not
        cached here (at most once a second, so bogus requests cannot make it copy state in a loop)."""
        if digest not in self._snapshots and asyncio.get_running_loop().time() - self._snapshots_fetched_at > 1.0:
            self._snapshots_fetched_at = asyncio.get_running_loop().time()
            try:
                raw_metadata, tensors, _ = await self._get_current_state_from_host_process()
                metadata = self.serializer.loads(raw_metadata)
            except Exception as exc:
                logger.debug("could not get the state to serve from the host process: %r", exc)
                return None
            fresh, offset = {}, 0
            for item in metadata["snapshots"]:
                own = tuple(tensors[offset : offset + item["tensors"]])
                offset += item["tensors"]
                fresh[item["digest"]] = StateSnapshot(
                    meta=item["meta"],
                    tensors=own,
                    chunks=tuple(plan_chunks([t.shape for t in own])),
                    chunk_hashes=tuple(item["hashes"]),
                    digest=item["digest"],
                )
            self._snapshots = fresh
        return self._snapshots.get(digest)

    async def _handle_state_stream(
        self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A joiner asks for chunks of a state snapshot (peer/state/serve.py); never raises.

        Bounded per joiner (its libp2p peer id) and in total: open streams (``STATE_STREAMS_*``)
        and full states served per minute (``STATES_*``); a stream over a bound is closed unanswered.
        """
        peer = stream_info.peer_id
        if not self._state_slots.acquire(peer):
            logger.warning(
                "refused a state stream from %s: %d open from it, %d in all",
                peer,
                self._state_slots.per_peer,
                self._state_slots.open,
            )
            writer.close()
            return
        try:
            await serve_state(
                reader,
                writer,
                self._snapshot_for,
                timeout=self.next_chunk_timeout or 5.0,
                admit=lambda request_bytes, state_bytes: self._serve_budget.take(peer, request_bytes, state_bytes),
            )
        finally:
            self._state_slots.release(peer)
