"""The round loop of one peer: H inner steps, pseudo-gradient, group average, outer step.

Implements DiLoCo (arXiv 2311.08105, Algorithm 1) for one worker, with the swarm around it:
state download when the swarm is ahead, progress records in the DHT, local checkpoints and
a clean stop on a signal.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.utils import get_dht_time

from peer.state.checkpoint import PeerState, load_checkpoint, save_checkpoint
from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch
from peer.train.inner import InnerLoop
from peer.train.model import evaluate
from peer.train.outer import check_finite, make_outer, pseudo_gradient
from protocol.groups import group_of, partition
from peer.reporting import Reporter
from peer.state.resync import resync_target
from peer.state.transfer import StateSnapshot, make_snapshot
from peer.sync.transport import DownloadedState, NetworkTransport
from protocol import dht as swarm_dht
from protocol.errors import BadPayload, CheckpointError, SyncError
from protocol.manifest import RunManifest
from protocol.records import ProgressRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What this peer does, as opposed to what the run is (the manifest)."""

    max_rounds: int | None = None
    """Stop once the run reaches this round; None trains until stopped."""
    eval_every_rounds: int = 0
    """Evaluate φ every k rounds (0: only at the start and the end)."""
    checkpoint_path: Path | None = None
    state_download_timeout_s: float = 5.0
    """A donor that sends nothing for this long during a state download is dropped (its chunks go
    to the other donors)."""
    export_phi_every_rounds: int = 0
    """Write φ to ``phi-round-NNNNNN.safetensors`` beside the checkpoint every k rounds (0: never)."""
    wait_for_peers: int = 1
    """Before the first round, wait until this many peers (this one included) are live in the DHT."""
    wait_for_peers_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_rounds is not None and self.max_rounds < 0:
            raise ValueError(f"max_rounds = {self.max_rounds}: must be >= 0")
        if self.wait_for_peers < 1:
            raise ValueError(f"wait_for_peers = {self.wait_for_peers}: must be >= 1")
        if self.export_phi_every_rounds < 0:
            raise ValueError(f"export_phi_every_rounds = {self.export_phi_every_rounds}: must be >= 0")
        if self.eval_every_rounds < 0:
            raise ValueError(f"eval_every_rounds = {self.eval_every_rounds}: must be >= 0")


@dataclass
class TrainSummary:
    peer_id: str
    rounds_completed: int = 0
    max_group_size: int = 1
    bytes_sent: int = 0
    bytes_received: int = 0
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    final_round: int = 0
    interrupted: bool = False
    failed_syncs: int = 0
    group_sizes: list[int] = field(default_factory=list)


