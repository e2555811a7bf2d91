"""The model: a Llama-style causal LM built with transformers from the manifest's config."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from peer.train.tokenizer import Tokenizer, byte_tokenizer
from protocol.manifest import ModelSpec

logger = logging.getLogger(__name__)


def build_model(spec: ModelSpec, tokenizer: Tokenizer | None = None) -> torch.nn.Module:
    """A freshly initialised fp32 LlamaForCausalLM; identical on every peer (seeded by ``init_seed``).

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
    )
    saved_rng_state = torch.random.get_rng_state()
    torch.manual_seed(spec.init_seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(saved_rng_state)
    return model.float()


def lm_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over a batch.

    Args:
        windows: int64 tensor (batch, seq_len + 1); inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    """
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_sequences: int = 16) -> float:
    """Mean validation loss in nats per token over ``windows`` (see :func:`lm_loss`)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, windows.shape[0], batch_sequences):
            chunk = windows[start:start + batch_sequences]
            total += lm_loss(model, chunk).item() * chunk.shape[0]
            count += chunk.shape[0]
    finally:
        model.train(was_training)
    return total / count


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
