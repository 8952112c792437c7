"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: MiniMax-M2 / M2.1, 230B with 10B active): a pre-norm
decoder of full-attention layers whose query and key projections are RMS-normalized over all
their heads at once (the core's ``SelfAttention(qk_norm="projection")``, all-reduced under
tensor parallelism), with partial rotary dimensions, and in every layer a mixture of experts:
sigmoid scores, an ``e_score_correction_bias`` added for the choice of the top-k only, the
picked scores renormalized (the core's :class:`~mrv2.layers.moe.GroupedTopKRouter` with one
group), SwiGLU experts, no shared expert.

Checkpoints: the published ones (block-FP8 with 128 x 128 blocks, which the core loads as it
loads DeepSeek's) name the MoE block ``block_sparse_moe`` with Mixtral's per-expert
``w1`` / ``w3`` / ``w2`` and the correction bias on the block; transformers names the block
``mlp``. Both load. Their multi-token-prediction modules (layers numbered past
``num_hidden_layers``) are not loaded: no MTP speculator drafts with them yet.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GroupedTopKRouter,
    MoEBlock,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MiniMaxM2ForCausalLM(CausalLM):
    """MiniMax-M2 causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        head_dim = head_dim_of(config)
        rotary_dim = getattr(config, "rotary_dim", None)
        params = getattr(config, "rope_parameters", None) or {}
        if rotary_dim and "partial_rotary_factor" not in params and not getattr(
                config, "partial_rotary_factor", None):  # the released configs' own field
            config.partial_rotary_factor = int(rotary_dim) / head_dim
        scoring = str(getattr(config, "scoring_func", "sigmoid"))
        if scoring != "sigmoid":
            raise ValueError(f"MiniMax-M2: scoring_func must be 'sigmoid', got {scoring!r}")
        if config.hidden_act != "silu":
            raise ValueError(f"MiniMax-M2 experts support hidden_act 'silu' only, got "
                             f"{config.hidden_act!r}")
        rope = get_rope(config, head_dim)
        experts, top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        bias = bool(getattr(config, "use_routing_bias", True))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qk_norm="projection")
            router = GroupedTopKRouter(config.hidden_size, experts, top_k, renormalize=True,
                                       scoring="sigmoid", correction_bias=bias)
            moe = FusedMoE(experts, config.hidden_size, config.intermediate_size)
            return DecoderLayer(config, attention, MoEBlock(router, moe))

        super().__init__(config, DecoderModel(config, layer))
        self.num_layers = int(config.num_hidden_layers)

    def rename(self, name: str) -> str | None:
        """The published names (``block_sparse_moe``, the correction bias on the block) as
        the model's; the MTP modules' layers skipped."""
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= self.num_layers:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".mlp.e_score_correction_bias"):
            name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super().rename(name)
