"""Arcee's AFMoE (``AfmoeForCausalLM``: Trinity Mini / Nano / Large), as transformers models it:
DeepSeek-V3's sigmoid router (one group) and shared experts under gated, sandwich-normed
attention.

- Blocks: four norms each (as Gemma 2's): ``input_layernorm`` before the attention,
  ``post_attention_layernorm`` on its output before the residual add, ``pre_mlp_layernorm``
  before the MLP and ``post_mlp_layernorm`` on its output before the residual add.
- Attention: per-head q/k RMSNorms; the layers ``layer_types`` calls ``sliding_attention``
  attend over ``sliding_window`` with RoPE, the others over everything with no positional
  encoding (NoPE); the output is gated per channel, ``o_proj(attn * sigmoid(gate_proj(x)))``
  (``gate_proj``: ``hidden -> heads * head_dim``, no bias); projections biased per
  ``attention_bias``.
- MLP: layers below ``num_dense_layers`` a dense SwiGLU MLP of ``intermediate_size``, the
  others ``num_experts`` SwiGLU experts of ``moe_intermediate_size``: the top
  ``num_experts_per_tok`` of sigmoid scores plus ``expert_bias`` (the choice only), weighted
  by their scores renormalized, times ``route_scale`` (the core's
  :class:`~mrv2.layers.GroupedTopKRouter` with one group), plus one shared SwiGLU MLP of
  ``moe_intermediate_size * num_shared_experts`` that sees every token.
- ``mup_enabled``: the input embeddings times ``sqrt(hidden_size)`` (given embeddings too; a
  tied LM head reads the unscaled table).
- Checkpoints: the attention's ``self_attn.gate_proj`` loads as ``self_attn.output_gate``, the
  router's ``mlp.router.gate.weight`` and ``mlp.expert_bias`` load into the
  core router's ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``; experts per
  expert (as transformers saves them) or stacked (``experts.gate_up_proj`` /
  ``experts.down_proj``).

It lives beside DeepSeek for its router and shared experts, as dots.llm1 does; the gate is the
only part of the attention that is its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    ColumnLinear,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.embedding import ScaledEmbedding
from mrv2_deepseek.model import config_check

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "AfmoeForCausalLM"


def validate_afmoe_config(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not an AFMoE model this plugin
    runs (before anything is built)."""
    need = config_check(config, ARCH)
    need(config.hidden_act == "silu", "hidden_act", "the experts and MLPs support 'silu' only")
    kinds = list(config.layer_types or [])
    need(len(kinds) == config.num_hidden_layers
         and set(kinds) <= {"sliding_attention", "full_attention"}, "layer_types",
         f"must list 'sliding_attention' or 'full_attention' for each of the "
         f"{config.num_hidden_layers} layers")
    need(int(config.num_experts or 0) >= 1, "num_experts", "must be at least 1")
    need(int(config.num_shared_experts or 0) >= 0, "num_shared_experts", "must be >= 0")
    need(int(config.num_dense_layers or 0) >= 0, "num_dense_layers", "must be >= 0")


class AfmoeAttention(SelfAttention):
    """The core's attention (q/k norms, RoPE or none, the window) with AFMoE's output gate
    (this rank's heads' rows of the checkpoint's ``self_attn.gate_proj``, held as
    ``output_gate``: the MLPs' ``gate_proj`` is the fused ``gate_up_proj``'s shard)."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, rope, qkv_bias=bias, o_bias=bias, qk_norm=True)
        self.output_gate = ColumnLinear(config.hidden_size,
                                        config.num_attention_heads * self.head_dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.attention_output(positions, self.qkv_proj(hidden_states))
        gate = cast(torch.Tensor, self.output_gate(hidden_states))
        return cast(torch.Tensor, self.o_proj(out * torch.sigmoid(gate)))


def afmoe_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense, or the routed and shared experts (module docstring)."""
    if layer_idx < int(config.num_dense_layers or 0):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    router = GroupedTopKRouter(
        config.hidden_size, config.num_experts, config.num_experts_per_tok, renormalize=True,
        routed_scaling_factor=float(config.route_scale), scoring="sigmoid")
    experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if config.num_shared_experts:
        shared = GatedMLP(config.hidden_size,
                          config.moe_intermediate_size * config.num_shared_experts,
                          config.hidden_act)
    return MoEBlock(router, experts, shared)


class AfmoeDecoderLayer(nn.Module):
    """Gated attention and an MLP (dense or MoE), each between a pre- and a post-norm (HF's
    names); the residual add fused into the next pre-norm."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                 ) -> None:
        super().__init__()
        local = config.layer_types[layer_idx] == "sliding_attention"
        self.self_attn = AfmoeAttention(config, layer_idx, rope if local else None)
        self.mlp = afmoe_mlp(config, layer_idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_mlp_layernorm = RMSNorm(hidden, eps=eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_mlp_layernorm(attn, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class AfmoeForCausalLM(CausalLM):
    """AFMoE causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_afmoe_config(config)
        rope = get_rope(config, head_dim_of(config))
        model = DecoderModel(config, lambda i: AfmoeDecoderLayer(config, i, rope))
        if getattr(config, "mup_enabled", False):
            model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                 float(config.hidden_size) ** 0.5,
                                                 scales_given=True)
        super().__init__(config, model)

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name: the router's weight and expert bias into the
        core router (module docstring), the attention's gate to ``output_gate``."""
        name = name.replace(".self_attn.gate_proj.", ".self_attn.output_gate.")
        name = name.replace(".mlp.router.gate.weight", ".mlp.gate.weight")
        name = name.replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias")
        return super().rename(name)
