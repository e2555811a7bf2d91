"""The in-process transport and swarm view: N peers' round loops in one process, no network.

Beside :class:`peer.sync.transport.NetworkTransport` and :class:`peer.sync.membership.SwarmView`,
the same two roles (:class:`~peer.sync.transport.RoundTransport`,
:class:`~peer.sync.membership.RoundSwarm`) over one shared :class:`InProcessHub`:

- the swarm's progress records, a DHT in a dict (:class:`InProcessSwarm` reads and writes them;
  records never expire, so :meth:`InProcessSwarm.step_now` extrapolates nothing);
- each sync's group: by default the token-weighted mean of its members' payloads in fp32, every
  member getting the same tensors (as the all-reduce gives everyone the same bytes); with
  :class:`PieceRules` the group's pieces are dealt and aggregated as the network's all-reduce does
  (lab/inprocess_means.py :func:`screened_means`: peer/sync/pieces.py's plan, each owner's screening and mean with
  peer/sync/robust.py ``piece_mean``, each receiver's ``owner_mean_problem``, the strikes), and
  :class:`GroupHooks` let a lab adversary forge contributions, owners' means, records and served
  states (lab/adversary.py). A group is keyed as
  the network keys matchmaking (the round or streaming fragment, protocol/keys.py ``sync_index``,
  and a NoLoCo group's index); it closes when the expected members joined or when the matchmaking
  window passed since its first member came (a member alone then finds no group), and a peer
  arriving after it closed finds no group;
- the state snapshots each peer serves (:meth:`InProcessTransport.share_state` registers the
  round loop's provider; :meth:`InProcessTransport.download_state` reads a donor's and checks it
  as a network download is checked: digest, run id, shapes, finiteness).

The unit tests run real :class:`peer.round.Trainer` s in threads over it, and lab/engine_sim.py a
whole simulated swarm. With :class:`PieceRules` every contribution and mean goes through the run's
codecs (encoded and decoded, as on the wire) and each :class:`InProcessTransport` keeps its
error-feedback residuals as a networked peer does, and the bytes of a sync are the encoded bytes
its pieces and means take (the fp32 butterfly's estimate, :func:`butterfly_bytes`, without
:class:`PieceRules`, or what the constructor says); nothing is timed like the network's all-reduce.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, cast

import torch

from lab.inprocess_means import GroupHooks, MemberOutcome, PieceRules, screened_means
from lab.sim_results import butterfly_bytes
from peer.net.dht import PeerProgress
from peer.state.download import StateDownload, validate_state
from peer.state.snapshot import make_snapshot
from peer.sync.error_feedback import RESIDUAL_DTYPES, keeps_residuals
from peer.sync.membership import SwarmView
from peer.sync.pieces import Suspects
from peer.sync.screening import Strikes
from peer.sync.transport import SyncRequest, SyncResult
from protocol import keys
from protocol.errors import BadPayload, GroupNotFound, PartialAverage, StateDownloadFailed
from protocol.records import ProgressRecord
from protocol.wire.pieces import piece_view

StateProvider = Callable[[], Sequence[Any]]
"""What a peer serves: a callable returning its state snapshots (peer/state/snapshot.py), newest last."""


class InProcessHub:
    """What the peers of one in-process swarm share: records, groups and served states.

    Args:
        members: a group closes once this many joined, whatever size its members expected;
            None: once the size the members expected joined.
        matchmaking_s: how long after its first member came a group stays open, s.
        ghosts: peer ids with a record at round 0 that never sync (a groupmate that is gone).
        rules: aggregate each group as the network's all-reduce does (:func:`screened_means`);
            None: the plain token-weighted fp32 mean, the same tensors for every member.
        hooks: a lab adversary's forgeries (:class:`GroupHooks`); None: everyone honest.
    """

    def __init__(
        self,
        members: int | None = None,
        *,
        matchmaking_s: float = 60.0,
        ghosts: tuple[str, ...] = (),
        rules: PieceRules | None = None,
        hooks: GroupHooks | None = None,
    ):
        self.members, self.matchmaking_s = members, matchmaking_s
        self.rules, self.hooks = rules, hooks
        self.strikes: dict[str, Strikes] = {}
        self.suspects: dict[str, Suspects] = {}
        """Per peer id, the groupmates it ignores (with ``rules``; each networked peer keeps its own)."""
        self.lock = threading.Lock()
        """Guards :attr:`records` and :attr:`providers`."""
        self.records: dict[str, ProgressRecord] = {
            g: ProgressRecord(round=0, inner_step=0, train_loss=1.0, tokens_per_s=1.0, group_size=1, bytes_sent=0)
            for g in ghosts
        }
        self.providers: dict[str, StateProvider] = {}
        self.cond = threading.Condition()
        """Guards :attr:`groups`; members wait on it for their group's mean."""
        self.groups: dict[Hashable, dict[str, Any]] = {}

    # ---- records ----
    def publish(self, peer_id: str, record: ProgressRecord) -> None:
        """Store ``peer_id``'s record (with hooks: the records they say it publishes instead)."""
        published = [(peer_id, record)] if self.hooks is None else self.hooks.records(peer_id, record, self)
        with self.lock:
            for p, r in published:
                self.records[p] = r

    def read(self) -> list[PeerProgress]:
        """Every record, as the DHT returns them (never expiring)."""
        with self.lock:
            return [PeerProgress(peer_id=p, record=r, expiration=math.inf) for p, r in self.records.items()]

    # ---- served states ----
    def serve(self, peer_id: str, provider: StateProvider | None) -> None:
        """Serve ``provider``'s snapshots as ``peer_id``'s (None: stop serving)."""
        with self.lock:
            if provider is None:
                self.providers.pop(peer_id, None)
            else:
                self.providers[peer_id] = provider

    def provider(self, peer_id: str) -> StateProvider | None:
        """What ``peer_id`` serves (with hooks: their ``served``, for any peer id), or None."""
        with self.lock:
            provider = self.providers.get(peer_id)
        hooks = self.hooks
        if hooks is None:
            return provider
        return lambda: hooks.served(peer_id, list(provider()) if provider is not None else [])

    # ---- groups ----
    def _close(self, entry: dict[str, Any]) -> None:
        """Aggregate the group (hold :attr:`cond`): ``entry["mean"]`` the plain mean, or with
        :attr:`rules` ``entry["outcomes"]`` each member's :class:`MemberOutcome` (the members in an
        order drawn from the group's key, as matchmaking orders a group: who owns which pieces)."""
        if self.rules is None:
            ids = sorted(entry["in"])
        else:  # matchmaking's order, which no member chooses: a draw from the group's key
            ids = sorted(entry["in"], key=lambda p: hashlib.blake2b(repr((entry["key"], p)).encode()).digest())
        ordered = [entry["in"][p] for p in ids]
        if self.rules is None:
            total = sum(w for _, w, _ in ordered)
            entry["mean"] = [sum(x[k] * (w / total) for x, w, _ in ordered) for k in range(len(ordered[0][0]))]
        else:
            outcomes = screened_means(
                ids,
                [x for x, _, _ in ordered],
                [w for _, w, _ in ordered],
                round_=entry["round"],
                key=entry["key"],
                rules=self.rules,
                phi_from=entry["phi_from"],
                strikes=self.strikes,
                hooks=self.hooks,
                suspects=self.suspects,
            )
            entry["outcomes"] = dict(zip(ids, outcomes, strict=True))
            entry["mean"] = []  # closed
        self.cond.notify_all()

    def average(
        self,
        peer_id: str,
        payload: Sequence[torch.Tensor],
        weight: float,
        key: Hashable,
        start_digest: str,
        should_stop: Callable[[], bool],
        expected: int = 2,
        *,
        round_: int = 0,
        phi_from: int | None = None,
        outcome: list[MemberOutcome] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, str]]:
        """Join group ``key`` with ``payload`` (fp32 copies are taken; hooks may forge them and the
        claimed ``weight``) and wait for its mean.

        Args:
            round_, phi_from: the sync's round (strikes, the plan) and the first φ tensor of the
                payload (NoLoCo), read with :attr:`rules`.
            outcome: with :attr:`rules`, this member's :class:`MemberOutcome` is appended to it.

        Returns:
            (what this member applies: the group's token-weighted mean, fp32 tensors of this
            caller's own; each member's start digest by peer id).

        Raises:
            GroupNotFound: the group closed before this peer came, this peer was alone when its
                window passed, or ``should_stop`` turned True while waiting.
            PartialAverage: with :attr:`rules`, some piece's mean did not reach this member valid.
        """
        x = [t.detach().to(torch.float32, copy=True) for t in payload]
        if self.hooks is not None:
            x, weight = self.hooks.contribution(peer_id, x, weight, phi_from)
        with self.cond:
            entry = self.groups.setdefault(
                key,
                {"in": {}, "mean": None, "first": time.monotonic(), "key": key, "round": round_, "phi_from": phi_from},
            )
            if entry["mean"] is not None:
                raise GroupNotFound(f"no group formed for sync {key}")
            entry["in"][peer_id] = (x, weight, start_digest)
            if len(entry["in"]) >= (self.members or expected):
                self._close(entry)
            while entry["mean"] is None:
                if should_stop():
                    raise GroupNotFound(f"sync {key} cancelled by shutdown")
                if time.monotonic() - entry["first"] > self.matchmaking_s:
                    if len(entry["in"]) == 1:  # alone when the window closed: no group, as in matchmaking
                        del entry["in"][peer_id]
                        raise GroupNotFound(f"no groupmate came for sync {key} within {self.matchmaking_s} s")
                    self._close(entry)
                self.cond.wait(0.05)
            digests = {p: d for p, (_, _, d) in entry["in"].items()}
            if "outcomes" not in entry:
                return [t.clone() for t in entry["mean"]], digests
            mine: MemberOutcome = entry["outcomes"][peer_id]
            if outcome is not None:
                outcome.append(mine)
            if mine.mean is None:
                raise PartialAverage(f"all-reduce of sync {key} incomplete, nothing applied: {mine.error}")
            return [t.clone() for t in mine.mean], digests


