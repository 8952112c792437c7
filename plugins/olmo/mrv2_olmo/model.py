"""OLMo 2 (``Olmo2ForCausalLM``): a post-norm decoder. Each block's output is normalized
before it joins the residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``;
there are no pre-norms), and the query and key projections are RMS-normalized over all their
heads at once (``q_norm`` over ``num_heads * head_dim`` features, not per head) before RoPE.

That whole-projection norm spans the heads tensor parallelism puts on other ranks: under it
each rank normalizes its heads by the mean square all-reduced over every rank's
(:func:`mrv2.layers.projection_norms`, through the core's
``SelfAttention(qk_norm="projection")``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Olmo2DecoderLayer(nn.Module):
    """Attention and MLP, each followed by its norm and then the residual add."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, layer_idx, rope, qkv_bias=bias, o_bias=bias,
                                       qk_norm="projection")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states if residual is None else hidden_states + residual
        attn = cast(torch.Tensor, self.post_attention_layernorm(self.self_attn(positions, x)))
        x = x + attn
        return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(x))), x


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, DecoderModel(config, lambda i: Olmo2DecoderLayer(config, i,
                                                                                   rope)))
