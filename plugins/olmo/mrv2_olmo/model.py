"""OLMo 2 (``Olmo2ForCausalLM``): a post-norm decoder. Each block's output is normalized
before it joins the residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``;
there are no pre-norms), and the query and key projections are RMS-normalized over all their
heads at once (``q_norm`` over ``num_heads * head_dim`` features, not per head) before RoPE.

That whole-projection norm spans the heads tensor parallelism puts on other ranks: under it
each rank normalizes its heads by the mean square all-reduced over every rank's
(:func:`mrv2.layers.projection_norms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from mrv2.layers import (
    Attention,
    CausalLM,
    DecoderModel,
    GatedMLP,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    get_rope,
    head_dim_of,
    projection_norms,
    sliding_window_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Olmo2Attention(nn.Module):
    """QKV projection, q/k RMSNorm over the whole projections, RoPE, paged attention, output
    projection (HF's ``self_attn.*`` names)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm, self.k_norm = projection_norms(self.qkv_proj, config.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(  # this rank's heads
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim**-0.5,
            layer_idx, sliding_window=sliding_window_of(config, layer_idx))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q, k = cast(torch.Tensor, self.q_norm(q)), cast(torch.Tensor, self.k_norm(k))
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        return cast(torch.Tensor, self.o_proj(out))


class Olmo2DecoderLayer(nn.Module):
    """Attention and MLP, each followed by its norm and then the residual add."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx, rope)
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
