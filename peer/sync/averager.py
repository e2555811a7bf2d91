"""hivemind's DecentralizedAverager with locoswarm's own all-reduce (peer/sync/allreduce.py).

Runs in its own process (hivemind forks it). What it keeps from hivemind: matchmaking (groups of
peers at the same round, keyed by run id and round) and state download for joiners. What it
replaces: the all-reduce itself, so that

* pseudo-gradients travel compressed by the run's codec (protocol/codecs/), with this peer's
  error-feedback residuals kept here, committed only when a round completes;
* every frame is validated (protocol/wire/) and every byte written and read is counted;
* a groupmate that fails is excluded by a stated rule, and a round this peer could not complete
  is never applied (hivemind 1.1.12 reports success with parts un-averaged; docs/architecture.md).

Each all-reduce hands its outcome back to the host process as the result of hivemind's step
(:class:`GroupOutcome`): the group's gathered data, or why this peer applied nothing, and the
exchange's counters. The state transfer for joiners is the mixin peer/state/sharing.py.

The class name is part of the wire protocol: hivemind derives RPC handler names from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously

from peer.net.lifetime import PEER_RESTART, HelperProcess, exited, helper_died
from peer.net.limits import StreamSlots
from peer.net.validator import protect_round
from peer.state.sharing import StateSharing
from peer.sync.allreduce import GroupAllreduce
from peer.sync.allreduce_stats import AllreduceStats
from peer.sync.error_feedback import RESIDUAL_DTYPES, ErrorFeedback, SyncFeedback, keeps_residuals
from peer.sync.group_key import PinnedGroupBits
from peer.sync.hivemind_limits import BoundedHandlers, StreamLimits
from peer.sync.pieces import make_group_plan, stronger_compression, trusted_owners
from peer.sync.receipts import distrust
from peer.sync.suspicion_store import GroupmateMemory
from protocol import keys
from protocol.errors import AllreduceIncomplete, BadPayload, PartialAverage
from protocol.manifest import CompressionSpec
from protocol.signing import PeerSigner
from protocol.version import PROTOCOL_VERSION
from protocol.wire import allreduce as frames, framing

logger = logging.getLogger(__name__)

ALLREDUCE_STREAMS_PER_PEER = 4
"""All-reduce streams one groupmate may hold open to this peer at once: one per session, and a
sync retried or overlapping the next round's (peer/train/overlap.py) has at most a few at once."""
ALLREDUCE_STREAMS_TOTAL = 1024
"""All-reduce streams all peers may hold open to this peer at once (a group of up to a thousand;
each holds at most a 1 KiB HELLO and a 128 KiB read buffer before its session takes it)."""
ALIVE_POLL_S = 0.5  # how often a wait on the averager process checks that it is alive, s
SHUTDOWN_DRAIN_S = 3.0
"""The longest a leaving peer waits for groupmates to read the means it owes them, s."""


@dataclass(frozen=True)
class GroupOutcome:
    """What one all-reduce in the averager process hands back to the host process, as the result
    of hivemind's step (pickled through its pipe)."""

    gathered: dict = field(default_factory=dict)
    """Each groupmate's peer id → what it gathered ({"round", "start_digest"}); empty if incomplete."""
    stats: AllreduceStats = field(default_factory=AllreduceStats)
    """This peer's counters of the exchange, also when it did not complete."""
    incomplete: str | None = None
    """Why this peer applied nothing from the round (tensors and residuals unchanged), or None."""


