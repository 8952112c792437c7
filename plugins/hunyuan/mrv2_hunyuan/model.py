"""Tencent Hunyuan: ``HunYuanDenseV1ForCausalLM`` (Hunyuan 0.5B / 1.8B / 4B / 7B) and
``HunYuanMoEV1ForCausalLM`` (Hunyuan-A13B), as transformers' ``hunyuan_v1_dense`` /
``hunyuan_v1_moe`` and vLLM's ``hunyuan_v1`` compute them.

Pre-norm layers (``input_layernorm``, ``post_attention_layernorm``) as Llama's, with:

- per-head q/k RMSNorms (``self_attn.query_layernorm`` / ``key_layernorm``, ``head_dim``
  wide, ``rms_norm_eps``) applied *after* the rotation. Each has a weight per dimension, which
  a rotation does not commute with, so the core's q/k norm fused into the RoPE kernel (before
  the rotation: Qwen3's) does not apply: q and k are rotated, normalized, then handed to the
  attention layer. ``use_qk_norm: false`` (vLLM reads it; transformers always normalizes, and
  every published config sets it true) leaves them out.
- RoPE with Hunyuan's NTK-alpha scaling (``rope_scaling`` ``{"type": "dynamic", "alpha": A}``:
  a fixed base ``rope_theta * A ** (d / (d - 2))``; the core's
  :func:`~mrv2.layers.get_rope`).
- Hunyuan-A13B's MLP: a mixture of ``num_experts`` SwiGLU experts of
  ``moe_intermediate_size`` (``intermediate_size`` where absent; a list gives each layer its
  own), ``moe_topk`` of them per token (an int or one per layer) picked by a softmax router
  (``mlp.gate.wg``; fp32 logits, as transformers computes them) and renormalized to sum to 1
  where more than one is picked (top-1 keeps the softmax probability: vLLM's and Tencent's
  original routing; transformers renormalizes it to 1), plus a shared SwiGLU MLP
  (``mlp.shared_mlp``) of ``intermediate_size * num_shared_expert`` that sees every token
  where ``use_mixed_mlp_moe`` (both default to HF's always-present single shared MLP).

Refused with an error naming the field: cross-layer attention (``use_cla`` with
``cla_share_factor`` > 1: layers reusing an earlier layer's keys and values; no
``HunYuan*V1`` checkpoint sets it and transformers does not implement it), an activation other
than SiLU, and ``mlp_bias`` (transformers builds no MLP biases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PretrainedConfig

#: Checkpoint name fragments -> this module's (HF's router ``wg`` and shared MLP).
_RENAMES = ((".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_experts."))


def per_layer(config: Any, name: str, layer_idx: int, default: Any = None) -> Any:
    """``config.<name>`` for layer ``layer_idx``: the value, or its ``layer_idx``-th entry
    where the config lists one per layer (Hunyuan-A13B's ``moe_topk``,
    ``moe_intermediate_size``, ``num_shared_expert``); ``default`` where unset."""
    value = getattr(config, name, None)
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        if len(value) <= layer_idx:
            raise ValueError(f"config.json {name} lists {len(value)} values; layer "
                             f"{layer_idx} needs one (one per layer)")
        return value[layer_idx]
    return value


def check_config(config: Any) -> None:
    """A ValueError naming the field for what this module does not implement (its
    docstring)."""
    cla = int(getattr(config, "cla_share_factor", 1) or 1)
    if getattr(config, "use_cla", False) and cla > 1:
        raise ValueError(f"config.json use_cla = true with cla_share_factor = {cla}: cross-layer "
                         "attention (layers reusing an earlier layer's keys and values) is not "
                         "supported")
    if config.hidden_act != "silu":
        raise ValueError(f"Hunyuan MLPs support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias = true: biased MLPs are not supported (no "
                         "published Hunyuan checkpoint has them)")


class HunYuanAttention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` with Hunyuan's per-head q/k norms after the
    rotation (module docstring): ``query_layernorm`` / ``key_layernorm`` (HF's names), None
    where ``use_qk_norm`` is false."""

    rotary_emb: RotaryEmbedding

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, rope, qkv_bias=bias, o_bias=bias)
        self.query_layernorm: RMSNorm | None = None
        self.key_layernorm: RMSNorm | None = None
        if getattr(config, "use_qk_norm", True):
            self.query_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """After the QKV projection: RoPE, then the q/k norms, attention, output projection
        (without the norms the rotation runs inside the attention layer, as the core's)."""
        q, k, v = self.qkv_proj.split(qkv)
        if self.query_layernorm is None or self.key_layernorm is None:
            out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        else:
            q, k = self.rotary_emb(positions, q, k)
            q = self._per_head(self.query_layernorm, q)
            k = self._per_head(self.key_layernorm, k)
            out = self.attn(q, k, v)
        return cast(torch.Tensor, self.o_proj(out))

    def _per_head(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm`` over each ``head_dim`` slice of ``x`` ``[T, heads * head_dim]``."""
        rows = x.reshape(-1, self.head_dim)
        return cast(torch.Tensor, norm(rows)).reshape(x.shape[0], -1)

    def extra_repr(self) -> str:
        return "qk_norm after rope" if self.query_layernorm is not None else "no qk_norm"


def hunyuan_moe_block(config: Any, layer_idx: int) -> MoEBlock:
    """Layer ``layer_idx``'s router (``gate``), routed experts and shared MLP (module
    docstring)."""
    num_experts = int(per_layer(config, "num_experts", layer_idx))
    top_k = int(per_layer(config, "moe_topk", layer_idx))
    dense = int(per_layer(config, "intermediate_size", layer_idx))
    inter = int(per_layer(config, "moe_intermediate_size", layer_idx, dense))
    router = GroupedTopKRouter(config.hidden_size, num_experts, top_k, renormalize=top_k > 1,
                               scoring="softmax", correction_bias=False, fp32_weight=True)
    shared = None
    if getattr(config, "use_mixed_mlp_moe", True):
        shared_count = int(per_layer(config, "num_shared_expert", layer_idx, 1))
        if shared_count > 0:
            shared = GatedMLP(config.hidden_size, dense * shared_count, config.hidden_act)
    return MoEBlock(router, FusedMoE(num_experts, config.hidden_size, inter), shared)


class _HunYuan(CausalLM):
    """The layer stack both architectures share, with ``make_mlp(i)`` as layer ``i``'s MLP."""

    def __init__(self, config: PretrainedConfig, make_mlp: Callable[[int], nn.Module]) -> None:
        check_config(config)
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            return DecoderLayer(config, HunYuanAttention(config, i, rope), make_mlp(i))

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        """HF's router ``mlp.gate.wg`` and shared ``mlp.shared_mlp`` to the core's
        :class:`~mrv2.layers.MoEBlock` names, then the core's renames."""
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().rename(name)


class HunYuanDenseV1ForCausalLM(_HunYuan):
    """The dense Hunyuan models in the mrv2 model contract (module docstring): a SwiGLU MLP
    of ``intermediate_size`` (one per layer where it is a list) in every layer."""

    def __init__(self, config: PretrainedConfig) -> None:
        def mlp(i: int) -> nn.Module:
            size = int(per_layer(config, "intermediate_size", i))
            return GatedMLP(config.hidden_size, size, config.hidden_act)

        super().__init__(config, mlp)


class HunYuanMoEV1ForCausalLM(_HunYuan):
    """Hunyuan-A13B in the mrv2 model contract (module docstring): every layer's MLP a
    mixture of experts with a shared MLP."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, lambda i: hunyuan_moe_block(config, i))
