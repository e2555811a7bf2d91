"""This peer's progress records in the DHT and the evaluations of φ it makes for the swarm."""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from peer.net import traffic
from peer.progress import RoundOutcome, SyncReport, Waiting
from peer.reporting import Reporter
from peer.round.catchup import phi_loss
from peer.round.state import RoundState
from peer.round.syncing import SyncHistory
from peer.sync.membership import RoundSwarm
from peer.train.data import Corpus, validation_batch, validation_bits_per_byte
from peer.train.model import build_model, evaluate
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
        self.last_eval_digest: str | None = None
        """Digest of the snapshot whose φ :attr:`last_eval` measured (None: not known to be one):
        :meth:`measured_phi`."""
        self._alongside: tuple[str, int, str | None, Future[float]] | None = None
        """The evaluation :meth:`eval_phi_alongside` started and :meth:`finish_eval` has not reported:
        (``when``, round of its φ, that φ's snapshot digest, its result to come)."""
        self._initial_loss: float | None = None

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
        on a pipelined peer (``evaluates_phi`` False). An evaluation still running alongside
        (:meth:`eval_phi_alongside`) is waited for and reported first."""
        if self.eval_model is None:
            return None
        self.finish_eval()
        round_, digest = self._load_phi(self.eval_model)
        with Waiting(f"evaluating φ of round {round_} on the validation split"):
            loss = evaluate(self.eval_model, self.val_windows)
        self._report(when, round_, loss, digest)
        return loss

    def report_eval(self, when: str, loss: float) -> None:
        """Report ``loss`` (nats/token) as this ``when``'s evaluation of φ as it is now, as
        :meth:`eval_phi` reports its own, without evaluating: φ's loss already measured on these
        validation windows (an adoption's loss check, peer/round/catchup.py ``CatchUp.known_loss``).
        An evaluation still running alongside is reported first."""
        self.finish_eval()
        self._report(when, self.state.pos.round, loss, self._phi_digest())

    def eval_phi_alongside(self, when: str) -> None:
        """Start evaluating φ as it is now in a background thread, on the evaluation copy, while the
        caller trains (issue #53 item 4: a restart trains at once, its evaluation alongside); the
        caller reports it with :meth:`finish_eval` (the ``eval`` event, the record's loss and the
        round are those of the φ copied now). Nothing on a pipelined peer. For a host device only:
        on an accelerator its activations would take memory the micro-batch was fitted to."""
        if self.eval_model is None:
            return
        self.finish_eval()
        model, windows = self.eval_model, self.val_windows
        round_, digest = self._load_phi(model)
        result: Future[float] = Future()

        def evaluate_phi() -> None:
            try:
                result.set_result(evaluate(model, windows))
            except BaseException as exc:  # raised on the caller's thread by finish_eval
                result.set_exception(exc)

        threading.Thread(target=evaluate_phi, name="locoswarm-eval", daemon=True).start()
        self._alongside = (when, round_, digest, result)

    def finish_eval(self, *, wait: bool = True) -> float | None:
        """Report the evaluation :meth:`eval_phi_alongside` started (as :meth:`eval_phi` reports
        its own) once it is done, waiting for it with ``wait``; returns its loss in nats per token,
        None when there is none or (without ``wait``) it still runs. Call from the round loop's
        thread.

        Raises:
            What the evaluation raised (it is then no longer pending).
        """
        if self._alongside is None or not (wait or self._alongside[3].done()):
            return None
        when, round_, digest, result = self._alongside
        self._alongside = None
        loss = result.result()
        self._report(when, round_, loss, digest)
        return loss

    def phi_loss(self, phi: Sequence[torch.Tensor]) -> float:
        """The validation loss of ``phi`` on the evaluation copy (peer/round/catchup.py
        :func:`~peer.round.catchup.phi_loss`: an adoption's loss check), after any evaluation
        alongside is done and reported (the copy is that evaluation's until then).

        Raises:
            ValueError: no evaluation copy (a pipelined peer), or ``phi`` does not fit the model.
        """
        if self.eval_model is None:
            raise ValueError("a pipelined peer has no evaluation copy of the model")
        self.finish_eval()
        return phi_loss(self.eval_model, self.val_windows, phi)

    def loss_on(self, phi: Sequence[torch.Tensor], windows: torch.Tensor) -> float:
        """The mean loss of ``phi`` on ``windows`` (int64, (sequences, seq_len + 1), host) in nats per
        token, on the evaluation copy, after any evaluation alongside is done and reported
        (peer/round/loss_gate.py judges a group's step with it).

        Raises:
            ValueError: no evaluation copy (a pipelined peer), or ``phi`` does not fit the model.
        """
        if self.eval_model is None:
            raise ValueError("a pipelined peer has no evaluation copy of the model")
        self.finish_eval()
        return phi_loss(self.eval_model, windows, phi)

    def initial_phi_loss(self) -> float:
        """The validation loss of the run's initial φ (φ_0: the model every peer builds from the run's
        ``init_seed``), in nats per token; built and evaluated once, on the host, then remembered.

        Raises:
            ValueError: no evaluation copy (a pipelined peer).
        """
        if self._initial_loss is None:
            phi_0 = [p.detach() for p in build_model(self.state.m.model, self.tokenizer).parameters()]
            self._initial_loss = self.phi_loss(phi_0)
        return self._initial_loss

    def measured_phi(self) -> tuple[str, float] | None:
        """(digest of the state snapshot, validation loss in nats/token) of the last evaluation of φ
        when that φ is the current snapshot's, else None: a checkpoint keeps it, and a restart from that
        checkpoint reports it instead of evaluating the same φ again (peer/round/checkpointing.py)."""
        loss = self.last_eval[1]
        digest = self._phi_digest()
        if loss is None or digest is None or digest != self.last_eval_digest:
            return None
        return digest, loss

    def _phi_digest(self) -> str | None:
        """The digest of the last snapshot when φ is that snapshot's tensors (the same objects), else None."""
        with self.state.lock:
            return self._phi_digest_locked()

    def _phi_digest_locked(self) -> str | None:
        s = self.state
        if not s.snapshots or not all(a is b for a, b in zip(s.snapshots[-1].tensors, s.phi)):
            return None
        return s.digest

    def _load_phi(self, model: torch.nn.Module) -> tuple[int, str | None]:
        """Copy φ into ``model`` (the evaluation copy) under the state's lock; the round φ is of, and
        its snapshot's digest (:meth:`_phi_digest`)."""
        s = self.state
        with s.lock, torch.no_grad():
            for p, f in zip(model.parameters(), s.phi):
                p.copy_(f)
            return s.pos.round, self._phi_digest_locked()

    def _report(self, when: str, round_: int, loss: float, digest: str | None = None) -> None:
        """Keep an evaluation of φ of ``round_`` (of the snapshot ``digest``, when known) for the
        records and :meth:`measured_phi`, publish, emit its ``eval`` event."""
        self.last_eval, self.last_eval_digest = (round_, loss), digest
        self.publish()
        self.reporter.emit(
            "eval",
            when=when,
            round=round_,
            loss=loss,
            peer_id=self.peer_id,
            bpb=validation_bits_per_byte(loss, self.val_windows, self.tokenizer),
        )

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
