"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``) and DeepSeek-V3 (``DeepseekV3ForCausalLM``),
as transformers models them.

- Attention: the core's multi-head latent attention (:mod:`mrv2.layers.mla`): an optional
  ``q_lora_rank`` (V2-Lite has none), ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``; RoPE over the ``qk_rope_head_dim`` part only, interleaved
  pairs (V2 always; V3 per ``rope_interleave``), YaRN with DeepSeek's ``mscale`` /
  ``mscale_all_dim`` (cos/sin scaled by their ratio, the softmax scale by
  ``mscale(factor, mscale_all_dim)^2``).
- MLP: layers ``< first_k_dense_replace`` are dense SwiGLU MLPs of ``intermediate_size``; the
  others a mixture of ``n_routed_experts`` experts of ``moe_intermediate_size`` plus
  ``n_shared_experts`` shared ones (V2: the dense and shared MLPs biased per ``mlp_bias``).
  V3 routes with "noaux_tc" (sigmoid scores, a correction bias that only steers the choice,
  group-limited top-k over ``n_group`` / ``topk_group``, renormalized per ``norm_topk_prob``);
  V2 with softmax scores, ``greedy`` or ``group_limited_greedy`` (groups ranked by their best
  expert), not renormalized; both times ``routed_scaling_factor``.
- Tensor parallelism: MLA splits its heads across the ranks (see :mod:`mrv2.layers.mla`);
  the MoE (every expert's intermediate dimension), shared experts and dense MLPs split as the
  core's layers do; the MTP layers' blocks are built the same way.
- V3 checkpoints keep ``num_nextn_predict_layers`` MTP layers after the main ones
  (``model.layers.{num_hidden_layers + i}.*``); the main model skips them and
  :meth:`DeepseekV3ForCausalLM.build_mtp` builds them for the ``mtp`` speculator.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    GroupedTopKRouter,
    MoEBlock,
    RotaryEmbedding,
)
from mrv2.layers.mla import MLAAttention, MLADecoderLayer, check_mla_config, mla_rope
from mrv2.layers.moe import shared_expert_moe
from mrv2.layers.mtp import MultiTokenPredictor, build_mtp
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# (mla_rope moved into the core, :mod:`mrv2.layers.mla`; still importable from here)
__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "check_moe_config", "config_check",
           "deepseek_layer", "deepseek_mlp", "mla_rope", "moe_block", "validate_config"]

#: ``model.layers.{i}.rest`` of a checkpoint tensor name.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Only the MLPs' gate/up projections are fused (MLA's projections stay separate).
GATE_UP: StackedMapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def config_check(config: Any, arch: str) -> Callable[[bool, str, str], None]:
    """``need(ok, field, what)``: a ``ValueError`` naming ``arch`` and ``config.field`` with its
    value unless ``ok``."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    return need


def check_moe_config(config: Any, arch: str) -> None:
    """The DeepSeek MoE's fields (routed and shared experts, dense layers first), as a
    ``ValueError`` naming the field; DeepSeek-V2/V3 and dots.llm1 share them."""
    need = config_check(config, arch)
    experts = int(config.n_routed_experts or 0)
    need(experts >= 1, "n_routed_experts", "must be at least 1")
    need(int(config.n_shared_experts or 0) >= 0, "n_shared_experts", "must be >= 0")
    need(int(config.first_k_dense_replace or 0) >= 0, "first_k_dense_replace", "must be >= 0")


def validate_config(config: Any, arch: str, v3: bool) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a DeepSeek model this plugin
    runs (before anything is built)."""
    need = config_check(config, arch)
    check_mla_config(config, arch)
    check_moe_config(config, arch)
    if v3:
        need(getattr(config, "topk_method", "noaux_tc") == "noaux_tc", "topk_method",
             "DeepSeek-V3 routes with 'noaux_tc' only")
    else:
        need(config.topk_method in ("greedy", "group_limited_greedy"), "topk_method",
             "DeepSeek-V2 routes with 'greedy' or 'group_limited_greedy'")


def moe_block(config: PretrainedConfig, v3: bool) -> MoEBlock:
    """The router ``gate``, the routed ``experts`` and the ``shared_experts``."""
    grouped = v3 or config.topk_method == "group_limited_greedy"
    router = GroupedTopKRouter(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        n_group=int(config.n_group or 1) if grouped else 1,
        topk_group=int(config.topk_group or 1) if grouped else 1,
        renormalize=bool(config.norm_topk_prob) if v3 else False,
        routed_scaling_factor=float(config.routed_scaling_factor),
        scoring="sigmoid" if v3 else "softmax",
        correction_bias=v3,
    )
    return shared_expert_moe(config, router, shared_bias=mlp_bias_of(config, v3))


def mlp_bias_of(config: Any, v3: bool) -> bool:
    """Whether the dense MLPs and the shared experts have biases: DeepSeek-V2's ``mlp_bias``
    (transformers' V3 has none, whatever its config says)."""
    return not v3 and bool(getattr(config, "mlp_bias", False))


def deepseek_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding, v3: bool,
                   cache_idx: int | None = None) -> MLADecoderLayer:
    """Layer ``layer_idx``: MLA (KV cache layer ``cache_idx``, default ``layer_idx``), then a
    dense MLP (``layer_idx < first_k_dense_replace``) or the MoE block."""
    interleaved = bool(getattr(config, "rope_interleave", True)) if v3 else True
    attn = MLAAttention(config, layer_idx if cache_idx is None else cache_idx, rope, interleaved)
    return MLADecoderLayer(config, attn, deepseek_mlp(config, layer_idx, v3))


def deepseek_mlp(config: PretrainedConfig, layer_idx: int, v3: bool) -> nn.Module:
    """Layer ``layer_idx``'s MLP: a dense SwiGLU MLP of ``intermediate_size`` below
    ``first_k_dense_replace``, the MoE block (:func:`moe_block`) from there on."""
    if layer_idx >= int(config.first_k_dense_replace or 0):
        return moe_block(config, v3)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    bias=mlp_bias_of(config, v3))


class _DeepseekForCausalLM(CausalLM):
    v3: ClassVar[bool] = True
    stacked_params: ClassVar[StackedMapping] = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        validate_config(config, type(self).__name__, self.v3)
        rope = mla_rope(config)
        super().__init__(
            config, DecoderModel(config, lambda i: deepseek_layer(config, i, rope, self.v3))
        )

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None for MTP layers' tensors."""
        m = LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().rename(name)


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V3 / R1 (and models of its layout): MLA with ``q_lora_rank``, noaux_tc MoE,
    and ``num_nextn_predict_layers`` MTP layers for a drafter (:meth:`build_mtp`)."""

    v3 = True

    def build_mtp(self, first_layer_idx: int | None = None) -> MultiTokenPredictor:
        """The checkpoint's MTP layers (:class:`mrv2.layers.mtp.MultiTokenPredictor` over
        DeepSeek-V3 decoder blocks: MLA and the MoE), sharing this model's embedding and LM
        head, their attention caching from ``first_layer_idx`` (default
        ``num_hidden_layers``); weights unloaded (see :func:`mrv2.layers.mtp.build_mtp`)."""
        config = self.config
        rope = mla_rope(config)

        def block(layer_idx: int, cache_idx: int) -> nn.Module:
            return deepseek_layer(config, layer_idx, rope, True, cache_idx=cache_idx)

        return cast(MultiTokenPredictor, build_mtp(self, MultiTokenPredictor, block, GATE_UP,
                                                   first_layer_idx))


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite: MLA (V2-Lite without ``q_lora_rank``), softmax-routed MoE."""

    v3 = False
