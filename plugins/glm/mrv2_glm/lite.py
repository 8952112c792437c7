"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``), as transformers models it: DeepSeek-V3's
multi-head latent attention with GLM-4.5's mixture of experts.

- Attention: MLA (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``; RoPE over the ``qk_rope_head_dim`` part, interleaved per ``rope_interleave``)
  over a latent KV cache of ``kv_lora_rank + qk_rope_head_dim`` values per token: the core's
  layer (:class:`mrv2.layers.mla.MLAAttention`, its decoder layer and its RoPE), and the core's
  ``mla`` attention backend serves the latent cache; no other plugin is needed.
- MLP: per ``mlp_layer_types`` (``"dense"`` / ``"sparse"``; checkpoints that give
  ``first_k_dense_replace`` instead: that many dense layers first) a dense SwiGLU MLP of
  ``intermediate_size`` or GLM-4.5's MoE block (:func:`mrv2_glm.model.glm4_moe_block`:
  "noaux_tc" sigmoid routing with a correction bias, group-limited top-k, shared experts).
- The checkpoints keep ``num_nextn_predict_layers`` MTP layers after the main ones
  (``model.layers.{num_hidden_layers + i}.*``): the main model skips them and
  :meth:`Glm4MoeLiteForCausalLM.build_mtp` builds them for the ``mtp`` speculator.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from mrv2.layers import CausalLM, DecoderModel, GatedMLP, RotaryEmbedding
from mrv2.layers.mla import MLAAttention, MLADecoderLayer, check_mla_config, mla_rope
from mrv2.layers.mtp import MultiTokenPredictor, build_mtp
from mrv2.layers.weights import StackedMapping
from mrv2_glm.model import glm4_moe_block, partial_rotary_factor_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "Glm4MoeLiteForCausalLM"
#: ``model.layers.{i}.rest`` of a checkpoint tensor name.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Only the MLPs' gate/up projections are fused (MLA's projections stay separate).
GATE_UP: StackedMapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def mlp_layer_types_of(config: Any) -> list[str]:
    """Each main layer's MLP, ``"dense"`` or ``"sparse"``: ``config.mlp_layer_types``, else
    ``first_k_dense_replace`` dense layers (default 1) then sparse ones."""
    count = int(config.num_hidden_layers)
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        dense = int(getattr(config, "first_k_dense_replace", 1) or 0)
        return ["dense"] * min(dense, count) + ["sparse"] * max(count - dense, 0)
    return [str(t) for t in types]


def validate_config(config: Any, arch: str = ARCH) -> None:
    """Raise a ``ValueError`` naming ``arch`` and the field if ``config`` is not a
    GLM-4.7-Flash layout this plugin runs (before anything is built; GLM-5's too)."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    check_mla_config(config, arch)
    need(partial_rotary_factor_of(config) == 1.0, "partial_rotary_factor",
         "MLA rotates the whole qk_rope_head_dim part (1.0 only)")
    types = mlp_layer_types_of(config)
    need(len(types) == int(config.num_hidden_layers) and set(types) <= {"dense", "sparse"},
         "mlp_layer_types", f"must give each of the {config.num_hidden_layers} layers "
         "'dense' or 'sparse'")
    experts = int(config.n_routed_experts)
    need(experts >= 1, "n_routed_experts", "must be at least 1")
    n_group = int(getattr(config, "n_group", 1) or 1)
    need(experts % n_group == 0, "n_group", f"must divide n_routed_experts ({experts})")
    topk_group = int(getattr(config, "topk_group", 1) or 1)
    need(1 <= topk_group <= n_group, "topk_group", f"must be in [1, n_group={n_group}]")
    most = topk_group * (experts // n_group)
    need(1 <= config.num_experts_per_tok <= most, "num_experts_per_tok",
         f"must be in [1, {most}] (topk_group x experts per group)")
    need(int(config.n_shared_experts or 0) >= 0, "n_shared_experts", "must be >= 0")


def lite_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding,
               cache_idx: int | None = None) -> MLADecoderLayer:
    """Layer ``layer_idx``: MLA (KV cache layer ``cache_idx``, default ``layer_idx``), then a
    dense MLP or the MoE block per :func:`mlp_layer_types_of` (an MTP layer, past the list:
    the MoE block)."""
    interleaved = bool(getattr(config, "rope_interleave", True))
    attn = MLAAttention(config, layer_idx if cache_idx is None else cache_idx, rope, interleaved)
    types = mlp_layer_types_of(config)
    mlp: nn.Module
    if layer_idx < len(types) and types[layer_idx] == "dense":
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    else:
        mlp = glm4_moe_block(config)
    return MLADecoderLayer(config, attn, mlp)


class Glm4MoeLiteForCausalLM(CausalLM):
    """GLM-4.7-Flash causal LM in the mrv2 model contract (module docstring)."""

    stacked_params = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        validate_config(config)
        rope = mla_rope(config)
        super().__init__(config, DecoderModel(config, lambda i: lite_layer(config, i, rope)))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None for the MTP layers' tensors."""
        m = LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().rename(name)

    def build_mtp(self, first_layer_idx: int | None = None) -> MultiTokenPredictor:
        """The checkpoint's MTP layers (:class:`mrv2.layers.mtp.MultiTokenPredictor` over this
        model's decoder blocks: MLA and the MoE), sharing its embedding and LM head, their
        attention caching from ``first_layer_idx`` (default ``num_hidden_layers``); weights
        unloaded (see :func:`mrv2.layers.mtp.build_mtp`)."""
        config = self.config
        rope = mla_rope(config)

        def block(layer_idx: int, cache_idx: int) -> nn.Module:
            return lite_layer(config, layer_idx, rope, cache_idx=cache_idx)

        return cast(MultiTokenPredictor, build_mtp(self, MultiTokenPredictor, block, GATE_UP,
                                                   first_layer_idx))