class InProcessSwarm:
    """A peer's view of the swarm over an :class:`InProcessHub`'s records (a :class:`RoundSwarm`).

    Every record counts as live (they never expire) and reads are immediate, so there is nothing
    to prefetch and :meth:`max_age_s` is ignored.

    Args:
        peer_id: this peer's id.
        hub: the swarm's hub.
        max_sync_s: the longest one sync may take, s (bounds the round loop's waits on records).
    """

    record_ttl_s = 0.0
    """Records carry expiration ∞: with a ttl of 0 they were published "now" and nothing is extrapolated."""

    def __init__(self, peer_id: str, hub: InProcessHub, *, max_sync_s: float = 5.0):
        self.peer_id, self.hub, self.max_sync_s = peer_id, hub, max_sync_s

    def live(self, max_age_s: float = 0.0) -> list[PeerProgress]:
        return self.hub.read()

    def others(self, max_age_s: float = 0.0) -> list[PeerProgress]:
        return [r for r in self.live() if r.peer_id != self.peer_id]

    def prefetch(self) -> bool:
        return False  # no background reads: live() reads at once

    def step_now(self, round_: int, *, inner_steps: int, batch_size_tokens: int) -> int:
        """SwarmView's rule over these records (published "now": nothing extrapolated)."""
        return SwarmView.step_now(
            cast(SwarmView, self), round_, inner_steps=inner_steps, batch_size_tokens=batch_size_tokens
        )

    def seconds_to_finish(
        self,
        round_: int,
        records: Sequence[PeerProgress],
        *,
        inner_steps: int,
        batch_size_tokens: int,
        peers: Collection[str] | None = None,
    ) -> float:
        """SwarmView's rule over these records (published "now": nothing extrapolated)."""
        return SwarmView.seconds_to_finish(
            cast(SwarmView, self),
            round_,
            records,
            inner_steps=inner_steps,
            batch_size_tokens=batch_size_tokens,
            peers=peers,
        )

    def publish(self, record: ProgressRecord, *, wait: bool = False) -> None:
        self.hub.publish(self.peer_id, record)

    def round_finished(self) -> None:
        pass

    def wait_for(self, want: int, *, timeout_s: float, stop: threading.Event, heartbeat: Callable[[], None]) -> int:
        """Start barrier: until ``want`` peers (this one included) published a record, polling
        every 50 ms; returns the peers seen last."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = len({r.peer_id for r in self.live()} | {self.peer_id})
            if seen >= want or stop.is_set() or time.monotonic() >= deadline:
                return seen
            heartbeat()
            stop.wait(0.05)


class InProcessTransport:
    """A peer's transport over an :class:`InProcessHub` (a :class:`RoundTransport`).

    Every call to :meth:`average` is logged in :attr:`calls` (round, thread name), :attr:`budgets`
    (its ``wait_budget_s``) and :attr:`carried` (round, fragment, payload shapes, tensor indices,
    thread name), for tests.

    Args:
        peer_id: this peer's id.
        hub: the swarm's hub; None: a hub of this peer's own (it never finds a groupmate).
        fail: called as ``fail(round_, should_stop)`` before each group is joined: it may raise
            (a SyncError, ``HelperDied``), wait, or return to let the sync go on.
        shapes, run_id: what a downloaded state must fit (the network transport's ``param_shapes``
            and ``run_id``); None: the donor's own snapshot's shapes and run id.
        keeps_serving: ``share_state(None)`` leaves the last provider registered (a peer that
            stays up serving after its round loop ended).
        max_sync_seconds: the bound on one :meth:`average` call the round loop is told.
        bytes_per_sync: (sent, received) reported for each sync; None: the fp32 butterfly
            all-reduce's estimate for the group's size.
        phi_from: index of the first payload tensor that is φ, not Δ (NoLoCo:
            ``OuterAlgorithm.phi_from``), or None; read by a hub with :class:`PieceRules`.
    """

    def __init__(
        self,
        peer_id: str,
        hub: InProcessHub | None = None,
        fail: Callable[..., Any] | None = None,
        *,
        shapes: Sequence[torch.Size] | None = None,
        run_id: str | None = None,
        keeps_serving: bool = False,
        max_sync_seconds: float = 5.0,
        bytes_per_sync: tuple[int, int] | None = (1, 1),
        phi_from: int | None = None,
    ):
        self.peer_id, self.hub, self.fail = peer_id, hub if hub is not None else InProcessHub(), fail
        self.phi_from = phi_from
        self.shapes, self.run_id, self.keeps_serving = shapes, run_id, keeps_serving
        self.max_sync_seconds, self.bytes_per_sync = max_sync_seconds, bytes_per_sync
        self.calls: list[tuple[int, str]] = []
        self.budgets: list[float] = []
        self.carried: list[tuple[int, int | None, list[tuple[int, ...]], list[int], str]] = []
        self._residuals: dict[int, torch.Tensor] = {}
        """Per payload tensor (whole-payload numbering), its error-feedback residual, added to its next
        contribution (peer/sync/error_feedback.py): what a lossy codec dropped (with the run's
        ``compression.error_feedback``) and the Δ of pieces the receipts skipped (carried), in
        ``compression.residual_dtype``."""

    def average(self, payload: Sequence[torch.Tensor], *, request: SyncRequest) -> SyncResult:
        """The group's token-weighted mean of ``payload`` (see NetworkTransport.average); the group
        is keyed by the round (or fragment sync) and ``request.group_index``."""
        round_, tensors, should_stop = request.round_, request.tensors, request.should_stop
        thread = threading.current_thread().name
        self.calls.append((round_, thread))
        self.budgets.append(request.wait_budget_s)
        self.carried.append((round_, request.fragment, [tuple(t.shape) for t in payload], list(tensors or ()), thread))
        start = time.monotonic()
        if self.fail is not None:
            self.fail(round_, should_stop)
        key = (keys.sync_index(round_, request.fragment, request.fragments), request.group_index)
        # a fragment's payload holds a subset of the tensors: φ starts after its Δ ones (as the averager counts)
        phi_from = self.phi_from
        if phi_from is not None and tensors is not None:
            phi_from = sum(1 for i in tensors if i < phi_from)
        outcome: list[MemberOutcome] = []
        numbers = list(tensors) if tensors is not None else list(range(len(payload)))
        if self._residuals:
            payload = [t.float() + self._residuals[i] if i in self._residuals else t for t, i in zip(payload, numbers)]
        try:
            mean, digests = self.hub.average(
                self.peer_id,
                payload,
                request.weight,
                key,
                request.start_digest,
                should_stop,
                request.expected_group_size,
                round_=round_,
                phi_from=phi_from,
                outcome=outcome,
            )
        except PartialAverage as exc:
            exc.bytes_sent = exc.bytes_received = self._bytes(payload, request.expected_group_size)[0]
            raise
        mine = outcome[0] if outcome else MemberOutcome(mean=None)
        self._feedback(mine, numbers, payload, carry=request.carry_skipped)
        kept = () if request.carry_skipped else tuple((p.tensor, p.start, p.stop) for p, _ in mine.carried)
        sent, received = self._bytes(payload, len(digests), mine)
        return SyncResult(
            mean=mean,
            group=sorted(digests),
            group_size=len(digests),
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - start,
            start_digests=digests,
            excluded=mine.excluded,
            partial_pieces=mine.partial_pieces,
            refused=tuple(sorted(mine.refused)),
            refused_pieces=mine.refused_pieces,
            kept_rows=kept,
        )

    def _feedback(
        self, mine: MemberOutcome, numbers: Sequence[int], sent: Sequence[torch.Tensor], *, carry: bool
    ) -> None:
        """After a completed sync of tensors ``numbers`` whose contributions were ``sent`` (residuals
        added): their new residuals, as peer/sync/allreduce.py stages them. A piece a lossy codec
        carried: ``sent`` minus what its owner decoded (with ``compression.error_feedback``); a piece
        the receipts skipped: all of ``sent`` (``carry``), or the residual it had (a blocking
        landing keeps θ's progress there); elsewhere zero."""
        spec = self.hub.rules.compression if self.hub.rules is not None else None
        dtype = RESIDUAL_DTYPES[spec.residual_dtype] if spec is not None else torch.float32
        old = {i: self._residuals.pop(i) for i in numbers if i in self._residuals}
        feeds = spec is not None and keeps_residuals(spec)
        staged = [(p, piece_view(sent[p.tensor], p).float() - d) for p, d in mine.decoded] if feeds else []
        for piece, value in mine.carried:
            if carry:
                staged.append((piece, value))
            elif (held := old.get(numbers[piece.tensor])) is not None:
                staged.append((piece, piece_view(held, piece).float()))
        for piece, value in staged:
            i = numbers[piece.tensor]
            if i not in self._residuals:
                self._residuals[i] = torch.zeros(sent[piece.tensor].shape, dtype=dtype)
            piece_view(self._residuals[i], piece).copy_(value)

    def _bytes(
        self, payload: Sequence[torch.Tensor], group_size: int, mine: MemberOutcome | None = None
    ) -> tuple[int, int]:
        """(sent, received) for one sync: the constructor's ``bytes_per_sync``, else the encoded bytes
        a hub with :class:`PieceRules` counted, else the fp32 butterfly's estimate."""
        if self.bytes_per_sync is not None:
            return self.bytes_per_sync
        if mine is not None and mine.bytes_sent:
            return mine.bytes_sent, mine.bytes_received
        sent = int(butterfly_bytes(sum(t.numel() for t in payload), group_size))
        return sent, sent

    def share_state(self, provider: StateProvider | None) -> None:
        if provider is None and self.keeps_serving:
            return
        self.hub.serve(self.peer_id, provider)

    def download_state(self, donors: Sequence[str], digest_hex: str, timeout_s: float) -> StateDownload:
        """The state named ``digest_hex`` from the first of ``donors`` whose provider serves it,
        verified against the digest and checked as a network download is (peer/state/download.py).

        Raises:
            StateDownloadFailed: no donor serves it.
            BadPayload: it does not hash to the digest, or is not a state of this run.
        """
        failed = {}
        for donor in donors:
            provider = self.hub.provider(donor)
            if provider is None:
                failed[donor] = "serves no state"
                continue
            for snap in list(provider()):
                if snap.digest.hex() != digest_hex:
                    continue
                tensors = [t.clone() for t in snap.tensors]
                received = make_snapshot(snap.meta, tensors)
                if received.digest.hex() != digest_hex:
                    raise BadPayload(f"the state {donor} served does not hash to {digest_hex}")
                shapes = self.shapes if self.shapes is not None else [t.shape for t in tensors[: len(tensors) // 2]]
                run_id = self.run_id if self.run_id is not None else snap.meta.get("run_id")
                state = validate_state(
                    snap.meta, tensors, run_id=run_id, shapes=shapes, chunk_hashes=received.chunk_hashes
                )
                return StateDownload(
                    state=state,
                    chunks_by_donor={donor: 1},
                    failed=failed,
                    bytes_received=sum(t.numel() * 4 for t in tensors),
                )
            failed[donor] = "does not serve it"
        raise StateDownloadFailed(f"no donor of {list(donors)} serves state {digest_hex}", failed=failed)

    def reset_error_feedback(self) -> None:
        self._residuals.clear()

    def error_feedback_residuals(self) -> list[torch.Tensor] | None:
        return None

    def load_error_feedback(self, residuals: Sequence[torch.Tensor]) -> int:
        return 0

    def shutdown(self) -> None:
        self.share_state(None)
