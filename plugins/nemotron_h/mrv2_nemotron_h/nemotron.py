"""NVIDIA Nemotron-4 / Minitron (``NemotronForCausalLM``: Nemotron-4 15B / 340B, Minitron
4B / 8B, Nemotron-Mini-4B), the dense forerunner of Nemotron-H.

Llama's pre-norm layers with three changes, each a core layer's option:

- every norm (the two per layer and the final one) is HF's ``NemotronLayerNorm1P``: a
  LayerNorm with bias whose scale is ``1 + weight`` (the core's
  :class:`~mrv2.layers.LayerNorm` with ``weight_offset=1``: the one added as the weight
  loads, in the parameter's dtype, as HF adds it to its own parameter), eps ``norm_eps``;
- the MLP is dense, ``down_proj(relu2(up_proj(x)))`` (:class:`~mrv2.layers.DenseMLP`,
  biases per ``mlp_bias``);
- RoPE turns the first ``head_dim * partial_rotary_factor`` dims of each head (0.5 by
  default), the rest pass through (:func:`~mrv2.layers.get_rope`).

q/k/v/o biases per ``attention_bias``; the head is untied unless ``tie_word_embeddings``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    LayerNorm,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mrv2.layers.weights import StackedMapping


class NemotronForCausalLM(CausalLM):
    """Nemotron-4 / Minitron in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS  # (up_proj stands alone)

    def __init__(self, config: PretrainedConfig) -> None:
        hidden, eps = int(config.hidden_size), float(config.norm_eps)
        rope = get_rope(config, head_dim_of(config))
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps, weight_offset=1.0)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=attn_bias, o_bias=attn_bias)
            mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act, bias=mlp_bias)
            return DecoderLayer(config, attention, mlp, norm=norm)

        super().__init__(config, DecoderModel(config, layer, norm=norm))
