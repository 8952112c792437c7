"""IBM Granite 3.x (``GraniteForCausalLM``): Llama's layers with four scalars from the
config: the token embeddings times ``embedding_multiplier``, the scores scaled by
``attention_multiplier`` (in place of ``head_dim ** -0.5``), each block's output times
``residual_multiplier`` before it joins the residual stream, and the logits divided by
``logits_scaling``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_linear,
)
from mrv2.layers.decoder import norm_mlp
from mrv2.layers.embedding import ScaledEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer, each block's output times ``residual_multiplier``."""

    def __init__(self, config: PretrainedConfig, attn: SelfAttention, mlp: GatedMLP) -> None:
        super().__init__(config, attn, mlp)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                    hidden_states, residual)
        attn = self.self_attn.attend(positions, qkv) * self.residual_multiplier
        out, residual = norm_mlp(self.post_attention_layernorm, self.mlp, attn, residual)
        return out * self.residual_multiplier, residual


class GraniteForCausalLM(CausalLM):
    """Granite causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def layer(i: int) -> GraniteDecoderLayer:
            attn = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias,
                                 scale=float(config.attention_multiplier))
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return GraniteDecoderLayer(config, attn, mlp)

        model = DecoderModel(config, layer)
        model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                             float(config.embedding_multiplier),
                                             scales_given=True)  # (HF scales inputs_embeds)
        super().__init__(config, model)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling
