"""The model: a Llama-style causal LM built with transformers from the manifest's config."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from peer.train.tokenizer import Tokenizer, byte_tokenizer
from protocol.manifest import ModelSpec

logger = logging.getLogger(__name__)


ATTENTION = "locoswarm_sdpa"
"""transformers' SDPA attention, registered under a name of its own that has no mask function, so
transformers passes no mask and SDPA runs with ``is_causal=True``: the flash kernel on CUDA. Under
torch.compile transformers' "sdpa" materialises a (batch, 1, seq, seq) mask instead (it never skips the
mask while tracing, before torch 2.14), which rules out the flash kernel and computes the whole square.
Valid because every window here is full: no padding, no KV cache."""


def register_attention() -> str:
    """Register :data:`ATTENTION` with transformers in this process and return its name (plain "sdpa"
    where transformers predates ``AttentionInterface``). A process that builds the model from its
    config alone (a spawned rank, peer/train/ddp.py) calls it first."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return "sdpa"
    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    return ATTENTION


def build_model(spec: ModelSpec, tokenizer: Tokenizer | None = None) -> torch.nn.Module:
    """A freshly initialised fp32 LlamaForCausalLM on the host; identical on every peer (seeded by
    ``init_seed``), whatever device it then moves to. Attention runs through PyTorch's SDPA, causal
    without a mask (:data:`ATTENTION`).

    No weights are downloaded: the model is built from a config.

    Args:
        tokenizer: the run's tokenizer (``Corpus.tokenizer``); its ``vocab_size`` rows make the
            embedding and output layer. Default: the byte-level tokenizer (259 ids).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or byte_tokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_seq_len,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        tie_word_embeddings=False,
        use_cache=False,
        # through PreTrainedConfig's **kwargs, which transformers 5's typed LlamaConfig signature leaves out
        attn_implementation=register_attention(),  # type: ignore[call-arg]
    )
    saved_rng_state = torch.random.get_rng_state()
    torch.manual_seed(spec.init_seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(saved_rng_state)
    return model.float()


def lm_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over a batch, a 0-d fp32 tensor on the model's device
    (the logits are cast to fp32 first, so an autocast forward still gets an fp32 loss).

    Args:
        windows: int64 tensor (batch, seq_len + 1) on the model's device; inputs are ``[:, :-1]``,
            targets ``[:, 1:]``.
    """
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_sequences: int = 16) -> float:
    """Mean validation loss in nats per token over ``windows`` (see :func:`lm_loss`), in fp32.

    Args:
        windows: int64 tensor (sequences, seq_len + 1) on the host; moved to the model's device in
            chunks of ``batch_sequences``.
    """
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, windows.shape[0], batch_sequences):
            chunk = windows[start : start + batch_sequences].to(device)
            total += lm_loss(model, chunk).item() * chunk.shape[0]
            count += chunk.shape[0]
    finally:
        model.train(was_training)
    return total / count


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def embedding_parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the input embedding (a lookup: no FLOPs in the MFU count); 0 for a pipeline
    stage without it (peer/pipeline/stages.py)."""
    # a transformers model's or a stage's method: torch types an nn.Module's unknown attributes as Tensor | Module
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    return 0 if embeddings is None else embeddings.weight.numel()


def spec_parameter_count(spec: ModelSpec, vocab_size: int) -> int:
    """Parameters of :func:`build_model`'s model, from the spec alone (no model is built).

    Args:
        vocab_size: the tokenizer's ids (259 for bytes, ``data.vocab_size`` for BPE).
    """
    h, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    attention = 2 * h * spec.num_heads * head_dim + 2 * h * spec.num_kv_heads * head_dim
    block = attention + 3 * h * spec.intermediate_size + 2 * h  # q, o, k, v; gate, up, down; two RMSNorms
    return spec.num_layers * block + h + 2 * vocab_size * h  # final norm, untied embedding and output layer
