"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (``Glm4MoeForCausalLM``), as transformers models it.

- Attention: GQA, q/k/v projections with ``attention_bias`` (the output projection has none),
  optional per-head q/k RMSNorm (``use_qk_norm``) before a *partial* neox-style RoPE over the
  first ``head_dim * partial_rotary_factor`` dims of each head (the rest pass through).
- MLP: layers ``< first_k_dense_replace`` are dense SwiGLU MLPs of ``intermediate_size``; the
  others a mixture of experts: DeepSeek-V3's "noaux_tc" router (sigmoid scores, a correction
  bias that only steers the choice, group-limited top-k, renormalized weights times
  ``routed_scaling_factor``) over ``n_routed_experts`` experts of ``moe_intermediate_size``,
  plus ``n_shared_experts`` shared experts that see every token (one MLP of
  ``moe_intermediate_size * n_shared_experts``).
- The checkpoints keep ``num_nextn_predict_layers`` multi-token-prediction layers after the
  main ones (``model.layers.{num_hidden_layers + i}.*``). The main model skips them; a drafter
  builds them with :meth:`Glm4MoeForCausalLM.build_mtp` (see :mod:`mrv2_glm.mtp`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    GroupedTopKRouter,
    MoEBlock,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.moe import shared_expert_moe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mrv2_glm.mtp import Glm4MoeMTP

#: ``model.layers.{i}.rest`` of a checkpoint tensor name.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def partial_rotary_factor_of(config: Any) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` (transformers 5) or the config."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor",
                            getattr(config, "partial_rotary_factor", 1.0) or 1.0))


def validate_config(config: Any) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a GLM-4.x MoE this plugin
    runs (checked before anything is built, so a wrong checkpoint fails with one clear line)."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            value = getattr(config, field, None)
            raise ValueError(f"Glm4MoeForCausalLM: config.{field} = {value!r}: {what}")

    need(config.hidden_act == "silu", "hidden_act", "the experts and MLPs support 'silu' only")
    need(config.num_attention_heads % config.num_key_value_heads == 0, "num_key_value_heads",
         f"must divide num_attention_heads ({config.num_attention_heads})")
    experts = int(config.n_routed_experts)
    need(experts >= 1, "n_routed_experts", "must be at least 1")
    n_group = int(config.n_group or 1)
    need(n_group >= 1 and experts % n_group == 0, "n_group",
         f"must be >= 1 and divide n_routed_experts ({experts})")
    topk_group = int(config.topk_group or 1)
    need(1 <= topk_group <= n_group, "topk_group", f"must be in [1, n_group={n_group}]")
    most = topk_group * (experts // n_group)
    need(1 <= config.num_experts_per_tok <= most, "num_experts_per_tok",
         f"must be in [1, {most}] (topk_group x experts per group)")
    need(int(config.n_shared_experts or 0) >= 0, "n_shared_experts", "must be >= 0")
    need(int(config.first_k_dense_replace) >= 0, "first_k_dense_replace", "must be >= 0")
    need(getattr(config, "scoring_func", "sigmoid") == "sigmoid", "scoring_func",
         "GLM-4.x routes with sigmoid scores only")
    need(getattr(config, "topk_method", "noaux_tc") == "noaux_tc", "topk_method",
         "GLM-4.x routes with 'noaux_tc' only")
    need(int(getattr(config, "num_nextn_predict_layers", 0) or 0) >= 0,
         "num_nextn_predict_layers", "must be >= 0")
    head_dim = head_dim_of(config)
    rotary_dim = int(head_dim * partial_rotary_factor_of(config))
    need(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, "partial_rotary_factor",
         f"head_dim ({head_dim}) x partial_rotary_factor must be an even number of dims in "
         f"(0, head_dim], got {rotary_dim}")


def glm4_moe_block(config: PretrainedConfig) -> MoEBlock:
    """The "noaux_tc" router ``gate``, the routed ``experts`` and the ``shared_experts``."""
    router = GroupedTopKRouter(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        n_group=int(config.n_group or 1),
        topk_group=int(config.topk_group or 1),
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
        scoring="sigmoid",
        correction_bias=True,
    )
    return shared_expert_moe(config, router)


def glm4_moe_layer(
    config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding, cache_idx: int | None = None
) -> DecoderLayer:
    """Layer ``layer_idx``: attention with q/k/v biases per ``attention_bias`` (the output
    projection has none) and q/k norms per ``use_qk_norm``, then a dense MLP (``layer_idx <
    first_k_dense_replace``) or the MoE block. ``cache_idx`` (default ``layer_idx``) is the
    attention's KV cache layer: an MTP layer passes its own."""
    attn = SelfAttention(
        config, layer_idx if cache_idx is None else cache_idx, rope,
        qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False,
        qk_norm=bool(getattr(config, "use_qk_norm", False)),
    )
    mlp: nn.Module
    if layer_idx >= config.first_k_dense_replace:
        mlp = glm4_moe_block(config)
    else:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return DecoderLayer(config, attn, mlp)


class Glm4MoeForCausalLM(CausalLM):
    """GLM-4.x MoE causal LM in the mrv2 model contract. Loads the main layers only: the
    checkpoint's MTP layers (``model.layers.{i}`` for ``i >= num_hidden_layers``) are skipped
    here and loaded by the module :meth:`build_mtp` returns."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_config(config)
        rope = self.make_rope(config)
        super().__init__(
            config, DecoderModel(config, lambda i: glm4_moe_layer(config, i, rope))
        )

    @classmethod
    def make_rope(cls, config: Any) -> RotaryEmbedding:
        """The RoPE every layer shares: the config's (GLM-4.5V: M-RoPE)."""
        return get_rope(config, head_dim_of(config))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None for the MTP layers' tensors."""
        m = LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().rename(name)

    def build_mtp(self, first_layer_idx: int | None = None) -> Glm4MoeMTP:
        """The checkpoint's MTP layers as a :class:`~mrv2_glm.mtp.Glm4MoeMTP` sharing this
        model's token embedding and LM head (same tensors), on this model's device and dtype,
        with unloaded weights: load them with
        ``load_model_weights(mtp, iter_safetensors(model_dir))``, then run
        ``mrv2.model_loader.build.process_weights_after_loading(mtp)`` (the device layouts).

        ``first_layer_idx`` numbers the MTP attention layers' KV caches (default
        ``num_hidden_layers``, right after this model's; a speculator passes the index the
        runner gives its ``kv_cache_specs``). How a speculator drives it: after each target
        step, for every request, MTP step 0 runs over the step's tokens shifted by one (the
        token after each position, the last one being the token just sampled), the target's
        final (normed) hidden states of those positions and the same positions; its output at
        the last position gives the logits of the first draft (:meth:`Glm4MoeMTP.compute_logits`);
        step ``s > 0`` feeds the previous step's draft, the MTP output hidden state and the
        next position. See :mod:`mrv2_glm.mtp` for the exact contract.
        """
        from mrv2.layers.mtp import build_mtp
        from mrv2_glm.mtp import Glm4MoeMTP

        return cast("Glm4MoeMTP", build_mtp(self, Glm4MoeMTP, first_layer_idx=first_layer_idx))
