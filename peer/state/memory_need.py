"""The memory a peer of a run needs on this machine, buffer by buffer, checked before it trains
(issue #67, item 5): ``peer doctor`` and ``peer join`` refuse, in one line, a run whose model does
not fit the host's free RAM or the card's free memory, instead of being killed by the kernel's OOM
killer in the middle of a round.

The arithmetic follows how the code allocates today, not what a peer could get by with; each
term names the code that allocates it. M is the model in fp32 (4 bytes per parameter), the payload
is what a peer sends per sync (Δ: M; NoLoCo sends Δ and φ: 2 M), R the error-feedback residuals (M
with a lossy codec and error feedback on, M / 2 kept in bf16, else 0). A peer's host memory:

* always held: θ (on the host for a CPU peer, on the card for a GPU peer), its gradients, the inner
  optimizer's state, the model's evaluation copy and the evaluation's logits, the activations of a
  micro-batch (an estimate), φ and the outer state, the previous round's φ and outer state (the
  older snapshot, kept until the next landing), the payload buffers the peer shares with its
  averager process, the committed residuals, and for an overlapped sync what it holds through the
  next round;
* at one moment of a round, the largest of: the round's end (Δ, the group's mean, and the
  averager's all-reduce buffers), the landing (the outer step's new tensors) and a checkpoint
  (written tensor by tensor from the tensors as held: on a GPU peer one tensor's host copy; the
  residuals fetched from the averager);
* the code of the peer's four processes (:data:`PROCESS_OVERHEAD_BYTES`, measured).

peer/state/memory_check.py sets the need against the free memory (``peer doctor``, ``peer join``).

Freed memory that glibc keeps for the next round (peer/train/host_memory.py) is not counted.
Checked against the rig's measured peak PSS in docs/memory.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from peer.train.model import spec_parameter_count
from protocol.manifest import RunManifest
from protocol.presets import PRESETS
from protocol.specs import ModelSpec

MIB = 2**20
GIB = 2**30

PROCESS_OVERHEAD_BYTES = 600 * MIB
"""Memory of a peer's four processes with no model to speak of: the peer's, its averager's and its
DHT node's Python with their imported code (torch, transformers, hivemind) and p2pd. Measured: the
PSS (/proc/PID/smaps_rollup) of a ``peer join --preset tiny`` (0.03 M parameters) at rest between
rounds summed to 490 to 600 MiB in two runs (the peer 165 to 250, its averager 142 to 144, its DHT
process 120 to 122, p2pd 63), on a host where other Python processes shared the same libraries'
pages (which lowers PSS); the larger figure is taken."""

ACTIVATION_BYTES_PER_TOKEN_LAYER = {"bf16": (22.0, 8.0), "fp16": (22.0, 8.0), "fp32": (36.0, 16.0)}
"""Bytes one transformer block keeps for the backward per token, per unit of (hidden, intermediate)
size: under bf16/fp16 autocast the fp32 residual and norm inputs and the half-precision projections
and SwiGLU products (peer/train/device.py ``training_memory_bytes``); in fp32 the half-precision
ones twice as large. An estimate, not a measurement."""

LOGIT_BYTES_PER_TOKEN_VOCAB = {"bf16": 10.0, "fp16": 10.0, "fp32": 12.0}
"""Bytes per token and vocabulary entry of the loss: half-precision logits, their fp32 copy and its
gradient (peer/train/model.py ``lm_loss``); in fp32 the logits, the log-softmax and the gradient."""

EVAL_SEQUENCES = 16
"""Sequences per chunk of the evaluation of φ (peer/train/model.py ``evaluate``)."""

HOST, GPU = "host", "gpu"
PEER, AVERAGER = "peer", "averager"
ALWAYS, ROUND_END, LANDING, CHECKPOINT = "always", "round end", "landing", "checkpoint"
MOMENTS = (ROUND_END, LANDING, CHECKPOINT)


@dataclass(frozen=True, kw_only=True)
class Buffer:
    """One buffer a peer holds."""

    name: str
    """What it is, for the table: ``θ (the model's parameters)``."""
    bytes: int
    """Its size, bytes (>= 0)."""
    where: str
    """``host`` (RAM) or ``gpu`` (the card's memory)."""
    process: str
    """``peer`` (the training process) or ``averager`` (the process forked to average)."""
    when: str
    """``always``, or the moment of a round it exists in: ``round end``, ``landing``, ``checkpoint``."""
    code: str
    """The code that allocates it."""


@dataclass(frozen=True, kw_only=True)
class MemoryNeed:
    """What a peer of ``run`` holds, and the peak it comes to on the host and on the card."""

    run: str
    parameters: int
    device_type: str
    """``cpu``, ``cuda`` or ``mps`` (MPS shares the host's memory: counted as host)."""
    buffers: tuple[Buffer, ...]
    overhead_bytes: int = PROCESS_OVERHEAD_BYTES

    def peak_bytes(self, where: str) -> int:
        """Bytes needed at once on ``where`` (``host`` or ``gpu``): the buffers always held, plus the
        largest moment of a round, plus (host) the processes' code."""
        mine = [b for b in self.buffers if b.where == where]
        always = sum(b.bytes for b in mine if b.when == ALWAYS)
        moment = max(sum(b.bytes for b in mine if b.when == m) for m in MOMENTS)
        return always + moment + (self.overhead_bytes if where == HOST else 0)

    @property
    def host_bytes(self) -> int:
        return self.peak_bytes(HOST)

    @property
    def gpu_bytes(self) -> int:
        """0 for a CPU or MPS peer."""
        return self.peak_bytes(GPU) if self.device_type == "cuda" else 0

    def process_bytes(self, process: str, where: str = HOST) -> int:
        """Peak of one process's buffers on ``where`` (shared buffers counted half in each), no code."""
        mine = [b for b in self.buffers if b.where == where and b.process in (process, "shared")]

        def size(b: Buffer) -> float:
            return b.bytes / 2 if b.process == "shared" else b.bytes

        always = sum(size(b) for b in mine if b.when == ALWAYS)
        return int(always + max(sum(size(b) for b in mine if b.when == m) for m in MOMENTS))

    def table(self) -> list[str]:
        """The buffers as Markdown table rows (header first), sizes in MiB, then the peaks."""
        rows = ["| buffer | MiB | where | process | when | allocated by |", "| --- | ---: | --- | --- | --- | --- |"]
        for b in self.buffers:
            if b.bytes:
                rows.append(f"| {b.name} | {b.bytes / MIB:,.0f} | {b.where} | {b.process} | {b.when} | {b.code} |")
        rows.append(f"| code of the 4 processes | {self.overhead_bytes / MIB:,.0f} | host | all | always | measured |")
        rows.append(f"| **host peak** | **{self.host_bytes / MIB:,.0f}** | host | | | |")
        if self.device_type == "cuda":
            rows.append(f"| **GPU peak** | **{self.gpu_bytes / MIB:,.0f}** | gpu | | | |")
        return rows


def vocab_size(manifest: RunManifest) -> int:
    """Rows of the run's embedding: 259 for the byte tokenizer, ``data.vocab_size`` for a BPE."""
    return 259 if manifest.data.tokenizer == "bytes" else manifest.data.vocab_size


def spec_parameters(spec: ModelSpec, vocab: int) -> int:
    """Parameters of peer/train/model.py ``build_model``'s model, from the spec (nothing is built)."""
    return spec_parameter_count(spec, vocab)


def _block_matrix_parameters(spec: ModelSpec) -> int:
    """Parameters of the transformer blocks' 2-D weights (Muon's, peer/train/inner.py ``muon_parameters``)."""
    h, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    attention = 2 * h * spec.num_heads * head_dim + 2 * h * spec.num_kv_heads * head_dim
    return spec.num_layers * (attention + 3 * h * spec.intermediate_size)


def _largest_tensor_parameters(spec: ModelSpec, vocab: int) -> int:
    """Elements of the model's largest tensor: the embedding or output layer (vocab × hidden) or an
    MLP matrix (hidden × intermediate)."""
    return spec.hidden_size * max(vocab, spec.intermediate_size, spec.hidden_size)


def activation_bytes(
    spec: ModelSpec, *, vocab: int, tokens: int, precision: str, activation_checkpointing: bool = False
) -> int:
    """Estimated bytes a forward keeps for its backward over ``tokens`` tokens (one micro-batch):
    per block :data:`ACTIVATION_BYTES_PER_TOKEN_LAYER`, per vocabulary entry
    :data:`LOGIT_BYTES_PER_TOKEN_VOCAB`; with activation checkpointing each block keeps only its fp32
    input and one block is recomputed at a time. Not measured: ``peer doctor`` times real steps."""
    per_h, per_i = ACTIVATION_BYTES_PER_TOKEN_LAYER[precision]
    block = per_h * spec.hidden_size + per_i * spec.intermediate_size
    blocks = (spec.num_layers * 4.0 * spec.hidden_size + block) if activation_checkpointing else spec.num_layers * block
    return int(tokens * (blocks + LOGIT_BYTES_PER_TOKEN_VOCAB[precision] * vocab))


def memory_need(
    manifest: RunManifest,
    *,
    device_type: str = "cpu",
    precision: str | None = None,
    micro_batch_sequences: int | None = None,
    activation_checkpointing: bool = False,
) -> MemoryNeed:
    """The buffers a peer of ``manifest`` holds on a ``device_type`` peer, as the code allocates them.

    Args:
        device_type: ``cpu``, ``cuda`` or ``mps`` (θ, its gradients and the optimizer's state live
            on the card only with ``cuda``; MPS shares the host's memory).
        precision: ``fp32``, ``bf16`` or ``fp16`` (only the activations' estimate reads it); None:
            what ``--precision auto`` picks (half precision on CUDA, fp32 elsewhere).
        micro_batch_sequences: ``--micro-batch``; None: the whole batch on a CPU (its inner loop runs
            it at once) and one sequence on CUDA (the start-up probe fits the largest that fits;
            one is the least it accepts).
        activation_checkpointing: ``--activation-checkpointing``.

    Raises:
        ValueError: an unknown ``device_type`` or ``precision``.
    """
    if device_type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device_type = {device_type!r}: expected 'cpu', 'cuda' or 'mps'")
    precision = precision or ("bf16" if device_type == "cuda" else "fp32")
    if precision not in ACTIVATION_BYTES_PER_TOKEN_LAYER:
        raise ValueError(f"precision = {precision!r}: expected 'fp32', 'bf16' or 'fp16'")
    spec, sync, codec = manifest.model, manifest.sync, manifest.compression
    vocab = vocab_size(manifest)
    n = spec_parameters(spec, vocab)
    M = 4 * n  # the model in fp32
    noloco = sync.algorithm == "noloco"
    payload = 2 * M if noloco else M  # peer/train/outer.py NoLoCo.payload_shapes: Δ then φ
    lossy = codec.codec != "none"
    R = (M // 2 if codec.residual_dtype == "bf16" else M) if lossy and codec.error_feedback else 0  # keeps_residuals
    dev = GPU if device_type == "cuda" else HOST
    overlap = sync.overlap
    # Streaming syncs one fragment at a time: its Δ, mean and new φ are a fragment's (the largest:
    # ⌈L/P⌉ blocks plus the embedding and the output layer, peer/train/streaming.py), not the model's
    if overlap == "streaming":
        blocks = -(-spec.num_layers // sync.fragments)
        per_block = (n - 2 * vocab * spec.hidden_size - spec.hidden_size) / spec.num_layers
        share = min(1.0, (blocks * per_block + 2 * vocab * spec.hidden_size + spec.hidden_size) / n)
    else:
        share = 1.0

    def f(size: int) -> int:  # a fragment's share of a model-sized buffer
        return int(size * share)

    sequences = micro_batch_sequences or (1 if device_type == "cuda" else manifest.batch_sequences)
    if manifest.inner_optimizer.kind == "muon":  # Muon: one momentum on block matrices, AdamW's two on the rest
        matrices = 4 * _block_matrix_parameters(spec)
        optimizer, what = matrices + 2 * (M - matrices), "Muon momentum + AdamW moments"
    else:
        optimizer, what = 2 * M, "AdamW exp_avg, exp_avg_sq"
    B = Buffer
    buffers = [
        # ---- the training process, always ----
        B(
            name="θ (the model's parameters, fp32)",
            bytes=M,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/model.py build_model; peer/round/engine.py Trainer (model.to(device))",
        ),
        B(
            name="gradients of θ (fp32)",
            bytes=M,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/inner.py InnerLoop.step (backward)",
        ),
        B(
            name=f"inner optimizer state ({what})",
            bytes=optimizer,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/inner.py InnerLoop (torch.optim.AdamW / Muon)",
        ),
        B(
            name=f"activations of a micro-batch of {sequences} × {manifest.data.seq_len_tokens} tokens ({precision}, estimate)",
            bytes=activation_bytes(
                spec,
                vocab=vocab,
                tokens=sequences * manifest.data.seq_len_tokens,
                precision=precision,
                activation_checkpointing=activation_checkpointing,
            ),
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/inner.py InnerLoop.step (forward)",
        ),
        B(
            name="autocast's half-precision copies of the weights",
            bytes=M // 2 if precision != "fp32" else 0,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/precision.py autocast (torch's cast cache)",
        ),
        B(
            name="evaluation copy of the model",
            bytes=M if manifest.pipeline.stages == 1 else 0,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/round/publishing.py (copy.deepcopy(state.model))",
        ),
        # its thread runs beside the inner steps, at any moment of a round
        B(
            name=f"evaluation logits of {EVAL_SEQUENCES} sequences and their log-softmax (fp32)",
            bytes=(2 * 4 * EVAL_SEQUENCES * manifest.data.seq_len_tokens * vocab)
            if manifest.pipeline.stages == 1
            else 0,
            where=dev,
            process=PEER,
            when=ALWAYS,
            code="peer/train/model.py evaluate, lm_loss",
        ),
        B(
            name="φ (fp32; pinned on a CUDA peer)",
            bytes=M,
            where=HOST,
            process=PEER,
            when=ALWAYS,
            code="peer/round/state.py RoundState.__init__",
        ),
        B(
            name="outer state (momentum, fp32; held at any outer momentum)",
            bytes=M,
            where=HOST,
            process=PEER,
            when=ALWAYS,
            code="peer/train/outer.py DiLoCo/NoLoCo/Independent.__init__",
        ),
        # blocking: released at the round's end before Δ (peer/round/streamed.py start_fragment_sync)
        # and made again by the landing's snapshot; it is held through the inner steps and a
        # checkpoint, not at the round's end or the landing
        B(
            name="the previous round's φ and outer state (the older snapshot)",
            bytes=2 * M,
            where=HOST,
            process=PEER,
            when=CHECKPOINT if overlap == "none" else ALWAYS,
            code="peer/round/state.py snapshots (deque of 2; release_older_snapshot at the landing, "
            "at a blocking round's end)",
        ),
        B(
            name="payload buffers shared with the averager",
            bytes=payload,
            where=HOST,
            process="shared",
            when=ALWAYS,
            code="peer/sync/transport.py NetworkTransport.__init__ (torch.zeros(payload_shapes))",
        ),
        # ---- the averager process, always ----
        B(
            name="committed error-feedback residuals",
            bytes=R,
            where=HOST,
            process=AVERAGER,
            when=ALWAYS,
            code="peer/sync/error_feedback.py ErrorFeedback._buffer",
        ),
    ]
    if overlap in ("delayed", "eager"):
        buffers += [
            B(
                name="ψ, where the next round started",
                bytes=M,
                where=HOST,
                process=PEER,
                when=ALWAYS,
                code="peer/train/overlap.py next_start; peer/round/overlapped.py (anchor)",
            ),
            B(
                name="the sync in flight: its Δ and its mean",
                bytes=M + payload,
                where=HOST,
                process=PEER,
                when=ALWAYS,
                code="peer/round/overlapped.py _start (payload); peer/sync/transport.py _attempt (buf.clone())",
            ),
        ]
        if overlap == "eager" and not noloco and manifest.outer_optimizer.momentum != 0:
            buffers.append(
                B(
                    name="eager's offset, its momentum and last share",
                    bytes=3 * M,
                    where=HOST,
                    process=PEER,
                    when=ALWAYS,
                    code="peer/train/overlap.py EagerState.start",
                )
            )
    if overlap == "streaming":
        buffers.append(
            B(
                name="φ of the fragment in flight (copy)",
                bytes=f(M),
                where=HOST,
                process=PEER,
                when=ALWAYS,
                code="peer/round/streamed.py (self.flight: state.phi[k].clone())",
            )
        )
    # ---- the round's end: Δ, the sync ----
    buffers += [
        B(
            name="θ's host copy for Δ",
            bytes=f(M) if device_type == "cuda" or sync.fragment_merge == "shift" and overlap == "streaming" else 0,
            where=HOST,
            process=PEER,
            when=ROUND_END,
            code="peer/round/state.py theta_on_host; peer/round/streamed.py start_fragment_sync",
        ),
        B(
            name="Δ = φ − θ (fp32)",
            bytes=f(M),
            where=HOST,
            process=PEER,
            when=ROUND_END,
            code="peer/train/outer.py pseudo_gradient; peer/round/overlapped.py round_progress",
        ),
        B(
            name="the group's mean (a copy of the shared buffers)",
            bytes=f(payload),
            where=HOST,
            process=PEER,
            when=ROUND_END,
            code="peer/sync/transport.py _attempt (buf.clone())",
        ),
        B(
            name="staged error-feedback residuals",
            bytes=f(M if codec.residual_dtype == "fp32" else M // 2) if lossy else 0,
            where=HOST,
            process=AVERAGER,
            when=ROUND_END,
            code="peer/sync/error_feedback.py ErrorFeedback.stage",
        ),
        B(
            name="own pieces as sent (bf16 if lossy, else fp32)",
            bytes=f(payload // 2 if lossy else payload),
            where=HOST,
            process=AVERAGER,
            when=ROUND_END,
            code="peer/sync/allreduce.py _encode_contribution (_sent)",
        ),
        B(
            name="groupmates' decoded contributions to owned pieces",
            bytes=f(payload),
            where=HOST,
            process=AVERAGER,
            when=ROUND_END,
            code="peer/sync/allreduce.py _contrib",
        ),
        B(
            name="decoded means of every piece",
            bytes=f(payload),
            where=HOST,
            process=AVERAGER,
            when=ROUND_END,
            code="peer/sync/allreduce.py results",
        ),
        # ---- the landing ----
        B(
            name="the outer step's new φ (and new outer state but DiLoCo's, kept in the mean's tensors)",
            bytes=f(M if not noloco and overlap in ("none", "streaming") else 2 * M),
            where=HOST,
            process=PEER,
            when=LANDING,
            code="peer/train/outer.py step_consuming_mean / step_on_copies",
        ),
        # NoLoCo's loss gate (peer/round/loss_gate.py) at a blocking or delayed landing: its own step
        # alone beside the group's (Δ recomputed from θ, or from φ and ψ, φ and δ after it); the
        # evaluation copy is φ's (above)
        B(
            name="loss gate: this peer's own step alone (Δ, its φ and δ)",
            bytes=3 * M if noloco and overlap in ("none", "delayed") else 0,
            where=HOST,
            process=PEER,
            when=LANDING,
            code="peer/round/streamed.py FragmentSchedule.gated; peer/round/overlapped.py OverlapSchedule._gated",
        ),
        # ---- a checkpoint ----
        # written tensor by tensor from the tensors as held: a host fp32 tensor from its own memory,
        # one on the card through a host copy of it, one at a time
        B(
            name="checkpoint: the host copy of the tensor being written (the largest)",
            bytes=4 * _largest_tensor_parameters(spec, vocab) if device_type == "cuda" else 0,
            where=HOST,
            process=PEER,
            when=CHECKPOINT,
            code="peer/state/safetensors_stream.py host_bytes",
        ),
        B(
            name="checkpoint: the residuals fetched from the averager (written as they are)",
            bytes=R,
            where=HOST,
            process=PEER,
            when=CHECKPOINT,
            code="peer/round/checkpointing.py fetch_residuals",
        ),
        B(
            name="checkpoint: the averager's copy of its residuals",
            bytes=R,
            where=HOST,
            process=AVERAGER,
            when=CHECKPOINT,
            code="peer/sync/error_feedback.py ErrorFeedback.residuals (clone)",
        ),
    ]
    if manifest.inner_optimizer.kind == "muon":
        buffers.append(
            B(
                name="checkpoint: zeros for Muon's missing second moment",
                bytes=4 * _block_matrix_parameters(spec),
                where=dev,
                process=PEER,
                when=CHECKPOINT,
                code="peer/train/inner.py state_dict (zeros_like)",
            )
        )
    return MemoryNeed(run=manifest.name, parameters=n, device_type=device_type, buffers=tuple(buffers))


def main(argv: list[str] | None = None) -> None:
    """``python -m peer.state.memory_need PRESET [cpu|cuda|mps] [MICRO_BATCH]``: the table of a preset's buffers."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in PRESETS:
        raise SystemExit(
            f"usage: python -m peer.state.memory_need PRESET [cpu|cuda|mps] [MICRO_BATCH]; presets: {', '.join(PRESETS)}"
        )
    micro = int(args[2]) if len(args) > 2 else None
    need = memory_need(PRESETS[args[0]](), device_type=args[1] if len(args) > 1 else "cpu", micro_batch_sequences=micro)
    print("\n".join(need.table()))


if __name__ == "__main__":
    main()
