"""Mixtral (``MixtralForCausalLM``: Mixtral 8x7B, 8x22B): Mistral's attention (Llama's, the
config's sliding window where it is set), and in every MLP's place a softmax top-k routed
mixture of ``num_local_experts`` SwiGLU experts, the picked weights renormalized.

Published checkpoints name the block ``block_sparse_moe`` and the experts' projections
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 saves ``mlp``: both load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    MoEBlock,
    SelfAttention,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralForCausalLM(CausalLM):
    """Mixtral causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"config.json hidden_act = {config.hidden_act!r}: Mixtral's "
                             "experts support 'silu' only")
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            router = SoftmaxTopKRouter(config.hidden_size, config.num_local_experts,
                                       config.num_experts_per_tok, renormalize=True)
            experts = FusedMoE(config.num_local_experts, config.hidden_size,
                               config.intermediate_size)
            return DecoderLayer(config, SelfAttention(config, i, rope), MoEBlock(router, experts))

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        """The published ``block_sparse_moe`` block as transformers 5's ``mlp``."""
        return super().rename(name.replace(".block_sparse_moe.", ".mlp."))
