"""hivemind's DecentralizedAverager with locoswarm's own all-reduce (peer/sync/allreduce.py).

Runs in its own process (hivemind forks it). What it keeps from hivemind: matchmaking (groups of
peers at the same round, keyed by run id and round) and state download for joiners. What it
replaces: the all-reduce itself, so that

* pseudo-gradients travel compressed by the run's codec (protocol/codecs.py), with this peer's
  error-feedback residuals kept here, committed only when a round completes;
* every frame is validated (protocol/wire.py) and every byte written and read is counted;
* a groupmate that fails is excluded by a stated rule, and a round this peer could not complete
  is never applied (hivemind 1.1.12 reports success with parts un-averaged; DESIGN.md).

The class name is part of the wire protocol: hivemind derives RPC handler names from it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing as mp
import threading
from typing import Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously

from peer.state import transfer as statesync
from peer.sync.allreduce import GroupAllreduce, GroupPlan, PartialAverage, Piece, piece_shape, plan_pieces
from protocol import codecs, groups, wire
from protocol.errors import BadPayload
from protocol.manifest import CompressionSpec
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

INCOMPLETE = "locoswarm.incomplete"
"""Key of the result an all-reduce returns when this peer could not complete it (value: the reason)."""

StateProvider = Callable[[], list[statesync.StateSnapshot]]
"""Returns the snapshots this peer serves to joiners (peer/state/transfer.py), newest last."""


class AllreduceIncomplete(AllreduceException):
    """This peer did not get a valid mean for every piece; nothing was applied."""


class LocoAverager(DecentralizedAverager):
    """Averages pseudo-gradients within a group of peers at the same round.

    Args:
        averaged_tensors: fp32 buffers shaped like the payload; hivemind moves them to shared
            memory. The trainer writes its payload into them before a step and reads the group
            mean after.
        compression: the run's codecs.
        phi_from: index of the first tensor that is φ rather than Δ (NoLoCo's payload is Δ then
            φ; φ uses ``compression.phi_codec`` and no error feedback); None: all Δ.
        piece_elements: target piece size of the all-reduce.
        **kwargs: passed to DecentralizedAverager (``next_chunk_timeout`` is required).
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht, *, compression: CompressionSpec,
                 phi_from: int | None = None, piece_elements: int | None = None, **kwargs):
        if kwargs.get("next_chunk_timeout") is None:
            raise ValueError("LocoAverager needs next_chunk_timeout: a silent groupmate must not stall a round")
        self.compression, self.phi_from = compression, phi_from
        self.piece_elements = piece_elements
        self._stats = {name: mp.Value(ctypes.c_double, 0.0)
                       for name in ("bytes_sent", "bytes_received", "excluded", "partial_pieces", "send_seconds",
                                    "allreduce_seconds", "started_at")}
        self._state_provider: StateProvider | None = None
        self._state_lock = threading.Lock()
        # set in the averager process
        self._sessions: dict[bytes, asyncio.Future] = {}
        self._snapshots: dict[bytes, statesync.StateSnapshot] = {}
        self._snapshots_fetched_at = 0.0
        self._error_feedback = None
        self._uplink_bytes_per_s = compression.uplink_mbps * 1e6 / 8
        super().__init__(averaged_tensors, dht, **kwargs)

    @property
    def stream_protocol(self) -> str:
        return f"{self.prefix}.LocoAllreduce.v{PROTOCOL_VERSION}"

    def reset_stats(self) -> None:
        for value in self._stats.values():
            value.value = 0.0

    @property
    def last_stats(self) -> dict[str, float]:
        """Counters of this peer's last all-reduce: bytes_sent / bytes_received (frame bytes written
        to and read from its streams), excluded (senders this peer excluded as an owner),
        partial_pieces (means that left out a sender), send_seconds (until this peer's last piece
        was written), allreduce_seconds (the whole exchange, after matchmaking)."""
        return {name: value.value for name, value in self._stats.items()}

    @property
    def state_protocol(self) -> str:
        return f"{self.prefix}.LocoState.v{PROTOCOL_VERSION}"

    def set_state_provider(self, provider: StateProvider | None) -> None:
        with self._state_lock:
            self._state_provider = provider

    def get_current_state(self):
        # Runs in the host process, in hivemind's background thread, when the averager process asks
        # for the snapshots it serves (never for hivemind's own state download: state sharing is off).
        with self._state_lock:
            snapshots = self._state_provider() if self._state_provider is not None else []
        metadata = {"snapshots": [{"meta": s.meta, "hashes": list(s.chunk_hashes), "digest": s.digest,
                                   "tensors": len(s.tensors)} for s in snapshots]}
        return metadata, [t for s in snapshots for t in s.tensors], None

    def download_state(self, donors: Sequence[str], digest: bytes, shapes: Sequence[torch.Size], run_id: str,
                       timeout_s: float) -> statesync.DownloadResult:
        """Download the state named ``digest`` from ``donors`` (peer id strings) at once, in the
        averager process (peer/state/transfer.py). Blocks until done.

        Raises:
            StateDownloadFailed: no donor delivered the remaining chunks; nothing is returned.
        """
        bound = self.download_bound_s(len(donors), timeout_s, 4 * sum(math.prod(shape) for shape in shapes))
        try:
            return self._call_in_averager("_download_state", timeout=bound + 5, donors=list(donors), digest=digest,
                                          shapes=list(shapes), run_id=run_id, timeout_s=timeout_s, bound_s=bound)
        except TimeoutError:
            raise statesync.StateDownloadFailed(f"state {digest.hex()} not downloaded within {bound:.0f} s", {}) from None

    def _call_in_averager(self, method: str, *, timeout: float | None = None, **kwargs):
        """Run ``await self.<method>(**kwargs, future=...)`` in the averager process; return its result.

        Raises:
            TimeoutError: no result within ``timeout`` seconds (the call is cancelled); whatever
                the method set as the future's exception.
        """
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise

    @staticmethod
    def download_bound_s(donors: int, timeout_s: float, state_bytes: int) -> float:
        """Longest a state download may take, s: a silent-donor timeout for each of up to 3 passes
        (a pass ends when its donors delivered or failed), plus the bytes at 1 MB/s."""
        return timeout_s * min(donors + 1, 3) + state_bytes / 1e6 + 5

    async def _download_state(self, donors, digest, shapes, run_id, timeout_s, bound_s, future) -> None:
        from hivemind.p2p import PeerID

        async def open_stream(peer_id):
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                           self.state_protocol)
            return reader, writer

        try:
            result = await asyncio.wait_for(statesync.download_state(
                [d for d in donors if d != str(self.peer_id)], open_stream, digest=digest, shapes=shapes,
                run_id=run_id, timeout=timeout_s), bound_s)
            if not future.done():
                future.set_result(result)
        except asyncio.TimeoutError:
            if not future.done():
                future.set_exception(statesync.StateDownloadFailed(
                    f"state {digest.hex()} not downloaded within {bound_s:.0f} s", {}))
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)

    async def _snapshot_for(self, digest: bytes) -> statesync.StateSnapshot | None:
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
                own = tuple(tensors[offset:offset + item["tensors"]])
                offset += item["tensors"]
                fresh[item["digest"]] = statesync.StateSnapshot(
                    meta=item["meta"], tensors=own, chunks=tuple(statesync.plan_chunks([t.shape for t in own])),
                    chunk_hashes=tuple(item["hashes"]), digest=item["digest"])
            self._snapshots = fresh
        return self._snapshots.get(digest)

    def configure_round(self, *, target_group_size: int, matchmaking_s: float, allreduce_s: float) -> None:
        """Set the next sync's group size target and deadlines (peer/sync/deadlines.py) in the averager process.

        Args:
            target_group_size: matchmaking starts the all-reduce as soon as this many peers joined.
            matchmaking_s: how long a leader waits for more groupmates before starting with fewer.
            allreduce_s: deadline of the all-reduce once the group is formed.
        """
        self._call_in_averager("_configure_round", size=target_group_size, matchmaking_s=matchmaking_s,
                               allreduce_s=allreduce_s)

    def reset_error_feedback(self) -> None:
        """Forget the error-feedback residuals in the averager process (they belong to a φ this
        peer no longer holds once it adopted another peer's state)."""
        self._call_in_averager("_reset_error_feedback")

    async def _reset_error_feedback(self, future) -> None:
        self._error_feedback = None
        future.set_result(None)

    async def _configure_round(self, size: int, matchmaking_s: float, allreduce_s: float, future) -> None:
        matchmaking = self._matchmaking
        matchmaking.target_group_size = size
        matchmaking.group_key_manager.target_group_size = size
        matchmaking.min_matchmaking_time = matchmaking_s
        matchmaking.potential_leaders.min_matchmaking_time = matchmaking_s
        self._allreduce_timeout = allreduce_s
        future.set_result(None)

    # ---- in the averager process ----------------------------------------------------------
    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced: bool = False) -> None:
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        await p2p.add_binary_stream_handler(self.stream_protocol, self._handle_stream)
        await p2p.add_binary_stream_handler(self.state_protocol, self._handle_state_stream)

    async def _handle_state_stream(self, stream_info, reader: asyncio.StreamReader,
                                   writer: asyncio.StreamWriter) -> None:
        """A joiner asks for chunks of a state snapshot (peer/state/transfer.py); never raises."""
        await statesync.serve_state(reader, writer, self._snapshot_for, timeout=self.next_chunk_timeout or 5.0)

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A groupmate opened a stream to send us its pieces: route it to our session for its group."""
        timeout = self.next_chunk_timeout
        try:
            payload = await wire.read_frame(reader, max_bytes=wire.MAX_HELLO_BYTES, timeout=timeout)
            hello = wire.parse_hello(payload, group_size=wire.MAX_GROUP_SIZE)
            future = self._session_future(hello.group_id)
            session = await asyncio.wait_for(asyncio.shield(future), timeout)
        except (BadPayload, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.warning("rejected an all-reduce stream from %s: %s", stream_info.peer_id, exc)
            writer.close()
            return
        await session.serve(stream_info.peer_id, payload, reader, writer)

    def _session_future(self, group_id: bytes) -> asyncio.Future:
        future = self._sessions.get(group_id)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._sessions[group_id] = loop.create_future()
            # forget groups that never start here (a stale or bogus HELLO) after a while
            loop.call_later(4 * (self.next_chunk_timeout or 5.0) + 60, self._sessions.pop, group_id, None)
        return future

    def _codecs_for(self, pieces: list[Piece], shapes: list[torch.Size], group_size: int, tensors):
        spec = self.compression
        n_delta = len(shapes) if self.phi_from is None else self.phi_from
        per_tensor = [None] * len(shapes)
        if spec.codec == "adaptive":
            from peer.sync.adaptive import plan as adaptive_plan

            chosen = adaptive_plan(list(tensors[:n_delta]), spec, uplink_bytes_per_s=self._uplink_bytes_per_s,
                                   group_size=group_size)
            per_tensor[:n_delta] = chosen
        piece_codecs = []
        for piece in pieces:
            role = "delta" if piece.tensor < n_delta else "phi"
            codec = per_tensor[piece.tensor] or codecs.make_codec(spec, piece_shape(shapes[piece.tensor], piece),
                                                                  role=role)
            piece_codecs.append(codec)
        return piece_codecs

    def _splittable(self, index: int) -> bool:
        # low-rank codecs want whole matrices; the adaptive policy may choose low rank anywhere
        return self.compression.codec not in ("lowrank", "adaptive")

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        """Run locoswarm's all-reduce in ``group_info``; return the groupmates' gathered metadata.

        Returns ``{INCOMPLETE: reason}`` instead when the group's rounds disagree or this peer did
        not get a valid mean for every piece; the tensors and error-feedback residuals are then
        left unchanged.
        """
        group_id = group_info.group_id
        future = self._session_future(group_id)
        session = None
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes)))
            modes = [AveragingMode(m) for m in mode_ids]
            rounds = {(d or {}).get("round") if isinstance(d, dict) else None for d in user_gathered.values()}
            if len(rounds) != 1 or not isinstance(next(iter(rounds)), int):
                raise AllreduceIncomplete(f"groupmates are at different rounds {sorted(map(str, rounds))}")
            round_ = next(iter(rounds))
            n = len(group_info.peer_ids)
            my_index = group_info.peer_ids.index(self.peer_id)
            owners = [i for i, mode in enumerate(modes) if mode != AveragingMode.CLIENT]
            if not owners:
                raise AllreduceIncomplete("every groupmate is in client mode: nobody can reduce")
            async with enter_asynchronously(self.get_tensors()) as tensors:
                shapes = [t.shape for t in tensors]
                pieces = plan_pieces(shapes, owners, split=self._splittable,
                                     **({"piece_elements": self.piece_elements} if self.piece_elements else {}))
                piece_codecs = await asyncio.get_running_loop().run_in_executor(
                    self._codec_executor(), self._codecs_for, pieces, shapes, n, tensors)
                plan = GroupPlan(
                    group_id=group_id, peer_ids=tuple(group_info.peer_ids), my_index=my_index, pieces=pieces,
                    codecs=piece_codecs, mean_codecs=[c.for_mean(n) for c in piece_codecs],
                    max_piece_bytes=[codecs.max_encoded_bytes(piece_shape(shapes[p.tensor], p)) for p in pieces],
                    seeds=[groups.codec_seed(round_, p.index) for p in pieces],
                )
                ef = self._feedback(shapes)
                ef_lock = threading.Lock()

                def compensate(piece: Piece, x: torch.Tensor) -> torch.Tensor:
                    if ef is None or not self._has_feedback(piece):
                        return x
                    with ef_lock:
                        return ef.compensate(piece.tensor, x, rows=self._rows(piece, shapes))

                def stage(piece: Piece, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
                    if ef is None or not self._has_feedback(piece):
                        return
                    with ef_lock:
                        ef.stage(piece.tensor, compensated, decoded, rows=self._rows(piece, shapes))

                async def open_stream(peer_id):
                    _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, self.stream_protocol)
                    return reader, writer

                session = GroupAllreduce(plan, tensors, weight=kwargs.get("weight") or 1.0, compensate=compensate,
                                         stage=stage, open_stream=open_stream,
                                         next_chunk_timeout=self.next_chunk_timeout, executor=self._codec_executor())
                if not future.done():
                    future.set_result(session)
                # Our own deadline, a second before hivemind's: when it passes (a groupmate hangs with
                # its sockets open), the round is reported incomplete, so the survivors retry it.
                own_deadline = max(1.0, (self._allreduce_timeout or float("inf")) - 1.0)
                try:
                    stats = await asyncio.wait_for(session.run(), own_deadline)
                except (PartialAverage, asyncio.TimeoutError) as exc:
                    if ef is not None:
                        ef.rollback()
                    reason = exc if isinstance(exc, PartialAverage) else f"not done in {own_deadline:.0f} s"
                    raise AllreduceIncomplete(f"all-reduce of group {group_id.hex()[:8]} incomplete, nothing "
                                              f"applied: {reason}") from exc
                finally:
                    self._record(session.stats)
                session.apply()
                if ef is not None:
                    ef.commit()
            if stats.send_seconds > 0 and stats.bytes_sent > 0:
                self._uplink_bytes_per_s = stats.bytes_sent / stats.send_seconds
            self.last_updated = get_dht_time()
            self._state_updated.set()
            return user_gathered
        except AllreduceIncomplete as exc:
            # Returned, not raised: hivemind would retry matchmaking for a round the group already ran.
            return {INCOMPLETE: str(exc)}
        except Exception as exc:
            logger.debug("all-reduce failed", exc_info=True)
            return {INCOMPLETE: f"all-reduce failed: {type(exc).__name__}: {exc}"}
        finally:
            if session is not None:
                session.close()
            if not future.done():
                future.cancel()
            loop = asyncio.get_running_loop()
            loop.call_later(2 * self.next_chunk_timeout + 5, self._sessions.pop, group_id, None)

    def _codec_executor(self):
        """One long-lived thread for codec work in this (forked) process. torch initialises its
        intra-op thread pool once per new thread, and in a forked child that has failed
        intermittently ("Invalid thread pool!"); one thread reused for every round does it once."""
        if getattr(self, "_executor", None) is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loco-codec")
        return self._executor

    def _feedback(self, shapes):
        if not self.compression.error_feedback or self.compression.codec == "none":
            return None
        if self._error_feedback is None:
            n_delta = len(shapes) if self.phi_from is None else self.phi_from
            self._error_feedback = codecs.ErrorFeedback(list(shapes[:n_delta]))
        return self._error_feedback

    def _has_feedback(self, piece: Piece) -> bool:
        return self.phi_from is None or piece.tensor < self.phi_from

    @staticmethod
    def _rows(piece: Piece, shapes) -> slice | None:
        return None if len(shapes[piece.tensor]) == 0 else slice(piece.start, piece.stop)

    def _record(self, stats) -> None:
        self._stats["bytes_sent"].value = float(stats.bytes_sent)
        self._stats["bytes_received"].value = float(stats.bytes_received)
        self._stats["excluded"].value = float(len(stats.excluded))
        self._stats["partial_pieces"].value = float(stats.partial_pieces)
        self._stats["send_seconds"].value = float(stats.send_seconds)
        self._stats["allreduce_seconds"].value = float(stats.seconds)
        self._stats["started_at"].value = float(stats.started_at)
