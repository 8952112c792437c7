"""K-EXAONE (``ExaoneMoeForCausalLM``: LG K-EXAONE 236B-A23B), as transformers models it.

- Blocks: pre-norm (``input_layernorm``, ``post_attention_layernorm``; unlike EXAONE 4's
  post-norms), the core's :class:`~mrv2.layers.DecoderLayer`.
- Attention: EXAONE 4's: per-head q/k RMSNorms; where the config sets a ``sliding_window``,
  the layers ``layer_types`` calls ``sliding_attention`` attend over the window with RoPE and
  the global ones use no positional encoding (NoPE); without a window every layer is global
  with RoPE.
- MLP: ``mlp_layer_types`` (``first_k_dense_replace`` when absent) picks per layer a dense
  SwiGLU MLP of ``intermediate_size`` or DeepSeek-V3's MoE: ``num_experts`` experts of
  ``moe_intermediate_size`` routed by sigmoid scores whose choice ``e_score_correction_bias``
  steers, group-limited over ``n_group`` / ``topk_group`` (a group's score: its two best),
  renormalized per ``norm_topk_prob``, times ``routed_scaling_factor``
  (:class:`~mrv2.layers.GroupedTopKRouter`), plus one shared SwiGLU MLP of
  ``moe_intermediate_size * num_shared_experts`` that sees every token.
- Checkpoints: the router's correction bias as the released ones name it
  (``mlp.e_score_correction_bias``) or as transformers holds it
  (``mlp.gate.e_score_correction_bias``); experts per expert or stacked
  (``experts.gate_up_proj`` / ``experts.down_proj``); the multi-token-prediction layers
  (``mtp.*``) are skipped. A ``swiglu_limits`` list in the config is ignored, as transformers
  ignores it.
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
    GroupedTopKRouter,
    MoEBlock,
    SelfAttention,
    get_rope,
    head_dim_of,
    sliding_window_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "ExaoneMoeForCausalLM"


def _need(config: Any, ok: bool, field: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{ARCH}: config.{field} = {getattr(config, field, None)!r}: {what}")


def validate_exaone_moe_config(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a K-EXAONE model this
    plugin runs (before anything is built)."""
    _need(config, config.hidden_act == "silu", "hidden_act",
          "the experts and MLPs support 'silu' only")
    kinds = list(getattr(config, "mlp_layer_types", None) or [])
    _need(config, len(kinds) == config.num_hidden_layers
          and set(kinds) <= {"dense", "sparse"}, "mlp_layer_types",
          f"must list 'dense' or 'sparse' for each of the {config.num_hidden_layers} layers")
    _need(config, int(config.num_experts or 0) >= 1, "num_experts", "must be at least 1")
    _need(config, int(config.num_shared_experts or 0) >= 0, "num_shared_experts",
          "must be >= 0")


def exaone_moe_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense, or the routed and shared experts (module docstring)."""
    if config.mlp_layer_types[layer_idx] != "sparse":
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    router = GroupedTopKRouter(
        config.hidden_size, config.num_experts, config.num_experts_per_tok,
        n_group=int(config.n_group or 1), topk_group=int(config.topk_group or 1),
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor), scoring="sigmoid")
    experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if config.num_shared_experts:
        shared = GatedMLP(config.hidden_size,
                          config.moe_intermediate_size * config.num_shared_experts,
                          config.hidden_act)
    return MoEBlock(router, experts, shared)


class ExaoneMoeForCausalLM(CausalLM):
    """K-EXAONE in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_exaone_moe_config(config)
        rope = get_rope(config, head_dim_of(config))
        windowed = getattr(config, "sliding_window", None) is not None

        def layer(i: int) -> DecoderLayer:
            local = sliding_window_of(config, i) is not None
            attention = SelfAttention(config, i, rope if local or not windowed else None,
                                      qk_norm=True)
            return DecoderLayer(config, attention, exaone_moe_mlp(config, i))

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name: the released checkpoints' router bias under the
        router; None for the multi-token-prediction layers."""
        if name.startswith(("mtp.", "model.mtp.")):
            return None
        if name.endswith(".mlp.e_score_correction_bias"):
            name = name.replace(".mlp.e_score_correction_bias",
                                ".mlp.gate.e_score_correction_bias")
        return super().rename(name)
