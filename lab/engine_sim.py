"""N real round loops (peer.round.Trainer) in threads of one process, over the in-process transport.

This runs the peer's own round engine: each simulated peer is a :class:`peer.round.Trainer` with an
:class:`lab.inprocess.InProcessSwarm` and an :class:`~lab.inprocess.InProcessTransport`
over one :class:`~lab.inprocess.InProcessHub` (records in a dict, each group's token-weighted
fp32 mean, states served from the peers' snapshots). Peers are named ``sim-peer-{i}`` and the
Trainer salts its data shard with the manifest's ``model.init_seed``, so with ``seed`` equal to it
(bench/compare.py sets ``init_seed`` to the seed) each peer samples the shard lab/data_parallel.py's
and lab/pipeline.py's replica i samples, from the same φ_0.

It runs the round loop's records, re-sync rule, state snapshots and overlap/streaming schedules as
a peer runs them. The hub deals each group's pieces and
screens them as the network's all-reduce does (lab/inprocess_means.py: the piece plan, the
owners' screening and means, each receiver's check, the strikes, the codecs and each peer's error
feedback); what it does not do: the timing of a network. A lab adversary (lab/adversary.py) acts
inside the hub: the malicious peers run honest round loops whose contributions, owners' means,
records and served states it forges. Evaluation is taken from copies of each peer's φ made as it
finished each evaluated round (its ``round`` event), evaluated after the run, so the training's
wall time holds no evaluation.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lab.adversary import Adversary, EngineAdversary
from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from lab.inprocess_means import PieceRules
from lab.sim_results import EvalPoint, SimulationResult, weight_spread, weighted_mean
from peer.config import TrainerConfig
from peer.progress import TrainSummary
from peer.reporting import Reporter
from peer.round import Trainer
from peer.round.overlapped import OverlapSchedule
from peer.round.streamed import FragmentSchedule
from peer.round.timing import Timing
from peer.sync.screening import round_token_cap
from peer.train.data import Corpus, validation_batch, validation_bits_per_byte
from peer.train.device import Placement
from peer.train.model import build_model, evaluate, parameter_count
from protocol.manifest import RunManifest

PHI_OF = ("mean", "peer0")


@dataclasses.dataclass
class EngineResult(SimulationResult):
    """:class:`SimulationResult` of an engine run, with its timing."""

    train_s: float = 0.0
    """Wall time of the round loops (threads started → all joined), s; no evaluation in it."""
    round_end_s: list[float] = dataclasses.field(default_factory=list)
    """Per round, seconds from the start until the last peer finished it (its ``round`` event)."""
    state_digests: list[str] = dataclasses.field(default_factory=list)
    """Each peer's state digest (φ and outer state) at the end, in peer order: equal when they hold
    bit-identical states."""
    final_phis: list[list[torch.Tensor]] = dataclasses.field(default_factory=list, repr=False, compare=False)
    """Each peer's φ at the end (copies, fp32 on the host), in peer order; not in :meth:`to_dict`."""
    honest: list[int] = dataclasses.field(default_factory=list)
    """The peers evaluated (all but an adversary's), in peer order."""
    honest_exits: int = 0
    """Honest round loops that raised or ended before the last round (an adversary's run only)."""
    non_finite_rounds: int = 0
    """Rounds at whose end some honest peer's φ held NaN or inf."""
    takeovers: int = 0
    """Honest peers' adoptions of a state the adversary forged (its ``forged_digests``)."""
    screening: dict[str, int] = dataclasses.field(default_factory=dict)
    """From the honest peers' round events: ``rounds_with_refused_means``, ``rounds_with_refused_steps``
    (NoLoCo's loss gate), ``failed_syncs``, ``warnings``, ``adopted_states``, and the adversary's
    ``forged_means`` and ``forged_states``."""

    def to_dict(self) -> dict:
        """As :meth:`SimulationResult.to_dict`, without the tensors of ``final_phis``."""
        return dataclasses.asdict(dataclasses.replace(self, final_phis=[]))


class _Recorder(Reporter):
    """A peer's reporter: keeps its events; copies φ at each evaluated round's end."""

    def __init__(self, index: int, on_round: Callable[[int, dict[str, Any]], None]):
        super().__init__()
        self.index, self.on_round = index, on_round
        self.events: list[dict[str, Any]] = []
        self.trainer: Trainer | None = None

    def emit(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})
        if event == "round":
            self.on_round(self.index, fields)


