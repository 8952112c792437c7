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

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    PostNormDecoderLayer,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", False))

        def layer(i: int) -> PostNormDecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias,
                                      qk_norm="projection")
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return PostNormDecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))
