"""OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): post-norm decoders. Each
block's output is normalized before it joins the residual stream (``post_attention_layernorm``,
``post_feedforward_layernorm``; there are no pre-norms), and the query and key projections are
RMS-normalized over all their heads at once (``q_norm`` over ``num_heads * head_dim``
features, not per head) before RoPE.

OLMo 3 adds local layers: ``config.layer_types`` marks most layers ``sliding_attention`` (a
query sees its last ``sliding_window`` keys, its own included: the core's
:class:`~mrv2.layers.Attention` ``sliding_window``) and every fourth ``full_attention``, and
each kind has its own RoPE (``rope_parameters[kind]``: a long-context checkpoint's YaRN
scaling is on the full-attention layers only, as HF and vLLM apply it).

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
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PretrainedConfig

#: The layer types OLMo 3's ``config.layer_types`` may hold.
LAYER_TYPES = ("sliding_attention", "full_attention")


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, olmo_decoder(config, lambda i: rope))


class Olmo3ForCausalLM(CausalLM):
    """OLMo 3 in the mrv2 model contract: OLMo 2's layers, local (sliding-window) and global
    per ``config.layer_types``, each kind with its RoPE (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"config.json layer_types must give each of the "
                             f"{config.num_hidden_layers} layers one of {', '.join(LAYER_TYPES)};"
                             f" got {types}")
        head_dim = head_dim_of(config)
        ropes = {kind: get_rope(config, head_dim, kind) for kind in set(types)}
        super().__init__(config, olmo_decoder(config, lambda i: ropes[types[i]]))


def olmo_decoder(config: PretrainedConfig, rope_of: Callable[[int], RotaryEmbedding]
                 ) -> DecoderModel:
    """The post-norm layer stack of OLMo 2 / 3: layer ``i`` rotates with ``rope_of(i)`` and
    attends over the config's sliding window where its layer type is local
    (:func:`mrv2.layers.sliding_window_of`, inside :class:`~mrv2.layers.SelfAttention`)."""
    bias = bool(getattr(config, "attention_bias", False))

    def layer(i: int) -> PostNormDecoderLayer:
        attention = SelfAttention(config, i, rope_of(i), qkv_bias=bias, o_bias=bias,
                                  qk_norm="projection")
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return PostNormDecoderLayer(config, attention, mlp)

    return DecoderModel(config, layer)
