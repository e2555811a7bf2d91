"""In-process transport: N simulated peers in one process, running the swarm's algorithm code.

Each simulated peer owns a model replica (identical φ_0), its own AdamW state and its own data
shard, exactly like a networked peer. Rounds call the same functions the trainer calls
(:class:`peer.train.inner.InnerLoop`, :func:`peer.train.outer.pseudo_gradient`, :func:`peer.train.outer.make_outer`
and :func:`protocol.groups.plan_groups`); only the group mean is computed here, in fp32, instead
of by an all-reduce. With a lossy ``[compression]`` codec each peer's contribution goes through
the network's codec code (:mod:`protocol.codecs`, :mod:`peer.sync.adaptive`): error-compensated,
encoded, decoded, then averaged in fp32, and the mean is encoded once more for the groupmates.
With ``sync.overlap`` the outer steps follow peer/train/overlap.py, as a peer's round loop does: a
round's means land one round late; ``"streaming"`` (Streaming DiLoCo, peer/train/streaming.py, as
the round loop runs it) syncs one fragment of the model at a time at staggered inner steps, each
mean landing ``sync.fragment_delay_steps`` steps after its sync started
(:meth:`Simulation._streaming_round`). The owners of the mean's pieces screen the contributions as
the networked owners do (peer/sync/screening.py: token cap, clip to the median norm, repeat
offenders ignored; non-finite ones excluded), and every receiver checks each mean an owner sends it
against its own contribution (``owner_mean_problem``: a refused Δ mean is applied as zeros, a
refused φ mean as the receiver's own φ), which a switch turns off; malicious peers
(lab/adversary.py) forge their contributions, their means as owners or their progress records. The
data-parallel ceiling the low-communication methods are compared against at equal tokens, which has
no round, is lab/data_parallel.py.

The simulation is split by what each part computes: :mod:`lab.sim_results` holds what a run
reports (:class:`EvalPoint`, :class:`SimulationResult`, the byte and loss arithmetic),
:mod:`lab.sim_mean` the owners' screened and compressed group mean (:class:`~lab.sim_mean.GroupMeans`),
:mod:`lab.sim_streaming` Streaming DiLoCo's fragment syncs (:class:`~lab.sim_streaming.StreamingRounds`),
and this module the rounds, their outer steps and the evaluation. The two mixins share the
:class:`Simulation`'s state (each names the attributes it reads); the adversary's fake-progress
round lives in lab/adversary.py.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from lab.adversary import Adversary, resync_after_round
from lab.data_parallel import peer_samplers
from lab.sim_mean import GroupMeans
from lab.sim_results import (
    FP32_BYTES,
    EvalPoint,
    ScreeningCounts,
    SimulationResult,
    bits_per_byte,
    butterfly_bytes,
    sync_groups,
    weight_spread,
    weighted_mean,
)
from lab.sim_streaming import StreamingRounds
from peer.state.vouching import Ledger
from peer.train.data import Corpus, validation_batch, validation_bits_per_byte
from peer.train.inner import InnerLoop
from peer.train.model import build_model, evaluate, parameter_count
from peer.train.outer import make_outer
from peer.train.overlap import EagerState, drain, next_start, round_progress
from peer.train.precision import FP32, Precision
from protocol.manifest import RunManifest

__all__ = [
    "FP32_BYTES",
    "METHODS",
    "EvalPoint",
    "ScreeningCounts",
    "Simulation",
    "SimulationResult",
    "bits_per_byte",
    "butterfly_bytes",
    "run_simulation",
    "sync_groups",
    "weight_spread",
    "weighted_mean",
]

logger = logging.getLogger(__name__)

METHODS = ("diloco", "noloco", "independent")


class Simulation(StreamingRounds, GroupMeans):
    """N peers of one run in this process (the data-parallel ceiling: lab/data_parallel.py).

    Args:
        manifest: the run; ``sync.algorithm`` picks the outer algorithm, ``inner_optimizer``
            the AdamW and its schedule, ``batch_size_tokens`` the per-peer batch.
        corpus: the loaded corpus; each peer samples ``corpus.train`` with its own seed.
        peers: N, the number of simulated peers.
        seed: salts the data shards: peer i samples with ``peer_seed(f"sim-peer-{i}", seed)``.
        uplink_mbps: every simulated peer's uplink, Mbit/s (the adaptive codec's byte budget).
        screening: the defenses of issue 17 as the swarm runs them: owners screen each contribution
            (token cap, clip to the median norm, repeat offenders ignored; :meth:`_group_mean`),
            every honest receiver checks the means owners send it (:meth:`_receive`), and
            a re-sync counts only vouched-for records and checks the state's sanity
            (lab/adversary.py :func:`~lab.adversary.resync_after_round`).
            False: the plain token-weighted mean of every finite contribution, every finite mean
            accepted, every record counts and any finite state is adopted (what peers did before
            issue 17).
        adversary: malicious peers (lab/adversary.py), or None. Their payloads and claimed weights
            are forged before they enter the group mean, or (owner attacks) the means of the pieces
            they own are forged before they reach the receivers; evaluation covers the honest
            peers only.
        device: where the replicas θ train (InnerLoop's device: one CUDA card holds all N). φ, the
            outer states, Δ and the group means stay fp32 on the host, as a networked peer keeps them
            (peer/train/device.py); θ is copied to the host for Δ and the round's start copied back.
        precision: the inner loop's autocast (peer/train/precision.py), e.g. bf16 on a CUDA card.
        compile: each replica's forward and loss through torch.compile (InnerLoop's ``compile``; the
            replicas share one class and shapes, so one graph serves them all).
        groups_run_id: the run id NoLoCo's random groups are drawn from, for the whole run
            (default: the manifest's at the start). Every manifest field changes the run id, so
            runs that should differ in one setting alone (bench/overlap.py's overlap modes) pass
            the same one to draw the same groups.

    Raises:
        ValueError: ``peers`` < 1, an adversary outside the peers, or an
            adversary on a device other than the CPU (its fake-progress round reads θ in place).
    """

    def __init__(
        self,
        manifest: RunManifest,
        corpus: Corpus,
        *,
        peers: int,
        seed: int = 0,
        uplink_mbps: float = 50.0,
        screening: bool = True,
        adversary: Adversary | None = None,
        device: torch.device | str = "cpu",
        precision: Precision = FP32,
        compile: bool = False,
        groups_run_id: str | None = None,
    ):
        if peers < 1:
            raise ValueError(f"peers = {peers}: need at least one")
        self.device = torch.device(device)
        if adversary is not None and self.device.type != "cpu":
            raise ValueError(f"an adversary with device {str(self.device)!r}: the adversary runs on the CPU only")
        if adversary is not None and max(adversary.peers) >= peers:
            raise ValueError(f"adversary peers {adversary.peers} with {peers} peers: need peer indices below N")
        self.groups_run_id = groups_run_id or manifest.run_id
        """What NoLoCo's groups are drawn from (fixed at the start: :meth:`start_overlap` changes ``m``)."""
        self._overlap_later: tuple[int, str] | None = None
        """(K, mode) with ``sync.overlap_from_round`` K > 0: the run syncs without overlap until
        :meth:`run_round` starts round K (0-based) with :meth:`start_overlap`, as a peer does."""
        if manifest.sync.overlap_from_round:
            self._overlap_later = (manifest.sync.overlap_from_round, manifest.sync.overlap)
            manifest = manifest.replace(sync={"overlap": "none", "overlap_from_round": 0})
        self._setup_screening(manifest, peers=peers, seed=seed, screening=screening, adversary=adversary)
        self.taken_over: dict[int, list[int]] = {}
        self.completed_with = [[i] for i in range(peers)]
        """Per peer, the members of its last group that completed the sync with it in full (itself included)."""
        self.ledgers = [Ledger() for _ in range(peers)]
        """Per peer, the groupmates it completed a sync with in full (peer/state/vouching.py)."""
        self.m, self.peers, self.seed = manifest, peers, seed
        self.uplink_mbps = uplink_mbps
        self.method = manifest.sync.algorithm
        self.round_ = self.inner_step = self.tokens = 0
        self.bytes_sent = [0.0] * peers
        samplers = peer_samplers(manifest, corpus, peers, seed)
        self.tokenizer = corpus.tokenizer
        base = build_model(manifest.model, corpus.tokenizer).to(self.device)
        self.parameters = parameter_count(base)
        self._eval_model = copy.deepcopy(base)
        spec = manifest.inner_optimizer
        self.models = [base] + [copy.deepcopy(base) for _ in range(peers - 1)]
        self.inners = [
            InnerLoop(m, spec, s, device=self.device, precision=precision, compile=compile)
            for m, s in zip(self.models, samplers)
        ]
        shapes = [p.shape for p in base.parameters()]
        self.outers = [make_outer(manifest, shapes) for _ in range(peers)]
        self.phis = [[p.detach().to("cpu", torch.float32, copy=True) for p in m.parameters()] for m in self.models]
        self._setup_codecs(shapes)
        self.streaming = manifest.sync.overlap == "streaming"
        if self.streaming:
            self._setup_streaming([name for name, _ in base.named_parameters()])
        self.anchors: list[list[torch.Tensor]] = []
        """ψ: where each peer's current round started (φ without overlap; peer/train/overlap.py)."""
        self._anchor_at_phi()
        self.pending: list[list[torch.Tensor]] | None = None
        """With overlap: each peer's group mean of the last round, applied at the end of this one."""
        self.eager = [EagerState() for _ in range(peers)]
        """Eager with outer momentum: each peer's own part of its outer state (peer/train/overlap.py)."""

    def _theta(self, i: int, index: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Peer i's θ (its tensors ``index``, default all) as fp32 host tensors for Δ: the parameters
        themselves on the CPU, copies from a card (as the trainer's ``_theta_on_host``)."""
        params = list(self.models[i].parameters())
        return [params[k].detach().to("cpu", torch.float32) for k in (range(len(params)) if index is None else index)]

    def run_round(self) -> None:
        """One round: H inner steps per peer, then the outer step of every group.

        Implements DiLoCo (arXiv 2311.08105, Algorithm 1) or NoLoCo (arXiv 2506.10911, Eqs. 1-3)
        through the trainer's own outer objects: Δ_i = φ_i − θ_i, the token-weighted group mean
        of each peer's payload, ``apply`` on φ_i, then θ_i ← φ_i. Data-parallel: H AdamW steps
        on the N peers' batches together, an all-reduce of the P gradients per step. Streaming:
        :meth:`_streaming_round`.
        """
        if self._overlap_later is not None and self.round_ == self._overlap_later[0]:
            self.start_overlap(self._overlap_later[1])  # sync.overlap_from_round: this round overlaps
            self._overlap_later = None
        if self.streaming:
            self._streaming_round()
            return
        H = self.m.sync.inner_steps
        round_tokens = [0] * len(self.inners)
        # queued without waiting (fused AdamW on a card): the host queues every peer's steps back to
        # back and the card never idles between them; settled, and checked, before the outer step
        for i, inner in enumerate(self.inners):
            for k in range(H):
                round_tokens[i] += inner.step(self.inner_step + k, wait=False).tokens
        for inner in self.inners:
            inner.settle()
        self.inner_step += H
        self.tokens += sum(round_tokens)
        self._outer_step(round_tokens)
        self.round_ += 1
        if self.adversary is not None and self.adversary.attack == "fake-progress":
            resync_after_round(self)

    def _outer_step(self, round_tokens: Sequence[int]) -> None:
        """The groups' means and outer steps; with ``sync.overlap`` the rules of peer/train/overlap.py:
        last round's means land now, this round's are held back a round (their sync "runs" while the
        next round trains), and each peer starts the next round from :func:`next_start`."""
        mode = self.m.sync.overlap
        anchors = self.phis if mode == "none" else self.anchors
        deltas = [round_progress(anchor, self._theta(i)) for i, anchor in enumerate(anchors)]
        if self.pending is not None:  # round t−1's means, "synced" while round t trained
            for outer, phi, mean in zip(self.outers, self.phis, self.pending):
                outer.apply(phi, mean)
            self.pending = None
        payloads = [outer.payload(phi, delta) for outer, phi, delta in zip(self.outers, self.phis, deltas)]
        sent_payloads, claimed = self._contributions(payloads, round_tokens)
        means: list[list[torch.Tensor]] = [[] for _ in range(self.peers)]
        shares = [1.0] * self.peers
        for group in sync_groups(self.m, self.peers, self.round_, run_id=self.groups_run_id):
            weights = [claimed[j] for j in group]
            own = [payloads[j] for j in group]
            received: list[list[torch.Tensor]] | None
            if len(group) == 1:
                received, sent = [payloads[group[0]]], 0.0  # nothing crosses the network: the own Δ, exact
            elif self.compressed:
                final, sent = self._compressed_mean(group, [sent_payloads[j] for j in group], weights)
                received = (
                    None
                    if final is None
                    else self._receive(group, self._honest_final, final, self._decoded, weights, own)
                )
            else:
                contributions = [sent_payloads[j] for j in group]
                mean = self._group_mean(group, contributions, weights)
                forged = None if mean is None else self._owners_send(group, mean)
                received = None if forged is None else self._receive(group, mean, forged, contributions, weights, own)
                sent = butterfly_bytes(sum(t.numel() for t in payloads[group[0]]), len(group))
            # completed in full: no member failed, none excluded (peer/round/syncing.py ``GroupSync.sync``: ``completed``)
            full = len(group) > 1 and received is not None and not self._excluded_any
            for member, j in enumerate(group):
                # a failed all-reduce: every member applies its own payload (peer/round/syncing.py ``GroupSync.sync``)
                means[j], shares[j] = (payloads[j] if received is None else received[member]), 1.0 / len(group)
                self.completed_with[j] = list(group) if full else [j]
                if full:
                    self.ledgers[j].record_group(self.round_, [f"sim-peer-{k}" for k in group if k != j])
                self.bytes_sent[j] += sent
        if mode == "none":
            for outer, phi, mean in zip(self.outers, self.phis, means):
                outer.apply(phi, mean)
            starts = self.phis
        else:
            self.pending = means
            starts = [
                next_start(mode, outer, phi, delta, payload, share=share, eager=eager)
                for outer, phi, delta, payload, share, eager in zip(
                    self.outers, self.phis, deltas, payloads, shares, self.eager
                )
            ]
            self.anchors = starts
        with torch.no_grad():
            for model, start in zip(self.models, starts):
                for t, p in zip(model.parameters(), start):
                    t.copy_(p)

    def _anchor_at_phi(self) -> None:
        """Every peer's next round starts from its own φ: ψ_i ← copies of φ_i."""
        self.anchors = [[p.clone() for p in phi] for phi in self.phis]

    def start_overlap(self, mode: str) -> None:
        """Switch a run without overlap to ``mode`` ('delayed' or 'eager') from the next round on:
        that round starts from φ (ψ = φ, as every round without overlap does) and its sync is the
        first that lands a round late. :meth:`run_round` calls it at round
        ``sync.overlap_from_round`` (bench/overlap.py ``--from-round``).

        Raises:
            ValueError: ``mode`` is not 'delayed' or 'eager', the run already overlaps, streams, or
                nothing changed.
        """
        if mode not in ("delayed", "eager"):
            raise ValueError(f"start_overlap({mode!r}): only 'delayed' or 'eager' can start mid-run")
        if self.streaming or self.m.sync.overlap != "none":
            raise ValueError(
                f"start_overlap({mode!r}) needs a DiLoCo or NoLoCo run without overlap "
                f"(this one: overlap {self.m.sync.overlap!r})"
            )
        self.m = self.m.replace(sync={"overlap": mode})
        self._anchor_at_phi()

    def finish(self) -> None:
        """With overlap, wait for the last round's sync: apply its means and set θ ← φ (no-op
        without one), so the final φ holds every round, as a peer's does when training ends.

        Streaming: the syncs in flight land, then every fragment with inner steps since its last
        sync (all but fragment 0 at a round's end) syncs once more and lands at once, so the final
        φ holds every step, as φ does without overlap; then θ ← φ."""
        if self.streaming:
            self._finish_streaming()
            return
        if self.pending is None:
            return
        for outer, phi, mean in zip(self.outers, self.phis, self.pending):
            drain(outer, phi, mean)
        self.pending = None
        for eager in self.eager:
            eager.reset()  # θ ← φ below: a worker that starts from φ
        self._anchor_at_phi()
        with torch.no_grad():
            for model, phi in zip(self.models, self.phis):
                for t, p in zip(model.parameters(), phi):
                    t.copy_(p)

    def evaluate(self, windows: torch.Tensor) -> EvalPoint:
        """Validation losses of the current φ's on ``windows`` (int64, (sequences, seq_len + 1)).

        NoLoCo and independent: each replica's own loss and σ are computed (N evaluations). Losses
        in bits per UTF-8 byte of the targets (peer.train.data.validation_bits_per_byte), so runs
        with different tokenizers compare.
        """

        def bits_per_byte(nats: float) -> float:
            return validation_bits_per_byte(nats, windows, self.tokenizer)

        phis = [self.phis[i] for i in self.honest]
        with torch.no_grad():
            for p, mean in zip(self._eval_model.parameters(), weighted_mean(phis, [1.0] * len(phis))):
                p.copy_(mean)
        averaged = bits_per_byte(evaluate(self._eval_model, windows))
        if self.adversary is not None:  # each honest peer's own loss: a takeover may split them
            per_peer = self._honest_losses(windows, bits_per_byte)
            mean_loss = sum(per_peer) / len(per_peer)
            return EvalPoint(self.round_, self.tokens, mean_loss, averaged, mean_loss, weight_spread(phis), per_peer)
        replica_mean = None
        if self.outers[0].replicas_differ:  # each replica's φ: with overlap or streaming θ is not φ
            replica_mean = sum(self._honest_losses(windows, bits_per_byte)) / self.peers
        return EvalPoint(
            self.round_,
            self.tokens,
            replica_mean if replica_mean is not None else averaged,
            averaged,
            replica_mean,
            weight_spread(self.phis),
        )

    def _honest_losses(self, windows: torch.Tensor, to_bpb) -> list[float]:
        """Each honest peer's loss on ``windows`` (``to_bpb`` of the nats), one evaluation per distinct
        φ; a φ that is not finite scores inf."""
        seen: list[tuple[list[torch.Tensor], float]] = []
        out = []
        for i in self.honest:
            phi = self.phis[i]
            loss = next((known for other, known in seen if all(torch.equal(a, b) for a, b in zip(phi, other))), None)
            if loss is None:
                if all(bool(torch.isfinite(p).all()) for p in phi):
                    with torch.no_grad():
                        for p, src in zip(self._eval_model.parameters(), phi):
                            p.copy_(src)
                    loss = to_bpb(evaluate(self._eval_model, windows))
                else:
                    loss = math.inf
                loss = loss if math.isfinite(loss) else math.inf
                seen.append((phi, loss))
            out.append(loss)
        return out


def run_simulation(
    manifest: RunManifest,
    corpus: Corpus,
    *,
    peers: int,
    rounds: int,
    seed: int = 0,
    eval_every_rounds: int = 1,
    uplink_mbps: float = 50.0,
    screening: bool = True,
    adversary: Adversary | None = None,
    device: torch.device | str = "cpu",
    precision: Precision = FP32,
    compile: bool = False,
    on_eval: Callable[[EvalPoint], None] | None = None,
    groups_run_id: str | None = None,
) -> SimulationResult:
    """Train ``rounds`` rounds of N simulated peers and evaluate every ``eval_every_rounds``
    (``screening``, ``adversary``, ``device``, ``precision``, ``compile`` and ``groups_run_id``: see
    :class:`Simulation`).
    ``on_eval`` is called with each evaluation as it is made (round 0 included), so a caller can keep
    the curve of a run that is stopped before it returns. With ``sync.overlap_from_round`` K > 0
    the first K rounds run without overlap and ``sync.overlap`` ('delayed' or 'eager') from the
    next on (:meth:`Simulation.run_round`).

    Returns:
        SimulationResult with the loss curve (round 0 and the last round always included), the
        mean bytes sent per peer and the wall time in seconds (evaluation included).
    """
    start = time.perf_counter()
    windows = validation_batch(corpus, manifest.data)
    sim = Simulation(
        manifest,
        corpus,
        peers=peers,
        seed=seed,
        uplink_mbps=uplink_mbps,
        screening=screening,
        adversary=adversary,
        device=device,
        precision=precision,
        compile=compile,
        groups_run_id=groups_run_id,
    )
    history = [sim.evaluate(windows)]
    if on_eval is not None:
        on_eval(history[-1])
    for r in range(1, rounds + 1):
        sim.run_round()
        if r == rounds:
            sim.finish()  # overlap: the last round's sync lands before the final evaluation
        if r % max(1, eval_every_rounds) == 0 or r == rounds:
            history.append(sim.evaluate(windows))
            h = history[-1]
            if on_eval is not None:
                on_eval(h)
            logger.info(
                "%s N=%d seed %d | round %d | val %.4f bpb | σ %.2e | %.1f MiB sent per peer",
                sim.method,
                peers,
                seed,
                r,
                h.loss_bpb,
                h.sigma,
                sum(sim.bytes_sent) / peers / 2**20,
            )
    return SimulationResult(
        method=sim.method,
        peers=peers,
        seed=seed,
        rounds=rounds,
        inner_steps=manifest.sync.inner_steps,
        parameters=sim.parameters,
        bytes_sent_per_peer=sum(sim.bytes_sent) / peers,
        wall_s=time.perf_counter() - start,
        history=history,
        screening=asdict(sim.counts),
        taken_over=dict(sim.taken_over),
    )
