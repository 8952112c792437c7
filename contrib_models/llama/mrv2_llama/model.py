"""Llama decoder (``LlamaForCausalLM``): GQA, optional attention/MLP biases, Llama 3 RoPE.
ByteDance's Seed-OSS (``SeedOssForCausalLM``) is the same decoder with the output
projection's bias set apart (``attention_out_bias``: q/k/v biased, o not).

Everything but the choices is shared (:mod:`mrv2.layers.decoder`): Llama's attention is
:class:`~mrv2.layers.SelfAttention` with both projections biased per ``attention_bias`` and no
q/k norm, its MLP a :class:`~mrv2.layers.GatedMLP` biased per ``mlp_bias``, in a pre-norm
:class:`~mrv2.layers.DecoderLayer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaForCausalLM(CausalLM):
    """Llama causal LM in the mrv2 model contract (flat token batch, paged attention): the
    shared :class:`~mrv2.layers.CausalLM` (embedding, layers, final norm, LM head, checkpoint
    names) around Llama's decoder layers."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        attention_bias = bool(getattr(config, "attention_bias", False))
        out_bias = bool(getattr(config, "attention_out_bias", attention_bias))  # (Seed-OSS)
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def layer(i: int) -> DecoderLayer:
            attn = SelfAttention(config, i, rope, qkv_bias=attention_bias, o_bias=out_bias)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return DecoderLayer(config, attn, mlp)

        super().__init__(config, DecoderModel(config, layer))


class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3 (HF's 3B): Llama's layers, but the layers ``config.no_rope_layers`` marks 0
    (every fourth) use no positional encoding at all (NoPE); the window of
    ``use_sliding_window`` where set."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        use_rope = list(config.no_rope_layers)

        def layer(i: int) -> DecoderLayer:
            attn = SelfAttention(config, i, rope if use_rope[i] else None,
                                 qkv_bias=attention_bias, o_bias=attention_bias)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return DecoderLayer(config, attn, mlp)

        super().__init__(config, DecoderModel(config, layer))
