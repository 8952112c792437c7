"""Cohere's mixture-of-experts Command model, as HF transformers' ``modeling_cohere2_moe``:
``Cohere2MoeForCausalLM``. Command R7B / A's text stack (:class:`~mrv2_cohere.model._Cohere`:
parallel blocks, interleaved RoPE reordered as it loads, ``logit_scale``) with:

- the MLP of layer ``i`` per ``mlp_layer_types[i]``: ``"dense"`` a gated MLP of
  ``prefix_dense_intermediate_size`` (``intermediate_size`` where unset), ``"sparse"`` the MoE
  block below;
- the MoE block: a router ``mlp.gate`` (no bias) whose ``num_experts_per_tok`` largest logits
  pick the experts, weighted by ``expert_selection_fn``: ``"softmax"`` over the picked logits
  (a softmax over all then renormalized; ``norm_topk_prob`` not read), ``"sigmoid"`` of each
  picked logit, divided by their sum when ``norm_topk_prob``; ``num_experts`` routed SwiGLU
  experts of ``intermediate_size``; with ``num_shared_experts`` > 0 one shared gated MLP of
  ``intermediate_size * num_shared_experts`` seeing every token, combined per
  ``shared_expert_combination_strategy`` (``"sum"``: routed + shared, ``"average"``: their
  half);
- RoPE on the ``sliding_attention`` layers, and on the dense layers too where
  ``prefix_dense_sliding_window_pattern`` is 1 (HF's ``force_rope``); the other full-attention
  layers have no position encoding;
- hidden-state norms: RMSNorms of ``rms_norm_eps`` where it is set, else Cohere's bias-free
  LayerNorms of ``layer_norm_eps``.

Expert weights load from the per-expert names (``mlp.experts.{e}.gate_proj.weight``...) or
transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``
(:mod:`mrv2.layers.moe`); the routed experts shard by columns under tensor parallelism or by
whole experts under expert parallelism, as every :class:`~mrv2.layers.FusedMoE`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mrv2.layers import (
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    LayerNorm,
    MoEBlock,
    RMSNorm,
    SoftmaxTopKRouter,
    sliding_window_of,
)
from mrv2_cohere.model import _Cohere

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: ``expert_selection_fn`` values HF accepts.
SELECTION_FNS = ("softmax", "sigmoid")
#: ``shared_expert_combination_strategy`` values HF accepts.
COMBINATIONS = ("sum", "average")


class CohereMoEBlock(MoEBlock):
    """:class:`~mrv2.layers.MoEBlock` with ``average``: the sum of the routed and shared
    experts halved (HF's ``"average"`` combination; a halving is exact, so it may follow the
    tensor-parallel all-reduce)."""

    def __init__(self, gate: nn.Module, experts: FusedMoE, shared_experts: GatedMLP | None,
                 average: bool) -> None:
        super().__init__(gate, experts, shared_experts)
        self.average = average and shared_experts is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 0.5 if self.average else out

    def extra_repr(self) -> str:
        return "average" if self.average else ""


def _choice(config: Any, field: str, allowed: tuple[str, ...], default: str) -> str:
    value = str(getattr(config, field, None) or default)
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, allowed))}; got "
                         f"{value!r}")
    return value


def cohere2_moe_block(config: Any) -> CohereMoEBlock:
    """The sparse layer's MLP (module docstring): router ``gate``, routed ``experts``,
    optional ``shared_experts``."""
    if config.hidden_act != "silu":
        raise ValueError(f"Cohere2-MoE experts support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")
    selection = _choice(config, "expert_selection_fn", SELECTION_FNS, "softmax")
    combination = _choice(config, "shared_expert_combination_strategy", COMBINATIONS,
                          "average")
    hidden, experts, top_k = (int(config.hidden_size), int(config.num_experts),
                              int(config.num_experts_per_tok))
    router: nn.Module
    if selection == "softmax":  # softmax over the picked logits = renormalized softmax
        router = SoftmaxTopKRouter(hidden, experts, top_k, renormalize=True)
    else:  # sigmoid is monotonic: the largest logits are the largest scores
        router = GroupedTopKRouter(hidden, experts, top_k, renormalize=bool(
            getattr(config, "norm_topk_prob", True)), scoring="sigmoid",
            correction_bias=False)
    shared_count = int(getattr(config, "num_shared_experts", 0) or 0)
    shared = None
    if shared_count > 0:
        shared = GatedMLP(hidden, int(config.intermediate_size) * shared_count,
                          config.hidden_act)
    routed = FusedMoE(experts, hidden, int(config.intermediate_size))
    return CohereMoEBlock(router, routed, shared, average=combination == "average")


def mlp_layer_types(config: Any) -> list[str]:
    """``mlp_layer_types`` (``"dense"`` / ``"sparse"`` per layer; all sparse where unset),
    checked."""
    layers = int(config.num_hidden_layers)
    kinds = list(getattr(config, "mlp_layer_types", None) or ["sparse"] * layers)
    if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the "
                         f"{layers} layers; got {kinds!r}")
    return kinds


class Cohere2MoeForCausalLM(_Cohere):
    """Cohere2-MoE in the mrv2 model contract (module docstring): Cohere2's attention layers,
    a dense or MoE MLP per ``mlp_layer_types``, RMS or Layer norms per ``rms_norm_eps``."""

    def __init__(self, config: PretrainedConfig) -> None:
        layers = int(config.num_hidden_layers)
        kinds = mlp_layer_types(config)
        force = int(getattr(config, "prefix_dense_sliding_window_pattern", 1) or 1) == 1
        rope = [sliding_window_of(config, i) is not None or (force and kinds[i] == "dense")
                for i in range(layers)]
        dense_size = int(getattr(config, "prefix_dense_intermediate_size", None)
                         or config.intermediate_size)

        def mlp(i: int) -> nn.Module:
            if kinds[i] == "dense":
                return GatedMLP(config.hidden_size, dense_size, config.hidden_act)
            return cohere2_moe_block(config)

        rms_eps = getattr(config, "rms_norm_eps", None)

        def rms_norm() -> LayerNorm | RMSNorm:
            return RMSNorm(config.hidden_size, eps=float(cast(float, rms_eps)))

        super().__init__(config, rope, qk_norm=False, mlp=mlp,
                         norm=None if rms_eps is None else rms_norm)
