"""Upstage's Solar Open (``SolarOpenForCausalLM``: Solar-Open-100B), as transformers models it:
GLM-4.5's mixture of experts on every layer under Llama's attention.

- Attention: GQA with q/k/v biases per ``attention_bias`` and none on the output projection,
  no q/k norms, RoPE over whole heads (a ``partial_rotary_factor`` other than 1 is refused:
  transformers' Solar Open cannot run one either).
- MLP: every layer the MoE block of :func:`mrv2_glm.model.glm4_moe_block`: sigmoid scores
  steered by ``e_score_correction_bias``, group-limited over ``n_group`` / ``topk_group``,
  renormalized per ``norm_topk_prob``, times ``routed_scaling_factor``, over
  ``n_routed_experts`` experts of ``moe_intermediate_size``, plus ``n_shared_experts`` shared
  experts (one SwiGLU MLP). No dense layers and no multi-token-prediction layers.
- Checkpoints: experts per expert (as transformers saves them) or stacked
  (``experts.gate_up_proj`` / ``experts.down_proj``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2_glm.model import glm4_moe_block, partial_rotary_factor_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "SolarOpenForCausalLM"


def validate_solar_open_config(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a Solar Open model this
    plugin runs (before anything is built; the router checks its group sizes itself)."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{ARCH}: config.{field} = {getattr(config, field, None)!r}: "
                             f"{what}")

    need(config.hidden_act == "silu", "hidden_act", "the experts support 'silu' only")
    need(config.num_attention_heads % config.num_key_value_heads == 0, "num_key_value_heads",
         f"must divide num_attention_heads ({config.num_attention_heads})")
    need(int(config.n_routed_experts or 0) >= 1, "n_routed_experts", "must be at least 1")
    need(int(config.n_shared_experts or 0) >= 0, "n_shared_experts", "must be >= 0")
    factor = partial_rotary_factor_of(config)
    if factor != 1.0:
        raise ValueError(f"{ARCH}: config.partial_rotary_factor = {factor!r}: Solar Open "
                         "rotates whole heads (transformers' attention fails on any other "
                         "factor)")


def solar_open_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                     ) -> DecoderLayer:
    """Layer ``layer_idx``: Llama's attention, then GLM-4.5's MoE block."""
    attn = SelfAttention(config, layer_idx, rope,
                         qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False)
    return DecoderLayer(config, attn, glm4_moe_block(config))


class SolarOpenForCausalLM(CausalLM):
    """Solar Open causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_solar_open_config(config)
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, DecoderModel(config, lambda i: solar_open_layer(config, i,
                                                                                 rope)))
