"""The data-parallel ceiling: one model trained on every peer's batches at once, its gradients in
effect averaged at every inner step (a datacenter's synchronous training at the same tokens).

There is no round here and nothing to sync: N peers' samplers (each seeded as the round engine's
peer i is in the benchmarks, ``peer_seed(f"sim-peer-{i}", seed)``) make one batch of N times a
peer's sequences, and one :class:`peer.train.inner.InnerLoop` (the peers' own AdamW, lr schedule and
gradient clipping) takes H steps of it per "round", so a round of this loop trains the tokens a
round of N peers does. bench/compare.py and bench/sweep_outer.py set the low-communication methods
against it at equal tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lab.sim_results import EvalPoint, SimulationResult, butterfly_bytes
from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch, validation_bits_per_byte
from peer.train.inner import InnerLoop
from peer.train.model import build_model, evaluate, parameter_count
from peer.train.precision import FP32, Precision
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)

METHOD = "data-parallel"


@dataclass
class DataParallelResult(SimulationResult):
    """What :func:`run_data_parallel` returns: a :class:`~lab.sim_results.SimulationResult` that says
    it came from this loop (bench/compare.py's ``source`` column)."""


class ConcatSampler:
    """N samplers as one: a batch (int64, (N × batch sequences, seq_len + 1)) is the concatenation of
    each one's next batch, in order."""

    def __init__(self, samplers: Sequence[BatchSampler]):
        if not samplers:
            raise ValueError("ConcatSampler needs at least one sampler")
        self.samplers = list(samplers)

    def next_batch(self) -> torch.Tensor:
        return torch.cat([s.next_batch() for s in self.samplers])


def peer_samplers(manifest: RunManifest, corpus: Corpus, peers: int, seed: int) -> list[BatchSampler]:
    """The N peers' batch samplers of a benchmark run (peer i's stream of ``corpus.train``)."""
    return [
        BatchSampler(
            corpus.train,
            seq_len=manifest.data.seq_len_tokens,
            batch_sequences=manifest.batch_sequences,
            seed=peer_seed(f"sim-peer-{i}", seed),
        )
        for i in range(peers)
    ]


def run_data_parallel(
    manifest: RunManifest,
    corpus: Corpus,
    *,
    peers: int,
    rounds: int,
    seed: int = 0,
    eval_every_rounds: int = 1,
    device: torch.device | str = "cpu",
    precision: Precision = FP32,
    compile: bool = False,
    on_eval: Callable[[EvalPoint], None] | None = None,
) -> DataParallelResult:
    """Train ``rounds`` × H steps of one model on the N peers' batches together and evaluate every
    ``eval_every_rounds`` rounds (round 0 and the last always).

    Args:
        manifest: the run (its model, inner optimizer, ``sync.inner_steps`` = H, data); the model is
            built from ``model.init_seed``, as every peer's φ_0 is.
        peers: N ≥ 1, the peers whose batches each step concatenates.
        seed: the samplers' seed (the peers' streams).
        device, precision, compile: where and how the inner steps run (peer/train/inner.py).
        on_eval: called with each evaluation as it is made (round 0 included).

    Returns:
        DataParallelResult: method ``data-parallel``; ``bytes_sent_per_peer`` what a ring all-reduce
        of the P fp32 gradients every step would send per peer (``butterfly_bytes``); losses in bits
        per UTF-8 byte on the run's validation windows; empty screening counts.

    Raises:
        ValueError: ``peers`` < 1 or ``rounds`` < 1.
    """
    if peers < 1 or rounds < 1:
        raise ValueError(f"peers = {peers}, rounds = {rounds}: need at least one of each")
    start = time.perf_counter()
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer).to(torch.device(device))
    parameters = parameter_count(model)
    inner = InnerLoop(
        model,
        manifest.inner_optimizer,
        ConcatSampler(peer_samplers(manifest, corpus, peers, seed)),
        device=torch.device(device),
        precision=precision,
        compile=compile,
    )
    H = manifest.sync.inner_steps
    tokens, sent, step = 0, 0.0, 0

    def point(round_: int) -> EvalPoint:
        loss = validation_bits_per_byte(evaluate(model, windows), windows, corpus.tokenizer)
        p = EvalPoint(round_, tokens, loss, loss, None, 0.0)
        if on_eval is not None:
            on_eval(p)
        return p

    history = [point(0)]
    for r in range(1, rounds + 1):
        # queued without waiting (fused AdamW on a card), settled and checked at the round's end
        for k in range(H):
            tokens += inner.step(step + k, wait=False).tokens
        inner.settle()
        step += H
        sent += H * butterfly_bytes(parameters, peers)
        if r % max(1, eval_every_rounds) == 0 or r == rounds:
            history.append(point(r))
            logger.info("%s N=%d seed %d | round %d | val %.4f bpb", METHOD, peers, seed, r, history[-1].loss_bpb)
    return DataParallelResult(
        method=METHOD,
        peers=peers,
        seed=seed,
        rounds=rounds,
        inner_steps=H,
        parameters=parameters,
        bytes_sent_per_peer=sent,
        wall_s=time.perf_counter() - start,
        history=history,
    )
