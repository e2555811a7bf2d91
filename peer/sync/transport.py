"""Transports compute a group's mean pseudo-gradient; outer algorithms (peer.train.outer) consume it.

:class:`NetworkTransport` runs the DiLoCo group all-reduce over libp2p through hivemind
(:class:`peer.sync.averager.LocoAverager`), serves this peer's state to joiners and downloads
others' (peer/state/). A sync returns a :class:`SyncResult` or raises a
:class:`~protocol.errors.SyncError` that carries what the failed call cost (bytes) and its bound.

A few lines over 300: the averager process's calls (average, share state, download) and the
bounds each of them sets belong to the one object that owns that process.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from hivemind.utils import get_dht_time

from peer.state.download import StateDownload, validate_state
from peer.sync.averager import GroupOutcome, LocoAverager
from peer.sync.deadlines import DeadlinePolicy, Deadlines
from peer.sync.pieces import Suspects
from peer.sync.suspicion_store import GROUPMATES_FILE, SUSPECTS_FILE, GroupmateMemory, SuspectMemory
from protocol import keys
from protocol.errors import (
    AllreduceFailed,
    AllreduceIncomplete,
    BadPayload,
    GroupNotFound,
    HelperDied,
    NetworkError,
    SyncError,
)
from protocol.manifest import CompressionSpec, SyncSpec
from protocol.signing import PeerSigner

logger = logging.getLogger(__name__)

AVERAGER_START_TIMEOUT_S = 120.0
"""How long a peer waits for its averager process (hivemind, its own libp2p daemon) to get ready, s."""


@dataclass(frozen=True)
class SyncResult:
    """Outcome of one successful group average."""

    mean: list[torch.Tensor]
    """Token-weighted mean of the group's payloads (DiLoCo: Δ; NoLoCo: Δ then φ), fp32."""
    group: list[str]
    """Peer ids of the group, this one included."""
    group_size: int
    """Peers in the group, including this one."""
    bytes_sent: int
    """Sync bytes this peer wrote to its all-reduce streams (frames, headers included)."""
    bytes_received: int
    """Sync bytes this peer read from its all-reduce streams."""
    seconds: float
    """Wall time of matchmaking plus all-reduce."""
    deadline_s: float = 0.0
    """The bound this sync ran under (matchmaking deadline + all-reduce deadline + slack), s."""
    excluded: int = 0
    """Groupmates this peer, as an owner of pieces, excluded from its means (failed or invalid)."""
    partial_pieces: int = 0
    """Pieces whose mean left out at least one groupmate (the means are identical for all that completed)."""
    attempts: int = 1
    """1, or 2 when the first all-reduce could not complete and the retry did."""
    allreduce_s: float = 0.0
    """Wall time of the (last attempt's) all-reduce, after matchmaking, s."""
    send_s: float = 0.0
    """Of that, until this peer's last piece was written, s."""
    allreduce_started_at: float = 0.0
    """``time.time()`` when this peer started the (last attempt's) all-reduce."""
    refused: tuple[str, ...] = ()
    """Owners (peer ids) whose mean of some piece this peer refused (peer/sync/screening.py
    ``owner_mean_problem``): those pieces were applied as zeros (Δ) or own values (φ)."""
    refused_pieces: int = 0
    """Pieces whose owner's mean this peer refused."""
    unread_receipts: int = 0
    """Groupmates whose receipt this peer, an owner, did not read: their verdict may differ from its
    own (peer/sync/receipts.py), so it claims no groupmate holds its state after the round."""
    start_digests: dict[str, str] | None = None
    """Each groupmate's digest of the state it started the round from (peer id → hex): groupmates
    that started from the same state and completed the round hold the same state after it."""
    kept_rows: tuple[tuple[int, int, int], ...] = ()
    """With ``SyncRequest.carry_skipped`` False: the rows of this peer's Δ (payload tensor, first row,
    stop row) applied as zeros because the receipts skipped their owner (``SyncReport.kept_rows``)."""


