"""One pipeline stage of the run's Llama model: a contiguous run of its transformer blocks.

Stage 0 also holds the token embedding, the last stage the final RMSNorm and the output layer, so
chaining stages 0..S-1 computes exactly the unsplit model of :func:`peer.train.model.build_model`
(SWARM parallelism, arXiv 2301.11913; DiLoCoX, arXiv 2506.21263). A stage's parameters keep the
full model's names ("model.layers.3.mlp.up_proj.weight"), so its state dict is a slice of the full
model's and checkpoints of the stages can be matched to it by name.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from peer.train.model import build_model
from peer.train.tokenizer import Tokenizer
from protocol.manifest import ModelSpec

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Parameter names inside one LlamaDecoderLayer, in its named_parameters() order (no biases: the
# config leaves attention_bias and mlp_bias off). The tests check them against a built model.
_BLOCK_PARAMETERS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The transformer blocks of each stage: contiguous, each block in exactly one stage.

    Stage sizes differ by at most one. When ``num_layers`` is not a multiple of ``stages``, the
    first ``num_layers % stages`` stages hold one block more, so the last stage, which also runs
    the output layer and the loss (the costliest part outside the blocks), never holds an extra one.

    Returns:
        ``stages`` ranges of block indices, in stage order; e.g. (10, 4) gives
        ``[range(0, 3), range(3, 6), range(6, 8), range(8, 10)]``.

    Raises:
        ValueError: ``num_layers < 1``, or ``stages`` outside ``[1, num_layers]``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers = {num_layers}: must be at least 1")
    if not 1 <= stages <= num_layers:
        raise ValueError(
            f"stages = {stages}: must be in [1, {num_layers}] (num_layers = {num_layers}; "
            "a stage holds at least one whole block)"
        )
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for k in range(stages):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


def _check_index(stages: int, index: int) -> None:
    if not 0 <= index < stages:
        raise ValueError(f"stage index = {index}: must be in [0, {stages - 1}] (stages = {stages})")


def stage_parameter_names(num_layers: int, stages: int, index: int) -> list[str]:
    """The full model's names of stage ``index``'s parameters, in ``named_parameters()`` order.

    Over ``index = 0..stages-1`` the name lists partition the unsplit model's parameter names;
    they equal ``[n for n, _ in build_stage(spec, stages, index).named_parameters()]``.

    Raises:
        ValueError: ``stages`` invalid for ``num_layers`` (see :func:`stage_layers`), or ``index``
            outside ``[0, stages)``.
    """
    layers = stage_layers(num_layers, stages)
    _check_index(stages, index)
    names = ["model.embed_tokens.weight"] if index == 0 else []
    names += [f"model.layers.{i}.{p}" for i in layers[index] for p in _BLOCK_PARAMETERS]
    if index == stages - 1:
        names += ["model.norm.weight", "lm_head.weight"]
    return names


class PipelineStage(torch.nn.Module):
    """Stage ``index`` of ``stages`` of a transformers ``LlamaForCausalLM``.

    Holds only its own parameters (see the module docstring), named as in the full model, plus the
    model's rotary embedding (buffers only), so every stage computes cos/sin for positions 0..T-1
    itself. Attention is causal, as in the full model. Move it with ``.to(device)`` like any module.

    Attributes:
        index: this stage, ``0 <= index < stages``.
        stages: number of stages the model is split into.
        is_first / is_last: whether it takes token ids / returns logits (both when ``stages == 1``).
        layers: the range of the full model's block indices this stage holds.
    """

    def __init__(self, model: torch.nn.Module, stages: int, index: int) -> None:
        """Take stage ``index``'s parts out of ``model`` (a LlamaForCausalLM, shared, not copied).

        Raises:
            ValueError: ``stages`` invalid for the model's layer count, or ``index`` outside
                ``[0, stages)``.
        """
        super().__init__()
        model = cast("LlamaForCausalLM", model)
        self.config = model.config
        self.layers = stage_layers(self.config.num_hidden_layers, stages)[index]
        _check_index(stages, index)
        self.index, self.stages = index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        # A bare "model" submodule with a ModuleDict keyed by block index keeps the full model's
        # parameter names, so state dicts of stages and of the full model match key for key.
        # (Any: torch types the attributes set on a bare Module as Tensor | Module)
        self.model: Any = torch.nn.Module()
        if self.is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = torch.nn.ModuleDict({str(i): model.model.layers[i] for i in self.layers})
        if self.is_last:
            self.model.norm = model.model.norm
        self.model.rotary_emb = model.model.rotary_emb
        if self.is_last:
            self.lm_head = model.lm_head

    def get_input_embeddings(self) -> torch.nn.Module | None:
        """The token embedding (stage 0), or None (as transformers models name it)."""
        return self.model.embed_tokens if self.is_first else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage on one batch.

        Args:
            x: stage 0: int64 token ids (batch, seq); other stages: the previous stage's hidden
                states (batch, seq, hidden), any float dtype (cast to this stage's parameter dtype,
                e.g. bf16 activations from the wire into an fp32 stage). On this stage's device.

        Returns:
            The last stage: fp32 logits (batch, seq, vocab). Others: hidden states
            (batch, seq, hidden) in the parameter dtype, for the next stage.

        Raises:
            ValueError: ``x`` has the wrong rank, dtype or hidden size for this stage.
        """
        from transformers.masking_utils import create_causal_mask

        if self.is_first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise ValueError(f"stage 0 takes int64 token ids (batch, seq), got {x.dtype} {tuple(x.shape)}")
            hidden = self.model.embed_tokens(x)
        else:
            if not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != self.config.hidden_size:
                raise ValueError(
                    f"stage {self.index} takes float hidden states (batch, seq, "
                    f"{self.config.hidden_size}), got {x.dtype} {tuple(x.shape)}"
                )
            hidden = x.to(self.model.layers[str(self.layers[0])].input_layernorm.weight.dtype)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # As LlamaModel.forward does: with SDPA and no padding this is None and the attention
        # kernel runs with is_causal=True; other attention implementations get an explicit mask.
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        rope = self.model.rotary_emb(hidden, position_ids=positions)
        for block in self.model.layers.values():
            hidden = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        if not self.is_last:
            return hidden
        return self.lm_head(self.model.norm(hidden)).float()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats, a 0-d fp32 tensor (as :func:`peer.train.model.lm_loss`).

        Args:
            logits: this (last) stage's output (batch, seq, vocab), any float dtype (cast to fp32).
            targets: int64 (batch, seq) on the same device: ``windows[:, 1:]`` when the inputs to
                stage 0 were ``windows[:, :-1]``.

        Raises:
            ValueError: this is not the last stage, or the shapes disagree.
        """
        if not self.is_last:
            raise ValueError(f"loss is computed on the last stage ({self.stages - 1}), not on stage {self.index}")
        if logits.dim() != 3 or logits.shape[:-1] != targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_stage(spec: ModelSpec, stages: int, index: int, tokenizer: Tokenizer | None = None) -> PipelineStage:
    """Stage ``index`` of ``stages`` of the run's seeded fp32 model, on the host.

    Builds the whole model with :func:`build_model` and keeps only this stage's parts, so its
    parameters equal the unsplit model's exactly (every peer of a stage starts from the same φ_0);
    the rest is freed when this returns. Peak host memory is that of the full model.

    Args:
        tokenizer: the run's tokenizer, as for :func:`build_model` (default: byte-level).

    Raises:
        ValueError: ``stages`` outside ``[1, spec.num_layers]`` or ``index`` outside ``[0, stages)``.
    """
    stage_layers(spec.num_layers, stages)
    _check_index(stages, index)
    model = build_model(spec, tokenizer)
    stage = PipelineStage(model, stages, index)
    del model
    return stage
