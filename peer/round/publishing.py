"""This peer's progress records in the DHT and the evaluations of φ it makes for the swarm."""

from __future__ import annotations

import copy
import hashlib
import logging

import torch

from peer.net import traffic
from peer.progress import RoundOutcome, SyncReport, Waiting
from peer.reporting import Reporter
from peer.round.state import RoundState
from peer.round.syncing import SyncHistory
from peer.sync.membership import RoundSwarm
from peer.train.data import Corpus, validation_batch, validation_bits_per_byte
from peer.train.model import evaluate
from protocol.records import ProgressRecord

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes this peer's progress record and evaluates φ on the run's validation windows.

    Args:
        evaluates_phi: False on a pipelined peer, which holds one stage's φ, not a model it could
            evaluate alone (no evaluation copy of the model is made then).
        serves_state: False in client mode (nobody can dial it): its records offer no digest.
    """

    def __init__(
        self,
        *,
        state: RoundState,
        swarm: RoundSwarm,
        history: SyncHistory,
        corpus: Corpus,
        reporter: Reporter,
        evaluates_phi: bool,
        serves_state: bool,
    ):
        self.state, self.swarm, self.history, self.reporter = state, swarm, history, reporter
        self.peer_id, self.serves_state, self.evaluates_phi = swarm.peer_id, serves_state, evaluates_phi
        self.val_windows = validation_batch(corpus, state.m.data)
        self.tokenizer = corpus.tokenizer
        self.eval_model = copy.deepcopy(state.model) if evaluates_phi else None
        self.last_round = RoundOutcome(
            round=0,
            train_loss=0.0,
            tokens_per_s=0.0,
            tokens=0,
            peers=1,
            start_digest="",
            state_digest="",
            planned_group=None,
            sync=SyncReport(),
        )
        """The last finished round (its figures go into every progress record until the next one)."""
        self.last_eval: tuple[int, float | None] = (-1, None)
        """(round, validation loss) of the last evaluation of φ."""

    def publish(
        self, *, train_loss: float | None = None, tokens_per_s: float | None = None, wait: bool = False
    ) -> None:
        """Store this peer's progress record: the last round's figures (or the given mid-round loss
        and throughput), and the validation loss while it is of the current round."""
        s, last, (eval_round, eval_loss) = self.state, self.last_round, self.last_eval
        self.swarm.publish(
            ProgressRecord(
                round=s.pos.round,
                inner_step=s.inner_step,
                train_loss=last.train_loss if train_loss is None else train_loss,
                tokens_per_s=last.tokens_per_s if tokens_per_s is None else tokens_per_s,
                group_size=last.sync.group_size,
                bytes_sent=last.sync.bytes_sent,
                bytes_received=last.sync.bytes_received,
                eval_loss=eval_loss if eval_round == s.pos.round else None,
                # a peer nobody can dial (client mode) serves no state: it offers no digest to download
                state_digest=s.digest if self.serves_state else "",
                groupmates=self.history.groupmates,
                caps=traffic.caps_report(),  # --max-upload-mbit / --max-gb-per-day: use against them
            ),
            wait=wait,
        )

    def evaluates(self, round_: int) -> bool:
        """Whether this peer evaluates φ for the swarm at ``round_``: the live peer whose id hashes
        lowest with the round does, so one peer per cadence round spends the time, not all, and the
        choice moves between peers. Views of the records that differ for a moment cost one
        evaluation more or fewer, never a wrong result."""
        ids = {r.peer_id for r in self.swarm.live()} | {self.peer_id}
        return self.peer_id == min(ids, key=lambda p: hashlib.sha256(f"{p}:{round_}".encode()).digest())

    def eval_phi(self, when: str) -> float | None:
        """Validation loss of φ (not of this peer's θ), in nats per token; emits an ``eval`` event
        with it and in bits per UTF-8 byte (``bpb``: compares across tokenizers). None, and no event,
        on a pipelined peer (``evaluates_phi`` False)."""
        if self.eval_model is None:
            return None
        s = self.state
        with s.lock, torch.no_grad():
            for p, f in zip(self.eval_model.parameters(), s.phi):
                p.copy_(f)
        with Waiting(f"evaluating φ of round {s.pos.round} on the validation split"):
            loss = evaluate(self.eval_model, self.val_windows)
        self.last_eval = (s.pos.round, loss)
        self.publish()
        self.reporter.emit(
            "eval",
            when=when,
            round=s.pos.round,
            loss=loss,
            peer_id=self.peer_id,
            bpb=validation_bits_per_byte(loss, self.val_windows, self.tokenizer),
        )
        return loss

    def keep_pace(self) -> None:
        """After evaluating φ for the swarm, start this round at the inner step the swarm reached
        meanwhile (as a joiner does), not at step 0: otherwise this peer reaches the next sync an
        evaluation's time after its groupmates, often after their group formed, and trains that
        round alone. It trains fewer tokens this round; the all-reduce weights it by those it did.
        The inner lr schedule follows the step (round·H + step), as on every peer."""
        s = self.state
        now = self.swarm.step_now(s.pos.round, inner_steps=s.H, batch_size_tokens=s.m.inner_optimizer.batch_size_tokens)
        if now > s.pos.step:
            logger.info(
                "round %d: evaluated φ for the swarm; starting at inner step %d with the others", s.pos.round, now
            )
            s.pos.step = now