class LocoAverager(HelperProcess, PinnedGroupBits, BoundedHandlers, StateSharing, DecentralizedAverager):
    """Averages pseudo-gradients within a group of peers at the same round.

    Its process dies with the peer's and leaves signals to it (peer/net/lifetime.py); hivemind's
    re-keying after a group assembled is off, the round loop sets the group bits (group_key.py).
    hivemind's handlers are bounded (declared lengths, streams per peer, time: hivemind_limits.py),
    and those of its all-reduce and state download, which locoswarm does not use, refuse.

    Args:
        averaged_tensors: fp32 buffers shaped like the payload; hivemind moves them to shared
            memory. The trainer writes its payload into them before a step and reads the group
            mean after.
        compression: the run's codecs.
        uplink_mbps: this peer's uplink in Mbit/s as assumed until its first sync measured it
            (the adaptive codec's budget); a per-peer fact, not part of the run.
        phi_from: index of the first tensor that is φ rather than Δ (NoLoCo's payload is Δ then
            φ; φ uses ``compression.phi_codec`` and no error feedback); None: all Δ.
        piece_elements: target piece size of the all-reduce.
        max_weight_tokens: the most tokens one groupmate's contribution may weigh: the run's
            ``sync.inner_steps × inner_optimizer.batch_size_tokens``
            (:func:`peer.sync.screening.round_token_cap`); a groupmate claiming more is weighted
            with this. None: no cap.
        memory: keeps whom this peer leaves out across restarts (peer/sync/suspicion_store.py); None: not.
        signer: this peer's identity key (the one its DHT runs as): it seals the means this peer
            sends as an owner (peer/sync/receipts.py). None: this peer cannot average (every
            all-reduce ends incomplete), as a peer without an identity file.
        **kwargs: passed to DecentralizedAverager (``next_chunk_timeout`` is required).
    """

    next_chunk_timeout: float
    """Required here (DecentralizedAverager's may be None): checked in ``__init__``."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        compression: CompressionSpec,
        uplink_mbps: float = 50.0,
        phi_from: int | None = None,
        piece_elements: int | None = None,
        max_weight_tokens: float | None = None,
        memory: GroupmateMemory | None = None,
        signer: PeerSigner | None = None,
        **kwargs,
    ):
        if kwargs.get("next_chunk_timeout") is None:
            raise ValueError("LocoAverager needs next_chunk_timeout: a silent groupmate must not stall a round")
        self.compression, self.phi_from = compression, phi_from
        self.piece_elements, self.max_weight_tokens = piece_elements, max_weight_tokens
        self.whole_delta = True  # the next sync's Δ is one round's training alone (configure_round)
        self.carry_skipped = True  # the next sync carries a skipped Δ piece (configure_round)
        self.signer = signer
        self._init_state_sharing()
        self._stream_limits = StreamLimits.for_matchmaking(
            kwargs.get("min_matchmaking_time", 5.0), kwargs.get("request_timeout") or 3.0
        )
        # set in the averager process
        self._sessions: dict[bytes, asyncio.Future] = {}
        self._memory = memory or GroupmateMemory(None)
        self._strikes, self._distrust = self._memory.recall()  # clipped/dropped repeatedly; caught equivocating
        self._allreduce_slots: StreamSlots | None = None
        self._error_feedback: ErrorFeedback | None = None
        self._subset: tuple[int, ...] | None = None  # the buffers the next sync averages (None: all)
        self._round_compression = compression  # the next sync's: the run's, or stronger_compression's
        self._uplink_bytes_per_s = uplink_mbps * 1e6 / 8
        super().__init__(averaged_tensors, dht, **kwargs)

    @property
    def stream_protocol(self) -> str:
        return f"{self.prefix}.LocoAllreduce.v{PROTOCOL_VERSION}"

    # ---- the host's waits on the averager process: in slices that check the process is alive ----
    # (hivemind's are unbounded), so a peer whose averager was killed stops instead of hanging
    def check_alive(self) -> None:
        """Raise :class:`HelperDied` when the averager process has exited (in the host process only)."""
        died = helper_died("peer's averager", self, PEER_RESTART)
        if died is not None:
            raise died

    def _await(self, future, timeout: float | None = None):
        """``future.result(timeout)``, raising :class:`HelperDied` once the averager process exited.

        Raises:
            HelperDied: the process exited before the result came.
            TimeoutError: no result within ``timeout`` seconds (None: no bound but the process's life).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = ALIVE_POLL_S if deadline is None else min(ALIVE_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(timeout=wait)
            except TimeoutError:
                self.check_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    @contextlib.contextmanager
    def get_tensors(self):
        """hivemind's ``get_tensors`` (the shared buffers, with the averager's lock held), except that
        a host waiting for the lock raises :class:`HelperDied` when the process holding it died."""
        lock = self.lock_averaged_tensors
        while not lock.acquire(timeout=ALIVE_POLL_S):
            self.check_alive()
        try:
            yield self._averaged_tensors
        finally:
            lock.release()

    def start_step(self, *, gather, weight: float, scheduled_time: float, timeout: float):
        """hivemind's ``step(..., wait=False)`` with its one unbounded wait (for the averager process
        to take the step) bounded by the process's life: returns the running step's ``StepControl``.

        Raises:
            HelperDied: the averager process exited before it took the step.
        """
        from hivemind.averaging.control import StepControl
        from hivemind.utils.mpfuture import MPFuture

        if not weight > 0 or not scheduled_time < get_dht_time() + timeout:
            raise ValueError(f"weight {weight} must be > 0 and the scheduled time within the timeout {timeout} s")
        step = StepControl(
            scheduled_time=scheduled_time,
            deadline=get_dht_time() + timeout,
            allow_retries=True,
            weight=float(weight),
            data_for_gather=self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps(gather)]),
        )
        taken = MPFuture()
        self._outer_pipe.send(("_step", [], dict(step=step, future_for_init=taken)))
        step.attach(*self._await(taken))
        step.allow_allreduce()
        return step

    def shutdown(self) -> None:
        """hivemind's shutdown; for a process that already died, only the host's helper thread stops."""
        if exited(self):
            self._inner_pipe.send(("_SHUTDOWN", None))
            return
        super().shutdown()

    def _call_in_averager(self, method: str, *, timeout: float | None = None, **kwargs):
        """Run ``await self.<method>(**kwargs, future=...)`` in the averager process; return its result.

        Raises:
            TimeoutError: no result within ``timeout`` seconds (the call is cancelled); whatever
                the method set as the future's exception.
            HelperDied: the averager process exited before answering.
        """
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))
        try:
            return self._await(future, timeout)
        except TimeoutError:
            future.cancel()
            raise

    def set_group_bits(self, group_bits: str, wait: bool = True):
        """hivemind's ``set_group_bits``, after protecting this run's matchmaking keys around the
        round the bits carry (peer/net/validator.py ``protect_round``; the round is the bits' first
        ``keys.ROUND_BITS``, as protocol/keys.py ``round_group_bits`` writes them). A failure to
        protect (the DHT stopped) is logged and the bits are set all the same.

        Raises:
            HelperDied: with ``wait``, the averager process exited before it took the bits.
        """
        if len(group_bits) >= keys.ROUND_BITS:
            try:
                protect_round(self.dht, self.prefix, int(group_bits[: keys.ROUND_BITS], 2))
            except Exception as exc:  # the DHT is shutting down: matchmaking will fail on its own
                logger.debug("could not protect the matchmaking keys of %s: %r", group_bits, exc)
        future = super().set_group_bits(group_bits, wait=False)
        return self._await(future) if wait else future

    def configure_round(
        self,
        *,
        target_group_size: int,
        matchmaking_s: float,
        allreduce_s: float,
        tensors: Sequence[int] | None = None,
        stronger: bool = False,
        whole_delta: bool = True,
        carry_skipped: bool = True,
    ) -> None:
        """Set the next sync's group size target and deadlines (peer/sync/deadlines.py) in the averager process.

        Args:
            target_group_size: matchmaking starts the all-reduce as soon as this many peers joined.
            matchmaking_s: how long a leader waits for more groupmates before starting with fewer.
            allreduce_s: deadline of the all-reduce once the group is formed.
            tensors: indices of the buffers the next sync averages, ascending (Streaming DiLoCo's
                fragment: its Δ tensors, then with NoLoCo its φ tensors); the other buffers are
                neither sent nor changed, and their error-feedback residuals stay as they are.
                None: every buffer.
            stronger: this peer sends its contributions and means with the next stronger codec
                (peer/sync/pieces.py ``stronger_compression``; a volunteer's traffic budget).
            whole_delta, carry_skipped: whether the next sync's Δ is one round's training alone, and
                whether a Δ piece the receipts skip is carried into the next contribution (``SyncRequest``).

        Raises:
            ValueError: an index out of range, repeated or out of order (ascending keeps a
                fragment's Δ tensors before its φ tensors); nothing changed.
        """
        if tensors is not None:
            tensors = tuple(int(i) for i in tensors)
            n = len(self._averaged_tensors)
            if not tensors or list(tensors) != sorted(set(tensors)) or not 0 <= tensors[0] <= tensors[-1] < n:
                raise ValueError(f"tensors = {tensors}: need distinct ascending indices into the {n} payload buffers")
        self._call_in_averager(
            "_configure_round",
            size=target_group_size,
            matchmaking_s=matchmaking_s,
            allreduce_s=allreduce_s,
            tensors=tensors,
            stronger=stronger,
            whole_delta=whole_delta,
            carry_skipped=carry_skipped,
        )

    def reset_error_feedback(self) -> None:
        """Forget the error-feedback residuals in the averager process (after adopting another peer's φ)."""
        self._call_in_averager("_reset_error_feedback")

    async def _reset_error_feedback(self, future) -> None:
        self._error_feedback = None
        future.set_result(None)

    def error_feedback_residuals(self, timeout: float = 30.0) -> list[torch.Tensor] | None:
        """Copies of the committed error-feedback residuals in the averager process (in
        ``compression.residual_dtype``, one per Δ tensor), or None when there are none (lossless codec or feedback off: a skipped piece's
        carried Δ is not checkpointed; no sync since the start or the last reset). Call between
        syncs; a running sync's staged residuals are excluded.

        Raises:
            TimeoutError: the averager process did not answer within ``timeout`` seconds.
        """
        if not keeps_residuals(self.compression):
            return None  # no call into the averager process, which may be busy with a background sync
        return self._call_in_averager("_error_feedback_residuals", timeout=timeout)

    async def _error_feedback_residuals(self, future) -> None:
        ef = self._error_feedback
        future.set_result(None if ef is None else ef.residuals())

    def load_error_feedback(self, residuals: Sequence[torch.Tensor], timeout: float = 30.0) -> int:
        """Make ``residuals`` (as :meth:`error_feedback_residuals` returned) this peer's current
        residuals in the averager process; the number of tensors taken (0 when this run's codec
        keeps no residuals).

        Raises:
            ValueError: count or shapes do not match the Δ tensors, or values are not finite;
                the residuals in the averager process are left unchanged.
            TimeoutError: the averager process did not answer within ``timeout`` seconds.
        """
        return self._call_in_averager(
            "_load_error_feedback",
            timeout=timeout,
            residuals=[r.detach().contiguous() for r in residuals],  # kept in the run's residual dtype there
        )

    async def _load_error_feedback(self, residuals, future) -> None:
        try:
            if keeps_residuals(self.compression):  # else its checkpoints hold none
                self._feedback([t.shape for t in self._averaged_tensors]).load_residuals(residuals)
            future.set_result(len(residuals) if keeps_residuals(self.compression) else 0)
        except ValueError as exc:
            future.set_exception(exc)

    async def _configure_round(
        self,
        size: int,
        matchmaking_s: float,
        allreduce_s: float,
        future,
        tensors=None,
        stronger: bool = False,
        whole_delta: bool = True,
        carry_skipped: bool = True,
    ) -> None:
        self._subset, self.whole_delta, self.carry_skipped = tensors, whole_delta, carry_skipped
        self._round_compression = stronger_compression(self.compression) if stronger else self.compression
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

    async def _shutdown(self, timeout: float | None) -> None:
        await self._drain_allreduce_streams(SHUTDOWN_DRAIN_S if timeout is None else min(SHUTDOWN_DRAIN_S, timeout / 2))
        # p2pd may be gone first (a service manager signals every process of the unit): removing
        # handlers then fails, and the exception would end this process with a traceback.
        try:
            await asyncio.wait_for(super()._shutdown(timeout), timeout)
        except Exception as exc:
            logger.debug("averager shutdown incomplete: %r", exc)

    async def _drain_allreduce_streams(self, limit_s: float) -> None:
        """Wait up to ``limit_s`` seconds for the groupmates' all-reduce streams still open here to end.

        An owner's all-reduce is done once it has its own means, but the groupmates may not have
        read the means it owes them yet (``GroupAllreduce.serve`` writes them, then waits for the
        sender to close). A peer that leaves at once, e.g. at ``--max-rounds`` right after its last
        round, would cut those streams, and a groupmate would find its round incomplete and apply
        only its own Δ. Streams still open after ``limit_s`` are cut as before.
        """
        slots = self._allreduce_slots
        deadline = time.monotonic() + limit_s
        while slots is not None and slots.open > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if slots is not None and slots.open > 0:
            logger.info("leaving with %d all-reduce stream(s) of groupmates still open", slots.open)

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A groupmate opened a stream to send us its pieces: route it to our session for its group.

        A peer over ``ALLREDUCE_STREAMS_PER_PEER`` open streams, or any peer while
        ``ALLREDUCE_STREAMS_TOTAL`` are open, is refused at once (the stream is closed unread)."""
        if self._allreduce_slots is None:
            self._allreduce_slots = StreamSlots(per_peer=ALLREDUCE_STREAMS_PER_PEER, total=ALLREDUCE_STREAMS_TOTAL)
        peer = stream_info.peer_id
        if not self._allreduce_slots.acquire(peer):
            logger.warning(
                "refused an all-reduce stream from %s: %d open from it, %d in all",
                peer,
                ALLREDUCE_STREAMS_PER_PEER,
                self._allreduce_slots.open,
            )
            writer.close()
            return
        try:
            await self._route_stream(stream_info, reader, writer)
        finally:
            self._allreduce_slots.release(peer)

    async def _route_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        timeout = self.next_chunk_timeout
        try:
            payload = await framing.read_frame(reader, max_bytes=frames.MAX_HELLO_BYTES, timeout=timeout)
            hello = frames.parse_hello(payload, group_size=frames.MAX_GROUP_SIZE)
            future = self._session_future(hello.group_id)
            session = await asyncio.wait_for(asyncio.shield(future), timeout)
        except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError) as exc:
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

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> GroupOutcome:
        """Run locoswarm's all-reduce in ``group_info``; on success the tensors hold the group means.

        Returns:
            GroupOutcome with the groupmates' gathered metadata and this peer's counters, or with
            ``incomplete`` set when the group's rounds disagree or this peer did not get a valid
            mean for every piece; the tensors and error-feedback residuals are then left unchanged.
        """
        group_id = group_info.group_id
        future = self._session_future(group_id)
        session = round_ = None
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes)))
            modes = [AveragingMode(m) for m in mode_ids]
            rounds = {(d or {}).get("round") if isinstance(d, dict) else None for d in user_gathered.values()}
            if len(rounds) != 1 or not isinstance(group_round := next(iter(rounds)), int):
                raise AllreduceIncomplete(f"groupmates are at different rounds {sorted(map(str, rounds))}")
            owners = [i for i, mode in enumerate(modes) if mode != AveragingMode.CLIENT]
            if not owners:
                raise AllreduceIncomplete("every groupmate is in client mode: nobody can reduce")
            distrust = [d.get("distrust") if isinstance(d, dict) else None for d in user_gathered.values()]
            owners = trusted_owners(owners, [str(p) for p in group_info.peer_ids], distrust)
            fragments = {(d or {}).get("fragment") if isinstance(d, dict) else None for d in user_gathered.values()}
            if len(fragments) != 1:
                raise AllreduceIncomplete(f"groupmates sync different fragments {sorted(map(str, fragments))}")
            if self.signer is None or self.signer.peer_id != str(self.peer_id):
                raise AllreduceIncomplete("this peer has no identity key of its peer id to seal its means with")
            async with enter_asynchronously(self.get_tensors()) as all_tensors:
                # a fragment sync (Streaming DiLoCo) averages a subset of the buffers: plan, codecs
                # and error feedback see only those; ``index`` maps a piece's tensor to its buffer
                index = list(self._subset) if self._subset is not None else list(range(len(all_tensors)))
                tensors = [all_tensors[i] for i in index]
                shapes = [t.shape for t in tensors]
                phi_from = None if self.phi_from is None else sum(1 for i in index if i < self.phi_from)
                plan = await asyncio.get_running_loop().run_in_executor(
                    self._codec_executor(),
                    lambda: make_group_plan(
                        tensors,
                        group_id=group_id,
                        peer_ids=group_info.peer_ids,
                        my_index=group_info.peer_ids.index(self.peer_id),
                        owners=owners,
                        round_=group_round,
                        compression=self._round_compression,
                        phi_from=phi_from,
                        piece_elements=self.piece_elements,
                        uplink_bytes_per_s=self._uplink_bytes_per_s,
                    ),
                )
                ef = self._feedback([t.shape for t in all_tensors])
                hooks = SyncFeedback(ef, index, shapes, phi_from, feeds=keeps_residuals(self.compression))

                async def open_stream(peer_id):
                    _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, self.stream_protocol)
                    return reader, writer

                round_ = group_round
                ignored = self._strikes.ignored(round_) | (distrusted := self._distrust.ignored(round_))
                session = GroupAllreduce(
                    plan,
                    tensors,
                    weight=kwargs.get("weight") or 1.0,
                    compensate=hooks.compensate,
                    stage=hooks.stage,
                    open_stream=open_stream,
                    next_chunk_timeout=self.next_chunk_timeout,
                    executor=self._codec_executor(),
                    max_weight=self.max_weight_tokens,
                    ignored=frozenset(i for i, p in enumerate(group_info.peer_ids) if p in ignored),
                    phi_from=phi_from,
                    distrusted=frozenset(i for i, p in enumerate(group_info.peer_ids) if p in distrusted),
                    whole_delta=self.whole_delta,
                    carry_skipped=self.carry_skipped,
                    signer=self.signer,
                )
                if not future.done():
                    future.set_result(session)
                # Our own deadline, a second before hivemind's: when it passes (a groupmate hangs with
                # its sockets open), the round is reported incomplete, so the survivors retry it.
                own_deadline = max(1.0, (self._allreduce_timeout or float("inf")) - 1.0)
                try:
                    stats = await asyncio.wait_for(session.run(), own_deadline)
                except (TimeoutError, PartialAverage) as exc:
                    ef.rollback()
                    reason = exc if isinstance(exc, PartialAverage) else f"not done in {own_deadline:.0f} s"
                    raise AllreduceIncomplete(
                        f"all-reduce of group {group_id.hex()[:8]} incomplete, nothing applied: {reason}"
                    ) from exc
                session.apply()
                ef.commit()
            if stats.send_seconds > 0 and stats.bytes_sent > 0:
                self._uplink_bytes_per_s = stats.bytes_sent / stats.send_seconds
            self.last_updated = get_dht_time()
            self._state_updated.set()
            return GroupOutcome(gathered=user_gathered, stats=stats)
        # Returned, not raised: hivemind's step retries matchmaking on its own AllreduceException
        # (for a round the group already ran) and fails the step on anything else. So no error of
        # ours crosses into hivemind here, and AllreduceIncomplete needs no hivemind base class.
        except AllreduceIncomplete as exc:
            return GroupOutcome(stats=session.stats if session else AllreduceStats(), incomplete=str(exc))
        except Exception as exc:
            logger.debug("all-reduce failed", exc_info=True)
            return GroupOutcome(
                stats=session.stats if session else AllreduceStats(),
                incomplete=f"all-reduce failed: {type(exc).__name__}: {exc}",
            )
        finally:
            if session is not None:
                if round_ is not None:  # (set before the session)
                    self._strike(session, round_)
                session.close()
                session.release()  # its model-sized tensors, now: the session object is kept a while
            if not future.done():
                future.cancel()
            loop = asyncio.get_running_loop()
            loop.call_later(2 * self.next_chunk_timeout + 5, self._sessions.pop, group_id, None)

    def _strike(self, session: GroupAllreduce, round_: int) -> None:
        """Count a strike against each groupmate whose contribution ``session`` (of round ``round_``)
        clipped or dropped, and each owner whose mean it refused by a check that counts a strike
        (``MeanRefusal.strike``: not the share check, which an honest owner can fail under attack)."""
        offenders = [session.plan.peer_ids[s] for s in set(session.stats.clipped) | session.stats.dropped]
        offenders += [p for p in session.plan.peer_ids if str(p) in session.stats.struck_owners and p not in offenders]
        distrust(session.stats, session.plan.peer_ids, round_, distrusted=self._distrust)
        for peer in self._strikes.record(round_, offenders):
            logger.warning(
                "ignoring groupmate %s for %d rounds: its contributions were clipped or dropped in %d of "
                "the last %d rounds",
                peer,
                self._strikes.ignore_rounds,
                self._strikes.strikes,
                self._strikes.window_rounds,
            )
        self._memory.save(self._strikes, self._distrust)

    def _codec_executor(self):
        """One long-lived codec thread in this forked process (per-thread pools: "Invalid thread pool!")."""
        if getattr(self, "_executor", None) is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loco-codec")
        return self._executor

    def _feedback(self, shapes) -> ErrorFeedback:
        """This peer's residuals (created on first use): the codec's error where it keeps one
        (:func:`keeps_residuals`), and with any codec the Δ of pieces the receipts skipped."""
        if self._error_feedback is None:
            n_delta = len(shapes) if self.phi_from is None else self.phi_from
            self._error_feedback = ErrorFeedback(
                list(shapes[:n_delta]), RESIDUAL_DTYPES[self.compression.residual_dtype]
            )
        return self._error_feedback