def run_engine_simulation(
    manifest: RunManifest,
    corpus: Corpus,
    *,
    peers: int,
    rounds: int,
    seed: int | None = None,
    eval_every_rounds: int = 1,
    placement: Placement | None = None,
    phi_of: str = "mean",
    on_eval: Callable[[EvalPoint], None] | None = None,
    matchmaking_s: float = 60.0,
    timeout_s: float | None = None,
    screening: bool = True,
    adversary: Adversary | None = None,
    pinned: bool = False,
    loss_gate: bool = True,
    uplink_mbps: float | None = None,
) -> EngineResult:
    """Train ``rounds`` rounds of N :class:`~peer.round.Trainer` s in threads and evaluate every
    ``eval_every_rounds`` (round 0 and the last round always).

    Args:
        seed: must be the manifest's ``model.init_seed`` (the Trainer salts its shard with it);
            None: that one.
        placement: where every peer's θ trains (one card holds all N); None: CPU, fp32.
        phi_of: ``"mean"``: each evaluation is of the peers' averaged φ (and, where replicas differ,
            the mean of each φ's loss, the benchmarks' headline); ``"peer0"``: of
            ``sim-peer-0``'s φ alone.
        on_eval: called with each evaluation, after the run (they are computed from the copies).
        matchmaking_s: how long a group waits for the members it expects, s.
        timeout_s: how long the round loops may take in all (None: 600 s + 60 s a round); past it
            they are stopped and a ``RuntimeError`` raised.
        screening: the hub aggregates as the network does (lab/inprocess_means.py, the run's
            compression, token cap and piece size); False: the plain token-weighted fp32 mean, and
            no loss gate (``loss_gate``).
        loss_gate: the honest peers' NoLoCo blocking landings judge the group's step by its loss, as
            a peer's do (peer/round/loss_gate.py); False: they apply it as the hub delivered it. A
            malicious peer's always do (it keeps its own model clean: the stronger attacker).
        adversary: malicious peers (lab/adversary.py) acting inside the hub; evaluation, exits,
            non-finite rounds and takeovers count the honest peers only, and an honest round loop
            that raises or stops early is counted (``honest_exits``) instead of raised.
        pinned: the overlap modes land their means where a lockstep defines them (peer/round/timing.py),
            whatever the threads' timing (peer/round/timing.py ``Timing.of(..., pinned=True)``: no
            extra steps past H while a sync is out, a streaming fragment's mean exactly τ steps after
            its sync started); bench/overlap.py and bench/byzantine.py run pinned.
        uplink_mbps: every peer's uplink as the adaptive codec plans with it, Mbit/s (None: 8,000).

    Returns:
        EngineResult: the loss curve, bytes sent per peer (with ``screening``, the encoded bytes of
        its contributions and means; else the fp32 butterfly's estimate of each sync), wall time (evaluation included), the training's own wall time
        and when each round ended.

    Raises:
        ValueError: ``peers`` < 1, ``phi_of`` unknown or ``seed`` not the init seed (the data-parallel
            ceiling has no round loop: lab/data_parallel.py); ``pinned`` NoLoCo with overlap where
            the random groups leave one peer alone every round (``peers`` mod ``noloco.group_size``
            = 1): a peer without a partner waits for nobody and can run more than a round ahead, so
            who pairs with whom would follow the threads' timing.
        RuntimeError: a round loop raised or did not finish in time.
    """
    start = time.perf_counter()
    if peers < 1 or phi_of not in PHI_OF:
        raise ValueError(f"peers = {peers}, phi_of = {phi_of!r}: need at least one peer and one of {PHI_OF}")
    sync, group = manifest.sync, manifest.noloco.group_size
    if pinned and sync.algorithm == "noloco" and sync.overlap != "none" and peers > 1 and peers % group == 1:
        raise ValueError(
            f"peers = {peers} with noloco.group_size = {group} and sync.overlap = {sync.overlap!r}: one peer is "
            "left without a partner every round and runs ahead of the lockstep; use a number of peers that "
            "the groups divide without a remainder of one"
        )
    if seed is not None and seed != manifest.model.init_seed:
        raise ValueError(
            f"seed = {seed} but model.init_seed = {manifest.model.init_seed}: the round loop salts "
            "its data shard with the init seed; set both alike"
        )
    seed = manifest.model.init_seed
    every = max(1, eval_every_rounds)
    evaluated = {r for r in range(1, rounds + 1) if r % every == 0 or r == rounds}
    hooks: EngineAdversary | None = None
    if adversary is not None:
        if max(adversary.peers) >= peers:
            raise ValueError(f"adversary peers {adversary.peers} with {peers} peers: expected indices < {peers}")
        hooks = adversary.hooks(
            run_id=manifest.run_id, inner_steps=manifest.sync.inner_steps, noloco=manifest.sync.algorithm == "noloco"
        )
    honest = [i for i in range(peers) if adversary is None or i not in adversary.peers]
    timing = Timing.of(manifest.sync, pinned=pinned)  # the hub's rules and every Trainer read it
    rules = (
        PieceRules(
            compression=manifest.compression,
            max_weight=float(round_token_cap(manifest)),
            whole_delta=timing.whole_delta,
            **({} if uplink_mbps is None else {"uplink_bytes_per_s": uplink_mbps * 1e6 / 8}),
        )
        if screening
        else None
    )
    hub = InProcessHub(matchmaking_s=matchmaking_s, rules=rules, hooks=hooks)
    non_finite: set[int] = set()
    lock = threading.Lock()
    copies: dict[int, list[list[torch.Tensor] | None]] = {r: [None] * peers for r in evaluated}
    tokens: dict[int, list[int]] = {}
    finished: dict[int, float] = {}
    reporters: list[_Recorder] = []

    def on_round(i: int, fields: dict[str, Any]) -> None:
        r = int(fields["round"])
        trainer = reporters[i].trainer
        phi = [f.clone() for f in trainer.phi] if r in evaluated and trainer is not None else None
        broken = trainer is not None and i in honest and not all(bool(torch.isfinite(f).all()) for f in trainer.phi)
        with lock:
            if broken:
                non_finite.add(r)
            tokens.setdefault(r, [0] * peers)[i] = int(fields["tokens"])
            if phi is not None:
                copies[r][i] = phi
            if all(tokens[r][j] for j in honest):
                finished[r] = time.perf_counter() - train_start

    stop = threading.Event()
    trainers: list[Trainer] = []
    transports: list[InProcessTransport] = []
    for i in range(peers):
        peer_id = f"sim-peer-{i}"
        reporter = _Recorder(i, on_round)
        reporters.append(reporter)
        transport = InProcessTransport(
            peer_id, hub, run_id=manifest.run_id, bytes_per_sync=None, max_sync_seconds=matchmaking_s
        )
        transports.append(transport)
        t = Trainer(
            manifest=manifest,
            model=build_model(manifest.model, corpus.tokenizer),
            corpus=corpus,
            swarm=InProcessSwarm(peer_id, hub, max_sync_s=matchmaking_s),
            transport=transport,
            config=TrainerConfig(max_rounds=rounds, wait_for_peers=peers, wait_for_peers_timeout_s=matchmaking_s),
            reporter=reporter,
            stop_event=stop,
            placement=placement,
            evaluates_phi=False,
            timing=timing,
        )
        # a malicious peer's loop always gates: it keeps its own model clean, so its next forgeries
        # start from a good φ and it passes its partners' φ checks more often (the stronger attacker)
        if i in honest and not (screening and loss_gate) and isinstance(t.schedule, FragmentSchedule | OverlapSchedule):
            t.schedule.gate = None
        transport.shapes = t.shapes  # what a downloaded state must fit, as NetworkTransport's param_shapes
        transport.phi_from = t.outer.phi_from(len(t.shapes))  # NoLoCo's payload: Δ then φ (peer/node.py)
        reporter.trainer = t
        trainers.append(t)

    errors: list[BaseException] = []
    exited: dict[str, BaseException] = {}
    summaries: dict[str, TrainSummary] = {}

    def run(t: Trainer) -> None:
        try:
            summaries[t.peer_id] = t.run()
        except BaseException as exc:
            if adversary is None:
                errors.append(exc)
                stop.set()
            else:  # counted, not raised: the others go on (a malicious loop's failure is not counted)
                exited[t.peer_id] = exc

    threads = [threading.Thread(target=run, args=(t,), name=t.peer_id) for t in trainers]
    train_start = time.perf_counter()
    for th in threads:
        th.start()
    deadline = train_start + (timeout_s if timeout_s is not None else 600.0 + 60.0 * rounds)
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    if any(th.is_alive() for th in threads):
        stop.set()
        for th in threads:
            th.join(60.0)
        raise RuntimeError(f"the round loops did not finish {rounds} rounds in time")
    train_s = time.perf_counter() - train_start
    if errors:
        raise RuntimeError(f"a round loop raised: {errors[0]!r}") from errors[0]

    def ended_early(i: int) -> bool:
        s = summaries.get(trainers[i].peer_id)
        return s is None or s.fatal is not None or s.interrupted or s.final_round != rounds

    if adversary is None and any(ended_early(i) for i in range(peers)):
        ended = [summaries[t.peer_id] for t in trainers]
        raise RuntimeError(
            f"the round loops ended at rounds {[s.final_round for s in ended]}, not {rounds} "
            f"({[repr(s.fatal) for s in ended if s.fatal is not None]})"
        )
    exits = [i for i in honest if ended_early(i)]
    kept = [i for i in honest if i not in exits]  # evaluated: the honest peers that finished
    if not kept:
        raise RuntimeError(f"every honest round loop ended early ({[repr(e) for e in exited.values()]})")
    ended = [summaries[trainers[i].peer_id] for i in kept]

    # the final φ: the last round's sync (with overlap) landed before run() returned
    final_phis = [[f.clone() for f in t.phi] for t in trainers]
    copies[rounds] = list(final_phis)
    for r in copies:
        copies[r] = [copies[r][i] for i in kept]
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer)
    replicas_differ = trainers[0].outer.replicas_differ

    def bpb(phi: list[torch.Tensor]) -> float:
        with torch.no_grad():
            for p, f in zip(model.parameters(), phi, strict=True):
                p.copy_(f)
        return validation_bits_per_byte(evaluate(model, windows), windows, corpus.tokenizer)

    def point(r: int, phis: list[list[torch.Tensor]], total_tokens: int) -> EvalPoint:
        if adversary is not None:  # each honest peer's own loss: an attack may split them
            per = [bpb(p) for p in phis]
            loss = sum(per) / len(per)
            return EvalPoint(
                r, total_tokens, loss, bpb(weighted_mean(phis, [1.0] * len(phis))), loss, weight_spread(phis), per
            )
        if phi_of == "peer0":
            loss = bpb(phis[0])
            return EvalPoint(r, total_tokens, loss, loss, None, weight_spread(phis))
        averaged = bpb(weighted_mean(phis, [1.0] * len(phis)))
        replica_mean = sum(bpb(p) for p in phis) / len(phis) if replicas_differ else None
        return EvalPoint(
            r,
            total_tokens,
            replica_mean if replica_mean is not None else averaged,
            averaged,
            replica_mean,
            weight_spread(phis),
        )

    phi0 = [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]
    history = [point(0, [phi0] * len(kept), 0)]
    running = 0
    for r in range(1, rounds + 1):
        running += sum(tokens.get(r, [0] * peers)[i] for i in honest)
        if r in evaluated:
            phis = copies[r]
            if any(p is None for p in phis):
                raise RuntimeError(f"round {r}: not every peer reported its φ")
            history.append(point(r, phis, running))  # type: ignore[arg-type]
    if on_eval is not None:
        for h in history:
            on_eval(h)
    bytes_sent = sum(s.bytes_sent for s in ended) / len(ended)
    forged = hooks.forged_digests if hooks is not None else set()
    takeovers = sum(
        1
        for i in honest
        for e in reporters[i].events
        if e["event"] == "adopted_state" and e.get("state_digest") in forged
    )
    rounds_of = [e for i in honest for e in reporters[i].events if e["event"] == "round"]
    counts = {  # from the honest peers' events (a round's note names refusals and failed syncs)
        "rounds_with_refused_means": sum(1 for e in rounds_of if "refused the means" in (e.get("note") or "")),
        "rounds_with_refused_steps": sum(1 for e in rounds_of if "applied its own step alone" in (e.get("note") or "")),
        "failed_syncs": sum(1 for e in rounds_of if (e.get("note") or "").startswith("no group")),
        "warnings": sum(1 for i in honest for e in reporters[i].events if e["event"] == "warning"),
        "adopted_states": sum(1 for i in honest for e in reporters[i].events if e["event"] == "adopted_state"),
        "forged_means": hooks.forged_means if hooks is not None else 0,
        "forged_states": len(forged),
    }
    return EngineResult(
        method=manifest.sync.algorithm,
        peers=peers,
        seed=seed,
        rounds=rounds,
        inner_steps=manifest.sync.inner_steps,
        parameters=parameter_count(model),
        bytes_sent_per_peer=bytes_sent,
        wall_s=time.perf_counter() - start,
        history=history,
        train_s=train_s,
        round_end_s=[finished.get(r, float("nan")) for r in range(1, rounds + 1)],
        state_digests=[t.state_digest for t in trainers],
        final_phis=final_phis,
        honest=kept,
        honest_exits=len(exits),
        non_finite_rounds=len(non_finite),
        takeovers=takeovers,
        screening=counts,
    )