@dataclass(frozen=True)
class SyncRequest:
    """One sync a round loop asks of its transport (:meth:`RoundTransport.average`): which group,
    with what weight, and how long it may wait for it."""

    weight: float
    """Tokens this peer processed in the round (> 0): its weight in the group's mean."""
    round_: int
    """The round whose group this sync joins."""
    expected_group_size: int
    """Peers expected in the group; matchmaking starts the all-reduce as soon as this many joined."""
    group_index: int | None = None
    """With random groups (NoLoCo), this peer's group: part of the matchmaking key, so that only
    groupmates meet; None: one group of all peers at the round (DiLoCo)."""
    start_digest: str = ""
    """Digest of the state this peer started the round from (peer/state/snapshot.py); shared with
    the group, returned in :attr:`SyncResult.start_digests`."""
    should_stop: Callable[[], bool] = lambda: False
    """Polled while waiting; when it returns True the sync is cancelled."""
    expected_wait_s: float = 0.0
    """Seconds until the last expected groupmate arrives, by the progress records; the matchmaking
    window covers it (peer/sync/deadlines.py)."""
    wait_budget_s: float = 0.0
    """A sync in the background (``sync.overlap``): its matchmaking window is at least this plus the
    manifest's ``matchmaking_time_s``, s (0: a blocking sync, never past that)."""
    fragment: int | None = None
    """Streaming DiLoCo (arXiv 2501.18512): this sync is fragment ``fragment`` of ``fragments`` of
    the round; its groupmates meet under the key of that fragment's sync (protocol/keys.py
    ``sync_index``). None: a whole round."""
    fragments: int = 1
    """How many fragments a round's payload is synced in (read with ``fragment``)."""
    whole_delta: bool = True
    """This sync's Δ is one round's training alone (peer/round/timing.py ``Timing.whole_delta``): the
    receipts judge the owners' alignments, a NoLoCo pair its owner's whole Δ; False: a streaming
    fragment's, which the last landing's merge left part of a mean in."""
    carry_skipped: bool = True
    """A Δ piece the receipts skip is carried into this peer's next contribution (peer/round/timing.py
    ``Timing.carries_skipped``); False: not carried but named in :attr:`SyncResult.kept_rows`, where a
    blocking or delayed landing keeps θ's progress."""
    tensors: Sequence[int] | None = None
    """With ``fragment``, the indices of the payload buffers the payload fills (ascending; the
    fragment's Δ tensors, then its φ tensors for NoLoCo); the mean returned holds those tensors
    only. None: the payload is the whole payload."""


@runtime_checkable
class RoundTransport(Protocol):
    """What the round loop (peer.round.Trainer) uses of its transport. :class:`NetworkTransport`
    implements it over hivemind, :class:`lab.inprocess.InProcessTransport` in one process;
    see :meth:`NetworkTransport.average` and the others for what each call means."""

    @property
    def max_sync_seconds(self) -> float:
        """Upper bound on any :meth:`average` call, s."""
        ...

    def average(self, payload: Sequence[torch.Tensor], *, request: SyncRequest) -> SyncResult:
        """The token-weighted group mean of ``payload``; raises a SyncError (or HelperDied)."""
        ...

    def share_state(self, provider: Callable[[], list[Any]] | None) -> None:
        """Serve the snapshots ``provider`` returns (newest last) to joiners; None: stop."""
        ...

    def download_state(self, donors: Sequence[str], digest_hex: str, timeout_s: float) -> StateDownload:
        """The state named ``digest_hex`` from ``donors``, verified and checked."""
        ...

    def reset_error_feedback(self) -> None:
        """Drop this peer's error-feedback residuals."""
        ...

    def error_feedback_residuals(self) -> list[torch.Tensor] | None:
        """This peer's committed error-feedback residuals, for a checkpoint (None: none kept)."""
        ...

    def load_error_feedback(self, residuals: Sequence[torch.Tensor]) -> int:
        """Restore residuals from a checkpoint; returns how many tensors were taken."""
        ...


