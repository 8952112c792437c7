"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention,
and in the MLP's place a softmax top-k routed mixture of experts with no shared expert; and
Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
(q/k/v biased per ``qkv_bias``) and the same experts plus a shared expert of
``shared_expert_intermediate_size`` scaled per token by ``sigmoid(shared_expert_gate(x))``.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
is non-zero; those layers keep a dense MLP of ``intermediate_size``. Experts are
``moe_intermediate_size`` wide; ``norm_topk_prob`` renormalizes the picked weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    MoEBlock,
    SelfAttention,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
)
from mrv2.layers.moe import is_sparse_layer
from mrv2_qwen.model import qwen3_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen3_moe_block(config: PretrainedConfig, shared: bool = False) -> MoEBlock:
    """Softmax top-k router ``gate`` and the routed ``experts``; ``shared``: plus the gated
    ``shared_experts`` (Qwen2-MoE, where ``shared_expert_intermediate_size`` > 0)."""
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen-MoE experts support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")
    router = SoftmaxTopKRouter(config.hidden_size, config.num_experts,
                               config.num_experts_per_tok, bool(config.norm_topk_prob))
    experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    size = shared_expert_size(config) if shared else 0
    if not size:
        return MoEBlock(router, experts)
    return MoEBlock(router, experts, GatedMLP(config.hidden_size, size, config.hidden_act),
                    shared_expert_gate=True)


def shared_expert_size(config: Any) -> int:
    """``shared_expert_intermediate_size`` (0: none, or the field absent)."""
    return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)


def skip_absent_shared_expert(name: str, config: Any) -> str | None:
    """None for a gated shared expert's ``shared_expert_gate`` where the config sizes the
    expert 0 (HF builds a zero-width expert and its gate anyway, their product 0, and saves
    both: the expert's empty tensors are skipped by the loader, the gate here); else
    ``name``."""
    if ".mlp.shared_expert_gate." in name and not shared_expert_size(config):
        return None
    return name


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE causal LM in the mrv2 model contract: Qwen3 attention, then the MoE block or
    a dense MLP per layer."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            mlp: nn.Module
            if is_sparse_layer(config, i):
                mlp = qwen3_moe_block(config)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, qwen3_attention(config, i, rope), mlp)

        super().__init__(config, DecoderModel(config, layer))


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen2-MoE causal LM (module docstring): Qwen2's attention, then the MoE block with its
    gated shared expert or a dense MLP per layer (HF's ``mlp.shared_expert`` names load into
    ``shared_experts``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "qkv_bias", True))

        def layer(i: int) -> DecoderLayer:
            mlp: nn.Module
            if is_sparse_layer(config, i):
                mlp = qwen3_moe_block(config, shared=True)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, SelfAttention(config, i, rope, qkv_bias=bias), mlp)

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        if skip_absent_shared_expert(name, self.config) is None:
            return None
        return super().rename(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
