"""Qwen3 dense decoder (``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen3_attention(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                    ) -> SelfAttention:
    """Qwen3's attention: q/k RMSNorm per head; every projection biased per
    ``attention_bias``."""
    bias = bool(getattr(config, "attention_bias", False))
    return SelfAttention(config, layer_idx, rope, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 causal LM in the mrv2 model contract (flat token batch, paged attention)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, qwen3_attention(config, i, rope), mlp)

        super().__init__(config, DecoderModel(config, layer))


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5 causal LM: GQA with biased q/k/v projections, no q/k norm (the text
    decoder of Qwen2.5-VL too)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=True)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))