class Trainer:
    """Trains one peer. Construct with a started DHT and transport; call :meth:`run`."""

    def __init__(self, *, manifest: RunManifest, model: torch.nn.Module, corpus: Corpus, dht,
                 transport: NetworkTransport, peer_id: str, config: TrainerConfig, reporter: Reporter,
                 stop_event: threading.Event):
        self.m, self.model, self.dht, self.transport = manifest, model, dht, transport
        self.peer_id, self.cfg, self.reporter, self.stop_event = peer_id, config, reporter, stop_event
        self.H = manifest.sync.inner_steps
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.phi = [p.detach().clone() for p in self.params]
        self.outer = make_outer(manifest, self.shapes)
        sampler = BatchSampler(corpus.train, seq_len=manifest.data.seq_len_tokens,
                               batch_sequences=manifest.batch_sequences,
                               seed=peer_seed(peer_id, manifest.model.init_seed))
        self.inner = InnerLoop(model, manifest.inner_optimizer, sampler)
        self.val_windows = validation_batch(corpus, manifest.data)
        self._eval_model = copy.deepcopy(model)
        self.round = self.round_step = self.round_tokens = 0
        self.round_loss_sum = 0.0
        self.round_compute_s = 0.0
        self.round_steps_done = 0
        self._lock = threading.Lock()
        self._planned_group: list[str] | None = None
        self._last_sync: dict[str, Any] = dict(train_loss=0.0, tokens_per_s=0.0, group_size=1, bytes_sent=0,
                                               bytes_received=0)
        self._last_eval: tuple[int, float | None] = (-1, None)
        self._snapshots: deque[StateSnapshot] = deque(maxlen=2)
        """States at the start of this and the last round, served to joiners (newest last)."""
        self._last_group: list[str] = [peer_id]
        self._round_seconds: deque[float] = deque(maxlen=8)
        self._round_started = time.monotonic()
        self._last_records: list[swarm_dht.PeerProgress] = []
        self.summary = TrainSummary(peer_id=peer_id)
        self._take_snapshot()

    # ---- state --------------------------------------------------------------------------
    @property
    def inner_step(self) -> int:
        """Cumulative inner steps of φ's history: indexes the inner lr schedule."""
        return self.round * self.H + self.round_step

    def _take_snapshot(self) -> None:
        """Snapshot φ, outer state and position at a round boundary; its digest is what this peer
        publishes and what joiners download (peer/state/transfer.py)."""
        with self._lock:
            meta = {"run_id": self.m.run_id, "round": self.round, "inner_step": self.round * self.H}
            snapshot = make_snapshot(meta, [*self.phi, *self.outer.state_tensors()])
        self._snapshots.append(snapshot)

    @property
    def state_digest(self) -> str:
        return self._snapshots[-1].digest.hex()

    def _state_for_joiners(self) -> list[StateSnapshot]:
        return list(self._snapshots)

    def _set_theta_to_phi(self) -> None:
        with torch.no_grad():
            for p, f in zip(self.params, self.phi):
                p.copy_(f)

    def _adopt(self, state: DownloadedState) -> None:
        with self._lock:
            for dst, src in zip(self.phi, state.phi):
                dst.copy_(src)
            for dst, src in zip(self.outer.state_tensors(), state.outer_state):
                dst.copy_(src)
            self.round, self.round_step, self.round_tokens = state.round, 0, 0
            self.round_loss_sum, self.round_compute_s, self.round_steps_done = 0.0, 0.0, 0
        self._set_theta_to_phi()
        self.inner.reset_optimizer()  # a joiner starts a fresh AdamW (ALGORITHMS.md §6.3)
        self.transport.reset_error_feedback()  # residuals of a φ this peer no longer holds
        self._last_group = [self.peer_id]
        self._take_snapshot()

    def _checkpoint_state(self) -> PeerState:
        adam = self.inner.optimizer.state
        have_adam = all(p in adam and "exp_avg" in adam[p] for p in self.params)
        return PeerState(
            run_id=self.m.run_id, round=self.round, inner_step=self.inner_step, round_step=self.round_step,
            round_tokens=self.round_tokens, names=self.names, phi=self.phi, momentum=self.outer.state_tensors(),
            theta=[p.detach() for p in self.params],
            adam_exp_avg=[adam[p]["exp_avg"] for p in self.params] if have_adam else None,
            adam_exp_avg_sq=[adam[p]["exp_avg_sq"] for p in self.params] if have_adam else None,
            adam_step=int(adam[self.params[0]]["step"]) if have_adam else 0,
        )

    def _restore(self, path: Path) -> bool:
        try:
            state = load_checkpoint(path, run_id=self.m.run_id, names=self.names, shapes=self.shapes)
        except CheckpointError as exc:
            self.reporter.emit("warning", message=f"{exc}; starting without it")
            return False
        with torch.no_grad():
            for dst, src in zip(self.phi, state.phi):
                dst.copy_(src)
            for dst, src in zip(self.outer.state_tensors(), state.momentum):
                dst.copy_(src)
            for dst, src in zip(self.params, state.theta):
                dst.copy_(src)
        if state.adam_exp_avg is not None and state.adam_exp_avg_sq is not None:
            for p, m1, m2 in zip(self.params, state.adam_exp_avg, state.adam_exp_avg_sq):
                self.inner.optimizer.state[p] = {"step": torch.tensor(float(state.adam_step)),
                                                 "exp_avg": m1.clone(), "exp_avg_sq": m2.clone()}
        self.round, self.round_step, self.round_tokens = state.round, state.round_step, state.round_tokens
        self._take_snapshot()
        self.reporter.emit("resumed", path=str(path), round=self.round, round_step=self.round_step,
                           state_digest=self.state_digest)
        return True

    def save(self) -> str | None:
        if self.cfg.checkpoint_path is None:
            return None
        save_checkpoint(self.cfg.checkpoint_path, self._checkpoint_state())
        return str(self.cfg.checkpoint_path)

    def _export_phi(self) -> None:
        k = self.cfg.export_phi_every_rounds
        if not k or self.cfg.checkpoint_path is None or self.round % k:
            return
        from safetensors.torch import save_file

        path = self.cfg.checkpoint_path.parent / f"phi-round-{self.round:06d}.safetensors"
        with self._lock:
            tensors = {n: t.clone() for n, t in zip(self.names, self.phi)}
        save_file(tensors, str(path), metadata={"run_id": self.m.run_id, "round": str(self.round)})

    # ---- swarm --------------------------------------------------------------------------
    @property
    def _record_ttl(self) -> float:
        return max(60.0, 3 * self.transport.max_sync_seconds)

    def _stale_after_s(self) -> float:
        """A record not refreshed for this long belongs to a peer that is gone, hung or cut off.

        A live peer republishes four times per round and after every round, and its round lasts
        about as long as this peer's (they sync together), so two of this peer's recent rounds
        (at least 10 s) cover the gap between two records of a live peer.
        """
        return max(10.0, 2.0 * max(self._round_seconds, default=self.transport.max_sync_seconds))

    def _live_records(self) -> list[swarm_dht.PeerProgress]:
        start = time.monotonic()
        try:
            records = self._last_records = swarm_dht.read_progress(self.dht, self.m.run_id)
        except Exception as exc:  # a DHT read failure must not stop training (nor make this peer "alone")
            logger.debug("reading progress records failed: %r; using the last ones read", exc)
            records = self._last_records
        finally:
            logger.debug("read progress records in %.3f s", time.monotonic() - start)
        # published at expiration - ttl (every peer of the run uses the same ttl)
        oldest = get_dht_time() + self._record_ttl - self._stale_after_s()
        return [r for r in records if r.peer_id == self.peer_id or r.expiration >= oldest]

    def _publish(self, *, train_loss: float | None = None, tokens_per_s: float | None = None,
                 group_size: int | None = None, bytes_sent: int | None = None, bytes_received: int | None = None,
                 wait: bool = False) -> None:
        """Store this peer's progress record; fields left None repeat the last sync's values, and the
        validation loss is included while it is of the current round (the monitor reads both)."""
        last = self._last_sync
        eval_round, eval_loss = self._last_eval
        record = ProgressRecord(
            round=self.round, inner_step=self.inner_step,
            train_loss=last["train_loss"] if train_loss is None else train_loss,
            tokens_per_s=last["tokens_per_s"] if tokens_per_s is None else tokens_per_s,
            group_size=last["group_size"] if group_size is None else group_size,
            bytes_sent=last["bytes_sent"] if bytes_sent is None else bytes_sent,
            bytes_received=last["bytes_received"] if bytes_received is None else bytes_received,
            eval_loss=eval_loss if eval_round == self.round else None, state_digest=self.state_digest)
        try:
            swarm_dht.publish_progress(self.dht, self.m.run_id, self.peer_id, record, self._record_ttl, wait=wait)
        except Exception as exc:
            logger.debug("publishing progress failed: %r", exc)

    def _resync_target(self, records: list[swarm_dht.PeerProgress]) -> tuple[int, str, list[str]] | None:
        """(round, digest, donors) of the state this peer should adopt, or None (peer/state/resync.py)."""
        return resync_target(
            [(r.peer_id, r.record.round, r.record.state_digest) for r in records if r.peer_id != self.peer_id],
            round_=self.round, digest=self.state_digest, completed_with=self._last_group,
            algorithm=self.m.sync.algorithm, fresh=self.round == 0 and self.round_step == 0)

    def catch_up(self) -> bool:
        """Adopt the swarm's state if this peer is behind or diverged (rule: :meth:`_resync_target`).

        Downloads φ, outer optimizer state and round from every peer that publishes the target
        digest at once (peer/state/transfer.py), checks it against the digest, and starts at the swarm's
        current inner step. A failed download is reported and leaves this peer's state unchanged.
        """
        if self.m.sync.algorithm == "independent":
            return False  # the no-sync baseline never takes anything from other peers
        target = self._resync_target(self._live_records())
        if target is None:
            return False
        round_, digest, donors = target
        start = time.monotonic()
        try:
            download = self.transport.download_state(donors, digest, self.cfg.state_download_timeout_s)
        except (BadPayload, SyncError) as exc:
            self.reporter.emit("warning", message=f"state download of round {round_} failed, continuing from "
                                                  f"round {self.round}: {exc}")
            return False
        state = download.state
        reason = "behind" if state.round > self.round else "diverged" if state.round == self.round else "raced ahead"
        self._adopt(state)
        # Start where the swarm is inside this round (read again: it went on during the download), so
        # this peer reaches the sync with the others; the all-reduce weights its shorter round by the
        # tokens it actually processed.
        same_round = [r.record.inner_step - self.round * self.H for r in self._live_records()
                      if r.peer_id != self.peer_id and r.record.round == self.round]
        self.round_step = max(0, min(self.H - 1, max(same_round, default=0)))
        self.reporter.emit("adopted_state", round=self.round, inner_step=self.inner_step,
                           seconds=time.monotonic() - start, reason=reason,
                           state_digest=self.state_digest, donors=download.chunks_by_donor,
                           failed_donors=download.failed, bytes=download.bytes_received)
        self._publish()
        return True

    def _catch_up_fully(self, attempts: int = 3) -> None:
        """Catch up again while the swarm moved on during the download (a long download would
        otherwise land this peer at a round the swarm has just finished)."""
        for _ in range(attempts):
            if self.stop_event.is_set() or not self.catch_up():
                return

    def _wait_for_peers(self) -> None:
        """Start barrier for launchers that start several peers at once (``peer swarm``)."""
        want = self.cfg.wait_for_peers
        if want <= 1:
            return
        deadline = time.monotonic() + self.cfg.wait_for_peers_timeout_s
        seen = 0
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            seen = len({r.peer_id for r in self._live_records()} | {self.peer_id})
            if seen >= want:
                return
            self._publish()
            self.stop_event.wait(0.5)
        if not self.stop_event.is_set():
            self.reporter.emit("warning", message=f"only {seen} of {want} peers appeared within "
                                                  f"{self.cfg.wait_for_peers_timeout_s:.0f} s; starting anyway")

    # ---- evaluation ---------------------------------------------------------------------
    def eval_phi(self, when: str) -> float:
        """Validation loss of φ (not of this peer's θ), in nats per token; emits an ``eval`` event."""
        with self._lock, torch.no_grad():
            for p, f in zip(self._eval_model.parameters(), self.phi):
                p.copy_(f)
        loss = evaluate(self._eval_model, self.val_windows)
        self._last_eval = (self.round, loss)
        self._publish()
        self.reporter.emit("eval", when=when, round=self.round, loss=loss, peer_id=self.peer_id)
        return loss

    # ---- the loop -----------------------------------------------------------------------
    def _done(self) -> bool:
        return self.cfg.max_rounds is not None and self.round >= self.cfg.max_rounds

    def run(self) -> TrainSummary:
        """Train until ``max_rounds`` or until ``stop_event`` is set; return the summary.

        On a stop the current inner step finishes and a checkpoint is written; the summary has
        ``interrupted=True``.
        """
        path = self.cfg.checkpoint_path
        if path is not None and path.exists():
            self._restore(path)
        self._catch_up_fully()
        self.transport.share_state(self._state_for_joiners)
        self._publish()
        self._wait_for_peers()
        self.summary.initial_eval_loss = self.eval_phi("initial")
        while not self._done() and not self.stop_event.is_set():
            self._inner_phase()
            if self.stop_event.is_set():
                break
            self._outer_phase()
            if self.cfg.eval_every_rounds and self.round % self.cfg.eval_every_rounds == 0 and not self._done():
                self.eval_phi("periodic")
            self.save()
            self._export_phi()
            if not self._done():
                self._catch_up_fully()
        self.summary.interrupted = self.stop_event.is_set()
        self.summary.final_round = self.round
        if not self.summary.interrupted:
            self.summary.final_eval_loss = self.eval_phi("final")
        self._publish(wait=True)  # the last record must reach the DHT before it shuts down
        self.transport.share_state(None)
        return self.summary

    def _inner_phase(self) -> None:
        while self.round_step < self.H and not self.stop_event.is_set():
            try:
                result = self.inner.step(self.inner_step)
            except BadPayload as exc:
                # A non-finite loss or gradient: drop this round's progress rather than poison θ.
                self.reporter.emit("warning", message=f"{exc}; restarting the round from φ")
                self._set_theta_to_phi()
                self.round_tokens = 0  # Δ now covers only the steps after the reset; weight it so
                self.round_step += 1   # the lr schedule still advances: it is never rewound
                continue
            self.round_step += 1
            self.round_tokens += result.tokens
            self.round_loss_sum += result.loss
            self.round_steps_done += 1
            self.round_compute_s += result.seconds
            if self.round_step % max(1, self.H // 4) == 0 and self.round_step < self.H:
                # Mid-round records let a joiner start at the swarm's current inner step.
                self._publish(train_loss=result.loss, tokens_per_s=self.round_tokens / self.round_compute_s)

    def _plan_group(self, live: list[swarm_dht.PeerProgress]) -> tuple[int, int | None, str]:
        """(expected group size, random group index or None, note) for this round's sync."""
        if self.m.sync.algorithm == "independent":
            return 1, None, "independent: no sync"
        if self.m.sync.algorithm == "noloco":
            near = {r.peer_id for r in live if abs(r.record.round - self.round) <= 1} | {self.peer_id}
            # Random groups from the peers within one round of this one (in lockstep, every peer
            # sees the same set at its sync, so all draw the same groups).
            groups = partition(sorted(near), run_id=self.m.run_id, round_=self.round,
                               group_size=self.m.noloco.group_size)
            index, members = group_of(self.peer_id, groups)
            if len(members) == 1:
                return 1, None, "no partner this round: applied own step"
            self._planned_group = members
            return len(members), index, ""
        # DiLoCo: every live peer, whatever its round. One that is behind adopts the swarm's state and
        # joins this round; one that is not here when matchmaking ends is left out. A peer that
        # synced only with peers near its round would race ahead alone when the others fall back.
        everyone = {r.peer_id for r in live} | {self.peer_id}
        if len(everyone) == 1:
            return 1, None, "alone: no other live peer, applied own pseudo-gradient"
        return len(everyone), None, ""

    def _outer_phase(self) -> None:
        delta = pseudo_gradient(self.phi, self.params)
        round_tokens = self.round_tokens
        train_loss = self.round_loss_sum / max(1, self.round_steps_done)
        tokens_per_s = self.round_tokens / max(self.round_compute_s, 1e-9)
        live = self._live_records()
        expected, group_index, note = self._plan_group(live)
        group_size, group, bytes_sent, bytes_received, sync_s = 1, [self.peer_id], 0, 0, 0.0
        deadline_s = 0.0
        agreeing = [self.peer_id]
        attempts = 0
        mean: list[torch.Tensor] | None = None
        try:
            check_finite(delta, "this peer's pseudo-gradient")
            mean = self.outer.payload(self.phi, delta)
        except BadPayload as exc:
            note = f"{exc}: round discarded, φ unchanged"
        start_digest = self.state_digest
        if mean is not None and expected > 1:
            self.reporter.emit("sync", round=self.round, expected_group_size=expected, peer_id=self.peer_id)
            sync_start = time.monotonic()
            try:
                result = self.transport.average(mean, weight=float(max(self.round_tokens, 1)), round_=self.round,
                                                expected_group_size=expected, group_index=group_index,
                                                start_digest=start_digest, should_stop=self.stop_event.is_set)
                check_finite(result.mean, "the group's mean payload")
                mean, group, group_size = result.mean, result.group, result.group_size
                deadline_s = result.deadline_s
                # groupmates that started from this peer's state hold the same state after the round
                agreeing = [p for p, d in (result.start_digests or {}).items() if d == start_digest]
                bytes_sent, bytes_received, sync_s = result.bytes_sent, result.bytes_received, result.seconds
                attempts = result.attempts
                if result.excluded or result.partial_pieces:
                    agreeing = [self.peer_id]  # which groupmates completed is not known here
                    note = (f"{result.partial_pieces} piece(s) averaged without a failed groupmate "
                            f"({result.excluded} excluded here)")
            except (SyncError, BadPayload) as exc:
                bytes_sent, bytes_received = self.transport.last_bytes
                deadline_s = self.transport.last_deadline_s
                sync_s = time.monotonic() - sync_start
                # Failed rounds are recorded, not fatal (DiLoCo paper Fig. 8: dropped syncs are survivable).
                self.summary.failed_syncs += 1
                note = f"no group: applied own step ({exc})"
                logger.info("round %d: %s", self.round, note)
        with self._lock:
            if mean is not None:
                self.outer.apply(self.phi, mean)
            self.round += 1
            self.round_step = self.round_tokens = 0
            self.round_loss_sum = self.round_compute_s = 0.0
            self.round_steps_done = 0
        self._set_theta_to_phi()
        self._last_group = sorted(set(agreeing) | {self.peer_id})
        self._take_snapshot()
        now = time.monotonic()
        self._round_seconds.append(now - self._round_started)
        self._round_started = now
        s = self.summary
        s.rounds_completed += 1
        s.max_group_size = max(s.max_group_size, group_size)
        s.bytes_sent += bytes_sent
        s.bytes_received += bytes_received
        s.group_sizes.append(group_size)
        self._last_sync = dict(train_loss=train_loss, tokens_per_s=tokens_per_s, group_size=group_size,
                               bytes_sent=bytes_sent, bytes_received=bytes_received)
        self._publish(train_loss=train_loss, tokens_per_s=tokens_per_s, group_size=group_size,
                      bytes_sent=bytes_sent, bytes_received=bytes_received)
        self.reporter.emit("round", round=self.round, train_loss=train_loss, tokens_per_s=tokens_per_s,
                           group_size=group_size, sync_s=sync_s, bytes_sent=bytes_sent,
                           bytes_received=bytes_received, peers=len(live) or 1,
                           peer_id=self.peer_id, group=group, note=note, planned_group=self._planned_group,
                           tokens=round_tokens, attempts=attempts, start_digest=start_digest, agreeing=self._last_group, state_digest=self.state_digest,
                           deadline_s=deadline_s)
        self._planned_group = None