class NetworkTransport:
    """DiLoCo group all-reduce over hivemind, with matchmaking keyed by run id and round.

    Args:
        dht: a started hivemind.DHT.
        param_shapes: parameter shapes (of φ and of the outer state served to joiners).
        payload_shapes: shapes of what the outer algorithm averages; buffers of these shapes
            live in shared memory.
        run_id: the run; the averager prefix is derived from it.
        sync: matchmaking and all-reduce timeouts from the run manifest.
        compression: the run's codecs (protocol/codecs/).
        phi_from: index of the first payload tensor that is φ, not Δ (NoLoCo), or None.
        client_mode: True when other peers cannot dial this one (behind NAT).
        piece_elements: target piece size of the all-reduce (None: the default).
        uplink_mbps: this peer's assumed uplink, Mbit/s, until the first sync measured it.
        max_weight_tokens: the most tokens a groupmate's contribution may weigh, the run's
            ``H × batch_size_tokens`` (:func:`peer.sync.screening.round_token_cap`); None: no cap.
        memory_dir: where this peer keeps the groupmates it leaves out or names across restarts, its
            run directory (peer/sync/suspicion_store.py; read here, written after rounds that change
            it); None: nowhere.
        signer: this peer's identity key, the one ``dht`` runs as: it seals the means this peer
            sends (peer/sync/receipts.py); None: this peer's all-reduces end incomplete.

    Raises:
        NetworkError: the averager process was not ready within :data:`AVERAGER_START_TIMEOUT_S`
            (it is shut down; the DHT node stays the caller's to shut down).
    """

    stronger_codec: bool = False
    """Whether the next syncs send with peer/sync/pieces.py ``stronger_compression`` (set by the
    traffic budget, peer/net/traffic.py, for the syncs it decides so)."""

    def __init__(
        self,
        dht,
        param_shapes: Sequence[torch.Size],
        payload_shapes: Sequence[torch.Size],
        run_id: str,
        sync: SyncSpec,
        *,
        compression: CompressionSpec | None = None,
        phi_from: int | None = None,
        client_mode: bool = False,
        piece_elements: int | None = None,
        uplink_mbps: float = 50.0,
        max_weight_tokens: float | None = None,
        memory_dir: Path | None = None,
        signer: PeerSigner | None = None,
    ):
        self.shapes, self.run_id, self.sync = list(param_shapes), run_id, sync
        self.suspects = Suspects()
        """Owners the group's receipts skipped, named in this peer's gathered ``distrust`` list
        (peer/sync/pieces.py ``trusted_owners``)."""
        self._suspect_memory = SuspectMemory(None if memory_dir is None else memory_dir / SUSPECTS_FILE)
        self._suspect_memory.restore(self.suspects)
        self._buffers = [torch.zeros(shape, dtype=torch.float32) for shape in payload_shapes]
        # hivemind's run_in_background sets SIGINT to SIG_IGN in *this* process and never restores
        # it; keep the caller's handler so Ctrl-C still stops the peer cleanly.
        previous_sigint = signal.getsignal(signal.SIGINT)
        self.averager = LocoAverager(
            self._buffers,
            dht,
            compression=compression or CompressionSpec(),
            uplink_mbps=uplink_mbps,
            phi_from=phi_from,
            piece_elements=piece_elements,
            max_weight_tokens=max_weight_tokens,
            memory=GroupmateMemory(None if memory_dir is None else memory_dir / GROUPMATES_FILE),
            signer=signer,
            prefix=keys.averager_prefix(run_id, sync.algorithm),
            initial_group_bits=keys.round_group_bits(0),
            target_group_size=sync.target_group_size,
            min_group_size=2,
            min_matchmaking_time=sync.matchmaking_time_s,
            # hivemind: a request_timeout >= min_matchmaking_time can deadlock matchmaking; the
            # adaptive matchmaking time never goes below min_matchmaking_time_s.
            request_timeout=min(3.0, sync.min_matchmaking_time_s / 3, sync.matchmaking_time_s / 3),
            next_chunk_timeout=sync.next_chunk_timeout_s,
            allreduce_timeout=sync.allreduce_timeout_s,
            allow_state_sharing=False,
            declare_state_period=10.0,
            client_mode=client_mode,
            start=False,
        )
        try:
            # hivemind's start=True waits for the averager process without a bound: a process that
            # never gets ready would leave this peer hanging before its first round
            self.averager.run_in_background(await_ready=True, timeout=AVERAGER_START_TIMEOUT_S)
        except TimeoutError as exc:
            self.averager.shutdown()
            raise NetworkError(
                f"the averager process did not get ready within {AVERAGER_START_TIMEOUT_S:.0f} s "
                "(its libp2p daemon could not attach to the DHT's); start the peer again"
            ) from exc
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous_sigint)
        self.deadlines = DeadlinePolicy(sync)

    @property
    def max_sync_seconds(self) -> float:
        """Upper bound on any :meth:`average` call: the deadlines at their configured maximum, for
        the first attempt and the retry."""
        return (1 + self.RETRIES) * self.deadlines.worst_case().total_s

    def average(self, payload: Sequence[torch.Tensor], *, request: SyncRequest) -> SyncResult:
        """Token-weighted group mean of ``payload`` over the peers at ``request.round_``.

        DiLoCo: one group of all peers at the round (arXiv 2311.08105, Algorithm 1 line 10).
        NoLoCo: only the peers of random group ``request.group_index`` (arXiv 2506.10911), so no
        peer exchanges data with more than its groupmates. Returns within the current deadlines'
        ``total_s`` (peer/sync/deadlines.py; at most :attr:`max_sync_seconds`, or with
        ``wait_budget_s``, its matchmaking deadline of three times the budget longer), whatever the
        other peers do.

        Args:
            payload: this peer's contribution (see OuterAlgorithm.payload), fp32.
            request: the sync's group, weight and waits (:class:`SyncRequest`).

        Returns:
            SyncResult; its bytes are summed over the attempts, its ``deadline_s`` is the bound
            the call ran under, retry included.

        Raises:
            GroupNotFound: no groupmate found before the deadline (or cancelled).
            AllreduceIncomplete: the group formed but the retry, too, did not deliver every mean.
            AllreduceFailed: the all-reduce failed, timed out or mixed rounds.
            Every one carries ``bytes_sent`` and ``bytes_received`` (summed over the attempts) and
            ``deadline_s`` (the bound the call ran under, retry included); φ is untouched.
            HelperDied: this peer's averager process exited (not a SyncError: the peer cannot
                sync again and stops); φ is untouched.
        """
        start, tensors = time.monotonic(), request.tensors
        with self.averager.get_tensors() as buffers:
            chosen = buffers if tensors is None else [buffers[i] for i in tensors]
            for buf, value in zip(chosen, payload, strict=True):
                buf.copy_(value)
        d = self.deadlines.current(expected_wait_s=request.expected_wait_s, wait_budget_s=request.wait_budget_s)
        bound_s = (1 + self.RETRIES) * d.total_s
        sent = received = 0
        for attempt in range(1 + self.RETRIES):
            try:
                result = self._attempt(request, attempt=attempt, d=d)
            except SyncError as exc:
                sent, received = sent + exc.bytes_sent, received + exc.bytes_received
                if isinstance(exc, AllreduceIncomplete) and attempt < self.RETRIES and not request.should_stop():
                    logger.info("round %d: %s; retrying with the groupmates that are left", request.round_, exc)
                    continue
                exc.bytes_sent, exc.bytes_received, exc.deadline_s = sent, received, bound_s
                raise
            return dataclasses.replace(
                result,
                bytes_sent=sent + result.bytes_sent,
                bytes_received=received + result.bytes_received,
                seconds=time.monotonic() - start,
                deadline_s=bound_s,
                attempts=attempt + 1,
            )
        raise AssertionError("unreachable: the last attempt returns or raises")

    RETRIES = 1
    """How often a round whose all-reduce could not complete (a groupmate died in it) is retried,
    at once, with the groupmates that are left (they meet under the round's retry key)."""

    def _attempt(self, request: SyncRequest, *, attempt: int, d: Deadlines) -> SyncResult:
        """One matchmaking + all-reduce of the payload already in the buffers (see :meth:`average`),
        attempt ``attempt`` (0: the first) under deadlines ``d``.

        Raises:
            GroupNotFound, AllreduceFailed: as :meth:`average`, with this attempt's bytes (0 when
                no outcome came back from the averager process).
            AllreduceIncomplete: with this attempt's bytes; the round may be retried at once.
        """
        start, round_, fragment, tensors = time.monotonic(), request.round_, request.fragment, request.tensors
        expected_group_size, should_stop = request.expected_group_size, request.should_stop
        self.averager.set_group_bits(
            keys.round_group_bits(keys.sync_index(round_, fragment, request.fragments), request.group_index, attempt)
        )
        self.averager.configure_round(
            target_group_size=max(2, min(expected_group_size, self.sync.target_group_size)),
            matchmaking_s=d.matchmaking_s,
            allreduce_s=d.allreduce_s,
            tensors=tensors,
            stronger=self.stronger_codec,
            whole_delta=request.whole_delta,
            carry_skipped=request.carry_skipped,
        )
        arrived = time.time()
        gather = {"round": round_, "start_digest": request.start_digest, "distrust": self.suspects.named(round_)}
        if fragment is not None:
            gather["fragment"] = fragment
        control = self.averager.start_step(
            gather=gather,
            weight=float(request.weight),
            scheduled_time=get_dht_time() + d.matchmaking_s,
            timeout=d.matchmaking_deadline_s,
        )
        deadline = start + d.total_s
        outcome: GroupOutcome | None = None
        try:
            while True:
                if should_stop():
                    self.averager.check_alive()  # a stop for a dead averager: that, not a cancelled sync
                    control.cancel()
                    raise GroupNotFound(f"round {round_} sync cancelled (stopping, or dropped by the round loop)")
                try:
                    outcome = control.result(timeout=0.5)
                    break
                except TimeoutError:
                    self.averager.check_alive()
                    if time.monotonic() > deadline:
                        control.cancel()
                        raise AllreduceFailed(
                            f"round {round_} sync did not finish in its deadline of {d.total_s:.0f} s"
                        ) from None
        except (GroupNotFound, AllreduceFailed, HelperDied):
            raise
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if "could not find a group" in text:
                if expected_group_size > 1:  # the groupmates expected came too late: widen the window
                    self.deadlines.observe_missed_group(d.matchmaking_s)
                raise GroupNotFound(
                    f"no group formed for round {round_}{' (retry)' if attempt else ''} within "
                    f"{d.matchmaking_deadline_s:.0f} s"
                ) from exc
            raise AllreduceFailed(f"round {round_} all-reduce failed: {text}") from exc
        if outcome is None:
            if expected_group_size > 1:
                self.deadlines.observe_missed_group(d.matchmaking_s)
            raise GroupNotFound(f"no group formed for round {round_}")
        stats = outcome.stats
        if outcome.incomplete is not None:
            raise AllreduceIncomplete(
                f"round {round_}: {outcome.incomplete}",
                bytes_sent=stats.bytes_sent,
                bytes_received=stats.bytes_received,
            )
        gathered = outcome.gathered
        self.suspects.add(stats.skipped_owners, round_, proven=stats.equivocators)
        self._suspect_memory.save(self.suspects)
        with self.averager.get_tensors() as buffers:
            mean = [buf.clone() for buf in (buffers if tensors is None else [buffers[i] for i in tensors])]
        if stats.started_at >= arrived:
            self.deadlines.observe(wait_s=stats.started_at - arrived, allreduce_s=stats.seconds)
        return SyncResult(
            mean=mean,
            group=sorted(str(peer) for peer in gathered),
            group_size=len(gathered),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            seconds=time.monotonic() - start,
            deadline_s=d.total_s,
            excluded=len(stats.excluded),
            partial_pieces=stats.partial_pieces,
            allreduce_s=stats.seconds,
            send_s=stats.send_seconds,
            allreduce_started_at=stats.started_at,
            refused=tuple(sorted(stats.refused)),
            refused_pieces=stats.refused_pieces,
            unread_receipts=stats.unread_receipts,
            kept_rows=tuple(stats.kept_rows),
            start_digests={
                str(peer): str((data or {}).get("start_digest", "")) if isinstance(data, dict) else ""
                for peer, data in gathered.items()
            },
        )

    def reset_error_feedback(self) -> None:
        """Drop this peer's error-feedback residuals (after it adopted another peer's state)."""
        self.averager.reset_error_feedback()

    def error_feedback_residuals(self) -> list[torch.Tensor] | None:
        """This peer's committed error-feedback residuals, fetched from the averager process for a
        checkpoint: one fp32 tensor per Δ tensor (shaped like its parameter), or None when it keeps
        none (lossless codec, feedback off, no completed sync since the start or the last reset).
        Call at a round boundary, when no sync is running.

        Raises:
            TimeoutError: the averager process did not answer.
            HelperDied: the averager process exited.
        """
        return self.averager.error_feedback_residuals()

    def load_error_feedback(self, residuals: Sequence[torch.Tensor]) -> int:
        """Set this peer's error-feedback residuals in the averager process (after a restore from a
        checkpoint); returns how many tensors it took (0: this run's codec keeps none).

        Raises:
            ValueError: count, shapes or values do not fit this run; the residuals stay as they were.
            TimeoutError: the averager process did not answer.
            HelperDied: the averager process exited.
        """
        return self.averager.load_error_feedback(residuals)

    def share_state(self, provider: Callable[[], list[Any]] | None) -> None:
        """Serve the state snapshots from ``provider`` (peer/state/snapshot.py, newest last) to peers that
        download them, or stop serving with None."""
        self.averager.set_state_provider(provider)

    def download_state(self, donors: Sequence[str], digest_hex: str, timeout_s: float) -> StateDownload:
        """Download the state named ``digest_hex`` from every peer in ``donors`` at once.

        Each donor serves an interleaved share of the state's chunks; a donor that fails is dropped
        and its share dealt to the others (peer/state/download.py). Everything received is verified
        against the digest before it is returned, and checked for run id, shapes and finiteness.

        Args:
            donors: peer ids (base58) that publish ``digest_hex`` in their progress records.
            timeout_s: how long a donor may stay silent before it is dropped.

        Raises:
            StateDownloadFailed (a SyncError): no donor left for the missing chunks.
            BadPayload: the verified state is still not a state of this run (wrong shapes).
        """
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError as exc:
            raise BadPayload(f"state digest {digest_hex!r} is not hex") from exc
        result = self.averager.download_state(donors, digest, [*self.shapes, *self.shapes], self.run_id, timeout_s)
        state = validate_state(
            result.meta, result.tensors, run_id=self.run_id, shapes=self.shapes, chunk_hashes=result.chunk_hashes
        )
        return StateDownload(
            state=state,
            chunks_by_donor={str(k): v for k, v in result.chunks_by_donor.items()},
            failed={str(k): v for k, v in result.failed.items()},
            bytes_received=sum(result.bytes_by_donor.values()),
        )

    def shutdown(self) -> None:
        self.averager.shutdown()
