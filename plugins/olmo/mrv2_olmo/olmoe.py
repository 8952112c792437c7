"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): pre-norm layers (``input_layernorm``,
``post_attention_layernorm``, as Llama's) whose attention normalizes the query and key
projections over all their heads at once, as OLMo 2's (``qk_norm="projection"``, all-reduced
under tensor parallelism), and whose MLP is a mixture of ``num_experts`` SwiGLU experts of
``intermediate_size``: a softmax router picks ``num_experts_per_tok`` per token, their
weights renormalized to sum to 1 where ``norm_topk_prob`` says so; no shared expert. The
config's ``sliding_window``, where one is set, applies to every layer (as HF's).

HF's ``clip_qkv`` (clamping q, k and v) is refused: no published OLMoE checkpoint sets it.

FlexOlmo (``FlexOlmoForCausalLM``: FlexOlmo-7x7B-1T and its RT variant) puts OLMoE's experts
in OLMo 2's post-norm layers: attention, ``post_attention_layernorm``, residual add; experts,
``post_feedforward_layernorm``, residual add (no pre-norms; q/k norms over whole
projections); the router as OLMoE's (softmax top-``num_experts_per_tok``, renormalized per
``norm_topk_prob``: false in the published checkpoints).
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
from mrv2_olmo.model import olmo_decoder

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def olmoe_block(config: PretrainedConfig) -> MoEBlock:
    """The softmax top-k router ``gate`` and the routed ``experts`` (HF's ``mlp.*`` names)."""
    router = SoftmaxTopKRouter(config.hidden_size, config.num_experts,
                               config.num_experts_per_tok, bool(config.norm_topk_prob))
    return MoEBlock(router, FusedMoE(config.num_experts, config.hidden_size,
                                     config.intermediate_size))


def check_olmoe_config(config: PretrainedConfig) -> None:
    """ValueError naming the field for what OLMoE's and FlexOlmo's layers here cannot run:
    ``clip_qkv``, experts other than SwiGLU."""
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"config.json clip_qkv = {config.clip_qkv!r}: clamping q, k and v "
                         "is not supported (OLMoE's published checkpoints set it to null)")
    if config.hidden_act != "silu":
        raise ValueError(f"OLMoE experts support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")


class OlmoeForCausalLM(CausalLM):
    """OLMoE in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        check_olmoe_config(config)
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", False))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias,
                                      qk_norm="projection")
            return DecoderLayer(config, attention, olmoe_block(config))

        super().__init__(config, DecoderModel(config, layer))


class FlexOlmoForCausalLM(CausalLM):
    """FlexOlmo in the mrv2 model contract: OLMo 2's post-norm layers with OLMoE's experts
    (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        check_olmoe_config(config)
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, olmo_decoder(config, lambda i: rope,
                                              lambda: olmoe_block(config)))
