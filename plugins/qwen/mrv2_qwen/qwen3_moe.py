"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention,
and in the MLP's place a softmax top-k routed mixture of experts with no shared expert.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
is non-zero; those layers keep a dense MLP of ``intermediate_size``. Experts are
``moe_intermediate_size`` wide; ``norm_topk_prob`` renormalizes the picked weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    MoEBlock,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
)
from mrv2.layers.moe import is_sparse_layer
from mrv2_qwen.model import qwen3_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def qwen3_moe_block(config: PretrainedConfig) -> MoEBlock:
    """Softmax top-k router ``gate`` and the routed ``experts``."""
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3-MoE experts support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")
    router = SoftmaxTopKRouter(config.hidden_size, config.num_experts,
                               config.num_experts_per_tok, bool(config.norm_topk_prob))
    experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    return MoEBlock(router, experts)


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
