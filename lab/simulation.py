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
(lab/adversary.py) forge their contributions, their means as owners or their progress records. A data-parallel mode (one model, gradients averaged every inner step) gives
the ceiling that low-communication methods are compared against at equal tokens.

Over 600 lines: one simulated round (inner steps, screened and compressed group means as the
network computes them, outer steps, or streaming's fragment syncs between inner steps) and its
evaluation share the Simulation's state; split, each half would reach into the other's. The
adversary's fake-progress round lives in lab/adversary.py.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from lab.adversary import Adversary, resync_after_round
from peer.state.vouching import Ledger
from peer.sync.adaptive import plan
from peer.sync.error_feedback import ErrorFeedback
from peer.sync.screening import Strikes, cap_weight, clip_to_median, owner_mean_problem, round_token_cap
from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch, validation_bits_per_byte
from peer.train.inner import InnerLoop
from peer.train.model import build_model, evaluate, parameter_count
from peer.train.outer import make_outer
from peer.train.precision import FP32, Precision
from peer.train.overlap import EagerState, drain, next_start, round_progress
from peer.train.streaming import land, landing_at, partition, payload_indices, syncing_at
from protocol.codecs import Codec, make_codec
from protocol.manifest import RunManifest
from protocol.groups import codec_seed, plan_groups

logger = logging.getLogger(__name__)

FP32_BYTES = 4
METHODS = ("data-parallel", "diloco", "noloco", "independent")


def bits_per_byte(nats_per_token: float) -> float:
    """Loss in bits per token when tokens are bytes: nats/token / ln 2 (for any tokenizer the
    simulation reports :func:`peer.train.data.validation_bits_per_byte`)."""
    return nats_per_token / math.log(2)


def butterfly_bytes(payload_elements: int, group_size: int) -> float:
    """Bytes one peer sends in a butterfly all-reduce of an fp32 payload over ``group_size`` peers.

    Each peer sends its (n−1) foreign parts once (reduce-scatter) and its averaged part to the
    n−1 others (all-gather): 2·(n−1)/n × 4 bytes × ``payload_elements``. Zero for a group of one.
    """
    if group_size < 1 or payload_elements < 0:
        raise ValueError(f"group_size = {group_size}, payload_elements = {payload_elements}: need >= 1 and >= 0")
    return 2.0 * (group_size - 1) / group_size * FP32_BYTES * payload_elements


def weighted_mean(payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Weighted mean of several peers' payloads, accumulated in fp32.

    Args:
        payloads: one list of tensors per peer, all with the same shapes.
        weights: one positive weight per peer (tokens processed in the round).

    Returns:
        New fp32 tensors shaped like ``payloads[0]``: Σ_j w_j·x_j / Σ_j w_j.
    """
    total = float(sum(weights))
    if len(payloads) != len(weights) or not payloads or total <= 0:
        raise ValueError(f"{len(payloads)} payloads with weights {list(weights)}: need as many positive weights")
    out = [torch.zeros(t.shape, dtype=torch.float32) for t in payloads[0]]
    for payload, weight in zip(payloads, weights):
        for acc, t in zip(out, payload, strict=True):
            acc.add_(t.detach().float(), alpha=float(weight) / total)
    return out


def weight_spread(replicas: Sequence[Sequence[torch.Tensor]]) -> float:
    """NoLoCo's spread σ = sqrt(Σ_i ‖φ_i − φ̄‖² / (N·P)) (arXiv 2506.10911; ALGORITHMS.md §2).

    Args:
        replicas: N lists of parameter tensors (same shapes); P is their total element count.

    Returns:
        σ in the parameters' units (an RMS distance per parameter); 0 for identical replicas.
    """
    # fp64 throughout: the mean of identical fp32 replicas is then exact and σ exactly 0.
    mean = [sum(r[k].detach().double() for r in replicas) / len(replicas) for k in range(len(replicas[0]))]
    params = sum(t.numel() for t in mean)
    squares = sum(float(((t.detach().double() - m) ** 2).sum())
                  for replica in replicas for t, m in zip(replica, mean, strict=True))
    return math.sqrt(squares / (len(replicas) * params))


def sync_groups(manifest: RunManifest, peers: int, round_: int, *, run_id: str | None = None) -> list[list[int]]:
    """Indices of the peers that average together in round ``round_``.

    The swarm's own group plan (:func:`protocol.groups.plan_groups`) for the peer names
    ``sim-peer-{i}``, as every networked peer would draw it: DiLoCo one group of all peers,
    NoLoCo random groups (drawn from ``run_id``, default the manifest's), independent groups of one.
    """
    index = {f"sim-peer-{i}": i for i in range(peers)}
    groups = plan_groups(list(index), algorithm=manifest.sync.algorithm, run_id=run_id or manifest.run_id,
                         round_=round_, group_size=manifest.noloco.group_size)
    return [sorted(index[name] for name in group) for group in groups]


@dataclass
class EvalPoint:
    """Validation losses after ``round_`` rounds, in bits per byte."""

    round_: int
    tokens: int
    """Training tokens processed so far by all peers together."""
    loss_bpb: float
    """The headline loss: the one model (data-parallel, DiLoCo) or the replica mean (NoLoCo, independent)."""
    averaged_bpb: float
    """Loss of the replicas' averaged weights φ̄ (the one model for data-parallel)."""
    replica_mean_bpb: float | None
    """Mean over replicas of each replica's own loss; None where all replicas are one model."""
    sigma: float
    """Weight spread σ of the replicas' φ (0 for data-parallel)."""
    per_peer_bpb: list[float] | None = None
    """With an adversary: each honest peer's own loss (peer order); the headline is their mean."""


@dataclass
class ScreeningCounts:
    """What the owners' screening did in a simulated run (peer/sync/screening.py), per sender index."""

    clipped: dict[int, int] = field(default_factory=dict)
    """Contributions clipped to the median rule (one count per owner, tensor and round)."""
    dropped: dict[int, int] = field(default_factory=dict)
    """Contributions excluded as non-finite (one count per owner and round)."""
    ignored: dict[int, int] = field(default_factory=dict)
    """(owner, round) pairs in which an owner left the sender out by the repeat-offender rule."""
    refused: dict[int, int] = field(default_factory=dict)
    """Means an honest receiver refused (``owner_mean_problem``), per *owner* index: one count per
    receiver, tensor and round."""
    failed_groups: int = 0
    """Group rounds whose mean was not finite: every member applied its own payload instead."""
    rule_chose_fake: int = 0
    """fake-progress: (honest peer, round) decisions in which the re-sync rule picked the fake class."""
    refused_states: int = 0
    """fake-progress: states the rule picked but the download's sanity check refused (nothing adopted)."""


@dataclass
class SimulationResult:
    """One simulated run: its loss curve, bytes sent and wall time."""

    method: str
    peers: int
    seed: int
    rounds: int
    inner_steps: int
    parameters: int
    bytes_sent_per_peer: float
    """Mean over peers of the bytes each sent: :func:`butterfly_bytes` of the fp32 payload, or with a
    codec (n−1)/n × (its encoded contribution + the encoded group mean)."""
    wall_s: float
    history: list[EvalPoint] = field(default_factory=list)
    screening: dict = field(default_factory=dict)
    """:class:`ScreeningCounts` as a dict (empty for data-parallel)."""
    taken_over: dict = field(default_factory=dict)
    """fake-progress: honest peer index → the rounds in which it adopted the attacker's state."""

    def to_dict(self) -> dict:
        return asdict(self)


class _ConcatSampler:
    """All peers' samplers as one: a batch is the concatenation of each peer's next batch."""

    def __init__(self, samplers: Sequence[BatchSampler]):
        self.samplers = list(samplers)

    def next_batch(self) -> torch.Tensor:
        return torch.cat([s.next_batch() for s in self.samplers])


class Simulation:
    """N peers of one run in this process; ``data_parallel=True`` makes it the ceiling instead.

    Args:
        manifest: the run; ``sync.algorithm`` picks the outer algorithm, ``inner_optimizer``
            the AdamW and its schedule, ``batch_size_tokens`` the per-peer batch.
        corpus: the loaded corpus; each peer samples ``corpus.train`` with its own seed.
        peers: N, the number of simulated peers.
        seed: salts the data shards: peer i samples with ``peer_seed(f"sim-peer-{i}", seed)``.
        data_parallel: one model, each step on the concatenation of the N peers' batches (mean
            loss, hence averaged gradients), same AdamW and schedule.
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
        ValueError: ``peers`` < 1, an adversary outside the peers or with data-parallel, or an
            adversary on a device other than the CPU (its fake-progress round reads θ in place).
    """

    def __init__(self, manifest: RunManifest, corpus: Corpus, *, peers: int, seed: int = 0,
                 data_parallel: bool = False, uplink_mbps: float = 50.0, screening: bool = True,
                 adversary: Adversary | None = None, device: torch.device | str = "cpu",
                 precision: Precision = FP32, compile: bool = False, groups_run_id: str | None = None):
        if peers < 1:
            raise ValueError(f"peers = {peers}: need at least one")
        self.device = torch.device(device)
        if adversary is not None and self.device.type != "cpu":
            raise ValueError(f"an adversary with device {str(self.device)!r}: the adversary runs on the CPU only")
        if adversary is not None and (data_parallel or max(adversary.peers) >= peers):
            raise ValueError(f"adversary peers {adversary.peers} with {peers} peers, data_parallel = {data_parallel}: "
                             "need peer indices below N and the low-communication mode")
        self.screening, self.adversary = screening, adversary
        self.groups_run_id = groups_run_id or manifest.run_id
        """What NoLoCo's groups are drawn from (fixed at the start: :meth:`start_overlap` changes ``m``)."""
        self._overlap_later: tuple[int, str] | None = None
        """(K, mode) with ``sync.overlap_from_round`` K > 0: the run syncs without overlap until
        :meth:`run_round` starts round K (0-based) with :meth:`start_overlap`, as a peer does."""
        if manifest.sync.overlap_from_round and not data_parallel:
            self._overlap_later = (manifest.sync.overlap_from_round, manifest.sync.overlap)
            manifest = manifest.replace(sync={"overlap": "none", "overlap_from_round": 0})
        self.max_weight = round_token_cap(manifest) if screening else None
        self.strikes = [Strikes() for _ in range(peers)]
        """Per peer, as an owner: the groupmates it ignores (peer/sync/averager.py keeps one per peer)."""
        self.counts = ScreeningCounts()
        self.honest = [i for i in range(peers) if adversary is None or i not in adversary.peers]
        self.taken_over: dict[int, list[int]] = {}
        self._forge_rng = torch.Generator().manual_seed(1_000_003 * seed + 17)
        self.completed_with = [[i] for i in range(peers)]
        """Per peer, the members of its last group that completed the sync with it in full (itself included)."""
        self.ledgers = [Ledger() for _ in range(peers)]
        """Per peer, the groupmates it completed a sync with in full (peer/state/vouching.py)."""
        self._excluded_any = False
        self._included: list[list[int]] = []
        """Per tensor of the last :meth:`_group_mean`: the members whose contributions its owner included."""
        self._decoded: list[list[torch.Tensor]] = []
        self._honest_final: list[torch.Tensor] = []
        """With a codec, of the last :meth:`_compressed_mean`: the decoded contributions and honest means."""
        self.m, self.peers, self.seed, self.data_parallel = manifest, peers, seed, data_parallel
        self.uplink_mbps = uplink_mbps
        self.method = "data-parallel" if data_parallel else manifest.sync.algorithm
        self.round_ = self.inner_step = self.tokens = 0
        self.bytes_sent = [0.0] * peers
        samplers = [BatchSampler(corpus.train, seq_len=manifest.data.seq_len_tokens,
                                 batch_sequences=manifest.batch_sequences, seed=peer_seed(f"sim-peer-{i}", seed))
                    for i in range(peers)]
        self.tokenizer = corpus.tokenizer
        base = build_model(manifest.model, corpus.tokenizer).to(self.device)
        self.parameters = parameter_count(base)
        self._eval_model = copy.deepcopy(base)
        spec = manifest.inner_optimizer
        if data_parallel:
            self.models = [base]
            self.inners = [InnerLoop(base, spec, _ConcatSampler(samplers), device=self.device, precision=precision,
                                     compile=compile)]
            self.outers, self.phis = [], []
        else:
            self.models = [base] + [copy.deepcopy(base) for _ in range(peers - 1)]
            self.inners = [InnerLoop(m, spec, s, device=self.device, precision=precision, compile=compile)
                           for m, s in zip(self.models, samplers)]
            shapes = [p.shape for p in base.parameters()]
            self.outers = [make_outer(manifest, shapes) for _ in range(peers)]
            self.phis = [[p.detach().to("cpu", torch.float32, copy=True) for p in m.parameters()] for m in self.models]
            self._setup_codecs(shapes)
        self.streaming = not data_parallel and manifest.sync.overlap == "streaming"
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

    def _setup_codecs(self, shapes: Sequence[torch.Size]) -> None:
        """Per payload tensor its codec (None: adaptive, planned each round), per peer its residuals."""
        spec = self.m.compression
        phi_in_payload = self.outers[0].phi_from(len(shapes)) is not None  # NoLoCo: Δ then φ
        self.compressed = spec.codec != "none" or (phi_in_payload and spec.phi_codec != "none")
        self.shapes = list(shapes)
        self.codecs: list[Codec | None] = [None if spec.codec == "adaptive" else make_codec(spec, s) for s in shapes]
        if phi_in_payload:
            self.codecs += [make_codec(spec, s, role="phi") for s in shapes]
        lossy = spec.codec != "none"  # 'adaptive' included: its plan may pick lossy codecs
        self.feedback = [ErrorFeedback(shapes) for _ in range(self.peers)] if lossy and spec.error_feedback else None

    def _setup_streaming(self, names: Sequence[str]) -> None:
        """Streaming DiLoCo's state: the fragments (:func:`~peer.train.streaming.partition` of the
        parameter ``names``), per peer one outer algorithm per fragment (its own slice of the outer
        state), the means in flight and the tokens each peer trained since each fragment's last sync.

        Raises:
            ValueError: an adversary (the fragment syncs run the honest screened mean only, so
                far); or more fragments than blocks.
        """
        if self.adversary is not None:
            raise ValueError("sync.overlap = 'streaming' with an adversary: the simulation streams honest peers "
                             "only so far")
        self.fragments = partition(names, self.m.sync.fragments)
        self.fragment_outers = [[make_outer(self.m, [self.shapes[k] for k in index]) for index in self.fragments]
                                for _ in range(self.peers)]
        self.in_flight: dict[int, list[list[torch.Tensor]]] = {}
        """Fragment → each peer's group mean of its sync in flight (applied at its landing step)."""
        self.at_sync: dict[int, list[list[torch.Tensor]]] = {}
        """Fragment → each peer's θ_p when its sync in flight started (``fragment_merge = "shift"`` only)."""
        self.fragment_tokens = [[0] * self.peers for _ in self.fragments]
        self.last_sync = [0] * len(self.fragments)
        """Per fragment, the inner step (cumulative steps done) at which its last sync started."""

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
        if self.data_parallel:
            per_step = butterfly_bytes(self.parameters, self.peers)
            self.bytes_sent = [b + H * per_step for b in self.bytes_sent]
        else:
            self._outer_step(round_tokens)
        self.round_ += 1
        if self.adversary is not None and self.adversary.attack == "fake-progress":
            resync_after_round(self)

    def _streaming_round(self) -> None:
        """H inner steps per peer, one step at a time, with Streaming DiLoCo's fragment syncs between
        them (arXiv 2501.18512; peer/train/streaming.py): once ``s`` steps are done, the fragments of
        :func:`~peer.train.streaming.syncing_at` start their sync (:meth:`_fragment_sync`) and those
        of :func:`~peer.train.streaming.landing_at` (started τ steps earlier) land
        (:meth:`_fragment_land`); with τ = 0 a sync lands at once. Peers step in turn; each owns its
        model, AdamW state and data, so the order changes nothing."""
        sync = self.m.sync
        H, P, tau = sync.inner_steps, sync.fragments, sync.fragment_delay_steps
        for k in range(H):
            for i, inner in enumerate(self.inners):
                tokens = inner.step(self.inner_step + k).tokens
                self.tokens += tokens
                for counts in self.fragment_tokens:
                    counts[i] += tokens
            done = self.inner_step + k + 1
            for p in syncing_at(done, inner_steps=H, fragments=P):
                self._fragment_sync(p, done)
            for p in landing_at(done, inner_steps=H, fragments=P, delay_steps=tau):
                self._fragment_land(p)
        self.inner_step += H
        self.round_ += 1

    def _fragment_sync(self, p: int, step: int) -> None:
        """Start fragment p's sync on every peer: Δ_p = φ_p − θ_p, each group's token-weighted mean
        as the owners screen it and the receivers check it (:meth:`_group_mean`, :meth:`_receive`,
        as in :meth:`_outer_step`; a failed group applies each member's own Δ_p), held in
        ``in_flight`` until it lands. Bytes: a butterfly all-reduce of the fragment alone."""
        index = self.fragments[p]
        payloads = []
        for i, (outer, phi) in enumerate(zip(self.fragment_outers, self.phis)):
            phi_p = [phi[k] for k in index]
            payloads.append(outer[p].payload(phi_p, round_progress(phi_p, self._theta(i, index))))
        claimed = [float(max(1, t)) for t in self.fragment_tokens[p]]
        self.fragment_tokens[p] = [0] * self.peers
        means: list[list[torch.Tensor]] = [[] for _ in range(self.peers)]
        tensors = payload_indices(index, phi_from=self.outers[0].phi_from(len(self.shapes)))
        for group in sync_groups(self.m, self.peers, self.round_, run_id=self.groups_run_id):
            received: list[list[torch.Tensor]] | None
            if len(group) == 1:
                received, sent = [payloads[group[0]]], 0.0
            else:
                weights = [claimed[j] for j in group]
                contributions = [payloads[j] for j in group]
                if self.compressed:  # the fragment's tensors with their codecs, seeds and residuals
                    final, sent = self._compressed_mean(group, contributions, weights, tensors=tensors)
                    received = None if final is None else self._receive(
                        group, self._honest_final, final, self._decoded, weights, contributions)
                else:
                    mean = self._group_mean(group, contributions, weights)
                    received = None if mean is None else self._receive(
                        group, mean, list(mean), contributions, weights, contributions)
                    sent = butterfly_bytes(sum(t.numel() for t in payloads[group[0]]), len(group))
            for member, j in enumerate(group):
                means[j] = payloads[j] if received is None else received[member]
                self.bytes_sent[j] += sent
        self.in_flight[p] = means
        self.last_sync[p] = step
        if self.m.sync.fragment_merge == "shift":
            self.at_sync[p] = [[t.clone() for t in self._theta(i, index)] for i in range(self.peers)]

    def _fragment_land(self, p: int) -> None:
        """Fragment p's means arrive: φ_p ← OuterOpt_p(φ_p, mean) on every peer (its fragment's
        outer state only), then θ_p by ``sync.fragment_merge`` (:func:`~peer.train.streaming.land`):
        θ_p ← α·θ_p + (1 − α)·φ_p, or with 'shift' θ_p ← θ_p + (1 − α)·(φ_p − θ_p^sync)."""
        index = self.fragments[p]
        at_sync = self.at_sync.pop(p, None) or [None] * self.peers
        for outer, phi, model, mean, start in zip(self.fragment_outers, self.phis, self.models,
                                                  self.in_flight.pop(p), at_sync, strict=True):
            phi_p = [phi[k] for k in index]
            outer[p].apply(phi_p, mean)  # in place on the peer's own φ tensors
            theta = list(model.parameters())
            land([theta[k] for k in index], phi_p, alpha=self.m.sync.fragment_alpha,
                 rule=self.m.sync.fragment_merge, at_sync=start)

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
                received = None if final is None else self._receive(group, self._honest_final, final,
                                                                     self._decoded, weights, own)
            else:
                contributions = [sent_payloads[j] for j in group]
                mean = self._group_mean(group, contributions, weights)
                forged = None if mean is None else self._owners_send(group, mean)
                received = None if forged is None else self._receive(group, mean, forged, contributions, weights, own)
                sent = butterfly_bytes(sum(t.numel() for t in payloads[group[0]]), len(group))
            # completed in full: no member failed, none excluded (peer/round.py ``_sync``: ``completed``)
            full = len(group) > 1 and received is not None and not self._excluded_any
            for member, j in enumerate(group):
                # a failed all-reduce: every member applies its own payload (peer/round.py ``_sync``)
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
            starts = [next_start(mode, outer, phi, delta, payload, share=share, eager=eager)
                      for outer, phi, delta, payload, share, eager
                      in zip(self.outers, self.phis, deltas, payloads, shares, self.eager)]
            self.anchors = starts
        with torch.no_grad():
            for model, start in zip(self.models, starts):
                for t, p in zip(model.parameters(), start):
                    t.copy_(p)

    def _contributions(self, payloads: list[list[torch.Tensor]], round_tokens: Sequence[int],
                       ) -> tuple[list[list[torch.Tensor]], list[float]]:
        """What each peer sends into its group's mean and the token weight it claims: the honest
        payload and tokens, or the adversary's forgery and claim for a malicious peer."""
        claimed = [float(max(1, t)) for t in round_tokens]
        if self.adversary is None or not self.adversary.forges_payload:
            return payloads, claimed
        sent = list(payloads)
        for j in self.adversary.peers:
            sent[j] = self.adversary.forge(payloads[j], self._forge_rng)
            claimed[j] = self.adversary.claimed_weight(j, claimed[j])
        return sent, claimed

    def _group_mean(self, group: Sequence[int], contributions: Sequence[Sequence[torch.Tensor]],
                    weights: Sequence[float]) -> list[torch.Tensor] | None:
        """The group mean as the owners of its pieces compute it in the networked all-reduce.

        Tensor i stands for a piece owned by member ``group[i mod n]`` (as in
        :meth:`_compressed_mean`). Its owner, as peer/sync/allreduce.py does: leaves out the members
        its :class:`~peer.sync.screening.Strikes` ignore this round (never itself) and, for the rest
        of the round, every member whose contribution is not finite; caps each claimed weight at
        the run's tokens per round (:func:`~peer.sync.screening.round_token_cap`); clips the norms
        to the median rule (:func:`~peer.sync.screening.clip_to_median`); sums in fp32 in member
        order, each weighted by its share of the included weight (``GroupAllreduce._mean_of``).
        After the round every owner counts a strike against each member it clipped or dropped
        (peer/sync/averager.py ``_strike``). With ``screening`` off only the non-finite rule
        applies.

        Returns:
            One fp32 tensor per contribution tensor, or None when a mean is not finite (the
            all-reduce fails for the whole group; each member falls back to its own payload).
        """
        n, members = len(group), set(group)
        self._excluded_any = False
        excluded: dict[int, set[int]] = {owner: set() for owner in group}
        offenders: dict[int, set[int]] = {owner: set() for owner in group}
        if self.screening:
            for owner in group:
                ignored = (self.strikes[owner].ignored(self.round_) & members) - {owner}
                excluded[owner] |= ignored
                for s in ignored:
                    self.counts.ignored[s] = self.counts.ignored.get(s, 0) + 1
        mean: list[torch.Tensor] = []
        failed = False
        self._included = []
        for i in range(len(contributions[0])):
            owner = group[i % n]
            parts, senders = [], []
            for j, contribution, weight in zip(group, contributions, weights):
                if j in excluded[owner]:
                    continue
                x = contribution[i].detach().float()
                if not torch.isfinite(x).all():
                    excluded[owner].add(j)
                    if j != owner:  # a sender's BadPayload is a strike; the owner's own is not
                        offenders[owner].add(j)
                        self.counts.dropped[j] = self.counts.dropped.get(j, 0) + 1
                    continue
                parts.append((cap_weight(weight, self.max_weight), x))
                senders.append(j)
            if self.screening and parts:
                parts, clipped = clip_to_median(parts)
                for position in clipped:
                    offenders[owner].add(senders[position])
                    self.counts.clipped[senders[position]] = self.counts.clipped.get(senders[position], 0) + 1
            total = sum(w for w, _ in parts)
            acc = torch.zeros(contributions[0][i].shape, dtype=torch.float32)
            for w, x in parts:
                acc.add_(x, alpha=w / total)
            failed = failed or not parts or not bool(torch.isfinite(acc).all())
            mean.append(acc)
            self._included.append(senders)
        if self.screening:
            for owner in group:
                self.strikes[owner].record(self.round_, sorted(offenders[owner]))
        self._excluded_any = any(excluded.values())
        if failed:
            self.counts.failed_groups += 1
            return None
        return mean

    def _owners_send(self, group: Sequence[int], mean: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The mean of each piece as its owner sends it: the computed ``mean`` from an honest owner,
        the adversary's forgery (:meth:`~lab.adversary.Adversary.forge_mean`) from a malicious one
        under an owner attack. None (the all-reduce fails, counted in ``failed_groups``) when a sent
        mean is not finite, as a receiver's decode check fails the round in peer/sync/allreduce.py."""
        adversary, n = self.adversary, len(group)
        if adversary is None or not adversary.lies_as_owner or not set(group) & set(adversary.peers):
            return list(mean)
        out = [adversary.forge_mean(t, self._forge_rng) if group[i % n] in adversary.peers else t
               for i, t in enumerate(mean)]
        if not all(bool(torch.isfinite(t).all()) for t in out):
            self.counts.failed_groups += 1
            return None
        return out

    def _receive(self, group: Sequence[int], honest: Sequence[torch.Tensor], sent: Sequence[torch.Tensor],
                 contributions: Sequence[Sequence[torch.Tensor]], weights: Sequence[float],
                 own: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """What each member applies: per member (group order) one tensor per piece (the whole
        payload's or a streaming fragment's).

        Every honest member j checks the mean ``sent[i]`` of each piece it does not own against its
        own contribution ``contributions[j][i]`` (as the owner decoded it) with
        :func:`~peer.sync.screening.owner_mean_problem` (its claimed weight, the count of
        contributions the owner included and whether its own was among them, the run's cap; φ
        pieces of NoLoCo get the norm and direction checks instead of the share check), as
        peer/sync/allreduce.py does. A refused Δ mean is applied as zeros (every honest
        receiver that refuses it applies the same thing), a refused φ mean as the member's own
        payload ``own[j][i]``; each refusal is counted against the owner, and one by a check that
        counts a strike (``MeanRefusal.strike``) is recorded in the member's :class:`Strikes`, as
        the networked averager does, so repeated ones make it ignore that peer's contributions.
        Refusals are per receiver: under a gradient attack strong enough that an honest owner's
        mean fails some receivers' share check, the honest φ differ after the round (the re-sync
        rule then reunites them, as in the swarm). Only with ``screening``:
        off, every finite mean is applied. Malicious members apply the ``honest`` means (they know
        what their owners computed).
        """
        n = len(group)
        # k parameters' payload: k Δ tensors, then (NoLoCo) k φ tensors; phi_from(k) is k or None
        phi_from = self.outers[0].phi_from(len(sent) // 2)
        out = []
        for member, j in enumerate(group):
            if j not in self.honest:
                out.append(list(honest))
                continue
            if not self.screening:
                out.append(list(sent))
                continue
            mine = []
            for i, m in enumerate(sent):
                owner = group[i % n]
                holds_delta = phi_from is None or i < phi_from
                reason = None if owner == j else owner_mean_problem(
                    m, contributions[member][i].detach().float(), weight=weights[member],
                    included=len(self._included[i]), max_weight=self.max_weight, phi=not holds_delta,
                    included_self=j in self._included[i])
                if reason is None:
                    mine.append(m)
                    continue
                self.counts.refused[owner] = self.counts.refused.get(owner, 0) + 1
                if reason.strike:  # as peer/sync/averager.py's _strike: toward ignoring the owner's contributions
                    for ignored in self.strikes[j].record(self.round_, [owner]):
                        logger.debug("round %d: peer %d ignores peer %d (refused means)", self.round_, j, ignored)
                logger.debug("round %d: peer %d refused the mean of tensor %d from owner %d: %s",
                             self.round_, j, i, owner, reason)
                mine.append(torch.zeros(m.shape, dtype=torch.float32) if holds_delta
                            else own[member][i].detach().float().clone())
            out.append(mine)
        return out

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
                is data-parallel; nothing changed.
        """
        if mode not in ("delayed", "eager"):
            raise ValueError(f"start_overlap({mode!r}): only 'delayed' or 'eager' can start mid-run")
        if self.data_parallel or self.streaming or self.m.sync.overlap != "none":
            raise ValueError(f"start_overlap({mode!r}) needs a DiLoCo or NoLoCo run without overlap "
                             f"(this one: overlap {self.m.sync.overlap!r}, data-parallel {self.data_parallel})")
        self.m = self.m.replace(sync={"overlap": mode})
        self._anchor_at_phi()

    def finish(self) -> None:
        """With overlap, wait for the last round's sync: apply its means and set θ ← φ (no-op
        without one), so the final φ holds every round, as a peer's does when training ends.

        Streaming: the syncs in flight land, then every fragment with inner steps since its last
        sync (all but fragment 0 at a round's end) syncs once more and lands at once, so the final
        φ holds every step, as φ does without overlap; then θ ← φ."""
        if self.streaming:
            for p in sorted(self.in_flight):
                self._fragment_land(p)
            for p, last in enumerate(self.last_sync):
                if last < self.inner_step:
                    self._fragment_sync(p, self.inner_step)
                    self._fragment_land(p)
            with torch.no_grad():
                for model, phi in zip(self.models, self.phis):
                    for t, p in zip(model.parameters(), phi):
                        t.copy_(p)
            return
        if self.data_parallel or self.pending is None:
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

    def _compressed_mean(self, group: Sequence[int], payloads: Sequence[Sequence[torch.Tensor]],
                         weights: Sequence[float], *, tensors: Sequence[int] | None = None,
                         ) -> tuple[list[torch.Tensor] | None, float]:
        """The group mean as the network's all-reduce computes it with a codec, and the bytes sent.

        Tensor i is owned by member ``i mod n`` (whole tensors stand in for the all-reduce's row
        pieces). Every other member sends decode(encode(Δ + e)) and stages e ← (Δ + e) − that.
        The owner's own contribution stays local: exact (its residual spent) for elementwise
        codecs, through the codec for topk and lowrank, whose mean is exact under
        ``for_mean(n)`` only when every contribution is a decoded encoding
        (:attr:`~protocol.codecs.Codec.structured`). The owner screens and averages the decoded
        contributions in fp32 (:meth:`_group_mean`) and sends the mean (forged by a lying owner:
        :meth:`_owners_send`) with ``codec.for_mean(n)``; every member, the owner included, gets that
        identical decoded tensor, to check against its own decoded contribution (:meth:`_receive`,
        which the caller runs with ``_decoded``, the decoded contributions, and ``_honest_final``,
        the decoded honest means).

        ``tensors``: the whole payload's indices of the tensors ``payloads`` hold (a streaming
        fragment's: its Δ tensors, then NoLoCo's φ tensors), whose codecs, codec seeds and
        residuals they use; None: the whole payload.

        Returns:
            The decoded means as the owners sent them (None: a mean was not finite, the all-reduce
            failed and every member's residuals roll back), and the bytes one member sends on
            average: per tensor, the
            encoded contributions of the n − 1 non-owners plus n − 1 copies of the encoded mean, over n.
        """
        n, n_params = len(group), len(self.shapes)
        index = list(range(len(payloads[0]))) if tensors is None else list(tensors)
        deltas = sum(1 for g in index if g < n_params)  # the payload's Δ tensors come first
        seeds = [codec_seed(self.round_, g) for g in index]
        decoded, codecs, total = [], [], 0
        for member, (j, payload) in enumerate(zip(group, payloads)):
            ef = self.feedback[j] if self.feedback is not None else None
            inputs = [ef.compensate(g, t) if ef is not None and i < deltas else t
                      for i, (g, t) in enumerate(zip(index, payload))]
            mine = [self.codecs[g] for g in index]
            if self.m.compression.codec == "adaptive":
                mine[:deltas] = plan(inputs[:deltas], self.m.compression, group_size=n,
                                     uplink_bytes_per_s=self.uplink_mbps * 1e6 / 8)
            out = []
            for i, (x, codec) in enumerate(zip(inputs, mine)):
                own = i % n == member  # the owner's own rows never cross the network
                if own and not codec.structured:
                    y = x
                else:
                    data, y = codec.roundtrip(x, seed=seeds[i])
                    total += 0 if own else len(data)
                if ef is not None and i < deltas:
                    ef.stage(index[i], x, y)
                out.append(y)
            decoded.append(out)
            codecs.append(mine)
        mean = self._group_mean(group, decoded, weights)
        forged = None if mean is None else self._owners_send(group, mean)
        if forged is None:
            for j in group:
                if self.feedback is not None:
                    self.feedback[j].rollback()
            return None, total / n
        final, honest = [], []
        for i, (t, f) in enumerate(zip(mean, forged)):
            codec = codecs[i % n][i].for_mean(n)
            data, value = codec.roundtrip(f, seed=seeds[i])
            final.append(value)
            honest.append(value if f is t else codec.roundtrip(t, seed=seeds[i])[1])
            total += (n - 1) * len(data)
        for j in group:
            if self.feedback is not None:
                self.feedback[j].commit()
        self._decoded, self._honest_final = decoded, honest
        return final, total / n

    def evaluate(self, windows: torch.Tensor) -> EvalPoint:
        """Validation losses of the current φ's on ``windows`` (int64, (sequences, seq_len + 1)).

        NoLoCo and independent: each replica's own loss and σ are computed (N evaluations). Losses
        in bits per UTF-8 byte of the targets (peer.train.data.validation_bits_per_byte), so runs
        with different tokenizers compare.
        """
        def bits_per_byte(nats: float) -> float:
            return validation_bits_per_byte(nats, windows, self.tokenizer)

        if self.data_parallel:
            loss = bits_per_byte(evaluate(self.models[0], windows))
            return EvalPoint(self.round_, self.tokens, loss, loss, None, 0.0)
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
        if self.outers[0].replicas_differ:
            replica_mean = sum(bits_per_byte(evaluate(m, windows)) for m in self.models) / self.peers
        return EvalPoint(self.round_, self.tokens, replica_mean if replica_mean is not None else averaged,
                         averaged, replica_mean, weight_spread(self.phis))

    def _honest_losses(self, windows: torch.Tensor, to_bpb) -> list[float]:
        """Each honest peer's loss on ``windows`` (``to_bpb`` of the nats), one evaluation per distinct
        φ; a φ that is not finite scores inf."""
        seen: list[tuple[list[torch.Tensor], float]] = []
        out = []
        for i in self.honest:
            phi = self.phis[i]
            loss = next((l for other, l in seen if all(torch.equal(a, b) for a, b in zip(phi, other))), None)
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


def run_simulation(manifest: RunManifest, corpus: Corpus, *, peers: int, rounds: int, seed: int = 0,
                   data_parallel: bool = False, eval_every_rounds: int = 1,
                   uplink_mbps: float = 50.0, screening: bool = True,
                   adversary: Adversary | None = None, device: torch.device | str = "cpu",
                   precision: Precision = FP32, compile: bool = False,
                   on_eval: Callable[[EvalPoint], None] | None = None,
                   groups_run_id: str | None = None) -> SimulationResult:
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
    sim = Simulation(manifest, corpus, peers=peers, seed=seed, data_parallel=data_parallel, uplink_mbps=uplink_mbps,
                     screening=screening, adversary=adversary, device=device, precision=precision,
                     compile=compile, groups_run_id=groups_run_id)
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
            logger.info("%s N=%d seed %d | round %d | val %.4f bpb | σ %.2e | %.1f MiB sent per peer",
                        sim.method, peers, seed, r, h.loss_bpb, h.sigma, sum(sim.bytes_sent) / peers / 2**20)
    return SimulationResult(method=sim.method, peers=peers, seed=seed, rounds=rounds,
                            inner_steps=manifest.sync.inner_steps, parameters=sim.parameters,
                            bytes_sent_per_peer=sum(sim.bytes_sent) / peers, wall_s=time.perf_counter() - start,
                            history=history, screening=asdict(sim.counts), taken_over=dict(sim.taken_over))
