"""rednote's dots.llm1 (``Dots1ForCausalLM``: dots.llm1.base / dots.llm1.inst, 142B-A14B), as
transformers models it: DeepSeek-V3's mixture of experts under plain GQA attention.

- Attention: no multi-head latent attention: GQA with Qwen3's per-head q/k RMSNorm before a
  whole-head neox RoPE, all four projections biased per ``attention_bias`` (the core's
  :class:`~mrv2.layers.SelfAttention` with ``qk_norm=True``); sliding-window layers where
  ``layer_types`` says so (transformers derives them from ``sliding_window`` and
  ``max_window_layers``; the published configs have none).
- MLP: DeepSeek-V3's (:func:`mrv2_deepseek.model.deepseek_mlp`): layers ``<
  first_k_dense_replace`` dense SwiGLU MLPs of ``intermediate_size``, the others
  ``n_routed_experts`` experts of ``moe_intermediate_size`` routed by the "noaux_tc" router
  (sigmoid scores, ``e_score_correction_bias`` steering the choice only, group-limited top-k
  over ``n_group`` / ``topk_group``, renormalized per ``norm_topk_prob``, times
  ``routed_scaling_factor``), plus one shared SwiGLU MLP of ``moe_intermediate_size *
  n_shared_experts`` that sees every token (not scaled: vLLM's ``Dots1MoE`` scales the shared
  experts' output by ``routed_scaling_factor`` too, transformers does not; this follows
  transformers). As transformers, the router is always sigmoid-scored with a correction bias
  whatever ``scoring_func`` / ``topk_method`` a config names.
- Tensor parallelism: heads split by the core's attention, the experts' intermediate
  dimension and the MLPs' split as DeepSeek's.
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
from mrv2_deepseek.model import check_moe_config, config_check, deepseek_mlp

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "Dots1ForCausalLM"


def validate_dots1_config(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a dots.llm1 model this
    plugin runs (before anything is built)."""
    need = config_check(config, ARCH)
    need(config.hidden_act == "silu", "hidden_act", "the experts and MLPs support 'silu' only")
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    need(kv_heads >= 1 and heads % kv_heads == 0, "num_key_value_heads",
         f"must divide num_attention_heads ({heads})")
    check_moe_config(config, ARCH)


def dots1_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                ) -> DecoderLayer:
    """Layer ``layer_idx``: Qwen3-style attention, then DeepSeek-V3's dense MLP or MoE block."""
    bias = bool(getattr(config, "attention_bias", False))
    attention = SelfAttention(config, layer_idx, rope, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return DecoderLayer(config, attention, deepseek_mlp(config, layer_idx, v3=True))


class Dots1ForCausalLM(CausalLM):
    """dots.llm1 causal LM in the mrv2 model contract (module docstring); the checkpoints'
    names are transformers' (per-expert ``mlp.experts.{e}.gate_proj`` ..., the router's
    ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``), loaded as they are."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_dots1_config(config)
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, DecoderModel(config, lambda i: dots1_layer(config, i, rope)))
