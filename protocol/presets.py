"""Named run presets, shared by the CLI, tests, docker and docs.

Every preset pins its tokenizer: 'default' and 'tiny' use the byte-level one, defined by the code
(identical everywhere); the llama-* presets pin by hash the 16,384-id BPE shipped with the package
(peer/assets/tokenizers/stdlib-bpe-16384.json, trained once on a pinned list of standard-library
files that its ``.provenance.json`` names with their hashes), so no peer trains or downloads one.
Their corpus, the running interpreter's standard library, is not fixed across machines, so no
corpus hash is pinned.
"""

from __future__ import annotations

from protocol.manifest import RunManifest

STDLIB_BPE_16384_SHA256 = "6c1f451d2698bf7c6469278642ca76b89917db03c23a8d6245ff67f23a5b607b"
"""SHA-256 of peer/assets/tokenizers/stdlib-bpe-16384.json, the llama-* presets' tokenizer."""


def default_run() -> RunManifest:
    """The run a bare ``peer join`` and ``peer swarm`` train.

    A ~0.9M-parameter Llama-style byte-level LM on the Python standard library's sources,
    sized so that 3 peers sharing 2 CPU cores lower the validation loss visibly in minutes.
    """
    return RunManifest(name="default")


def tiny_run() -> RunManifest:
    """A very small run for tests: rounds take about a second on one CPU core."""
    return RunManifest(name="tiny").replace(
        model={
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 2,
            "intermediate_size": 64,
            "max_seq_len": 64,
        },
        data={"seq_len_tokens": 32, "validation_sequences": 16},
        inner_optimizer={"lr": 5e-3, "warmup_steps": 2, "decay_steps": 200, "batch_size_tokens": 256},
        sync={"inner_steps": 5, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 30.0, "next_chunk_timeout_s": 5.0},
    )


def _llama_run(
    name: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    batch_sequences: int,
    lr: float,
    allreduce_timeout_s: float,
) -> RunManifest:
    """A Llama-style run at a real size: 1,024-token sequences (rotary set for 2,048), the shipped
    16,384-id byte-level BPE (pinned by hash), int8 pseudo-gradients whose error-feedback residuals
    each peer keeps in bf16 (half their host memory; an int8 residual is one block's rounding error,
    which bf16 holds to +0.006 % loss at equal tokens, docs/benchmarks.md), H = 100 inner steps."""
    seq = 1024
    return RunManifest(name=name).replace(
        model={
            "hidden_size": hidden,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "intermediate_size": intermediate,
            "max_seq_len": 2 * seq,
        },
        data={
            "seq_len_tokens": seq,
            "tokenizer": "bpe",
            "vocab_size": 16384,
            "tokenizer_sha256": STDLIB_BPE_16384_SHA256,
            "validation_sequences": 64,
        },
        inner_optimizer={
            "lr": lr,
            "warmup_steps": 500,
            "decay_steps": 50_000,
            "batch_size_tokens": batch_sequences * seq,
        },
        sync={"inner_steps": 100, "allreduce_timeout_s": allreduce_timeout_s},
        compression={"codec": "int8", "residual_dtype": "bf16"},
    )


def llama_125m_run() -> RunManifest:
    """~125M parameters (SmolLM-135M's shape: hidden 576, 30 layers, 9 heads of 64, 3 KV heads,
    SwiGLU 1,536): 106M in the blocks plus 19M in the untied 16,384-id embedding and output layer.
    64 sequences of 1,024 tokens per inner step. Memory per micro-batch: docs/architecture.md."""
    return _llama_run(
        "llama-125m",
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        intermediate=1536,
        batch_sequences=64,
        lr=6e-4,
        allreduce_timeout_s=120.0,
    )


def llama_350m_run() -> RunManifest:
    """~350M parameters (SmolLM-360M's shape: hidden 960, 32 layers, 15 heads of 64, 5 KV heads,
    SwiGLU 2,560): 315M in the blocks plus 31M in the embedding and output layer."""
    return _llama_run(
        "llama-350m",
        hidden=960,
        layers=32,
        heads=15,
        kv_heads=5,
        intermediate=2560,
        batch_sequences=64,
        lr=4e-4,
        allreduce_timeout_s=300.0,
    )


def llama_1b_run() -> RunManifest:
    """~1B parameters (TinyLlama-1.1B's shape: hidden 2,048, 22 layers, 32 heads of 64, 4 KV heads,
    SwiGLU 5,632): 969M in the blocks plus 67M in the embedding and output layer. Needs a 24 GiB
    card for fp32 master weights and AdamW (16 bytes per parameter) plus activations."""
    return _llama_run(
        "llama-1b",
        hidden=2048,
        layers=22,
        heads=32,
        kv_heads=4,
        intermediate=5632,
        batch_sequences=128,
        lr=3e-4,
        allreduce_timeout_s=600.0,
    )


PRESETS = {
    "default": default_run,
    "tiny": tiny_run,
    "llama-125m": llama_125m_run,
    "llama-350m": llama_350m_run,
    "llama-1b": llama_1b_run,
}
"""Named runs for ``--preset``; a run file names the same values in its [model] section."""
