"""OLMo 1 (``OlmoForCausalLM``), OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3
(``Olmo3ForCausalLM``).

OLMo 1 (OLMo-1B / 7B, OLMo-7B-0424 / 0724): Llama's pre-norm layers whose norms have no
parameters at all (HF's ``OlmoLayerNorm``: a LayerNorm without weight or bias, eps 1e-5, the
final norm too; the core's :class:`~mrv2.layers.LayerNorm` with ``affine=False``), a SwiGLU
MLP, RoPE over whole heads, q/k/v/o biases per ``attention_bias``; ``clip_qkv`` (0424 / 0724:
8): the q, k and v projections' outputs each clamped to ``[-clip_qkv, clip_qkv]`` before the
rotation (:class:`ClippedAttention`). The head is tied or not per ``tie_word_embeddings``.

OLMo 2 and OLMo 3 are post-norm decoders. Each block's output is normalized before it joins
the residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``; there are
no pre-norms), and the query and key projections are RMS-normalized over all their heads at
once (``q_norm`` over ``num_heads * head_dim`` features, not per head) before RoPE.

OLMo 3 adds local layers: ``config.layer_types`` marks most layers ``sliding_attention`` (a
query sees its last ``sliding_window`` keys, its own included: the core's
:class:`~mrv2.layers.Attention` ``sliding_window``) and every fourth ``full_attention``, and
each kind has its own RoPE (``rope_parameters[kind]``: a long-context checkpoint's YaRN
scaling is on the full-attention layers only, as HF and vLLM apply it).

That whole-projection norm spans the heads tensor parallelism puts on other ranks: under it
each rank normalizes its heads by the mean square all-reduced over every rank's
(:func:`mrv2.layers.projection_norms`, through the core's
``SelfAttention(qk_norm="projection")``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    LayerNorm,
    PostNormDecoderLayer,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn
    from transformers import PretrainedConfig

#: The layer types OLMo 3's ``config.layer_types`` may hold.
LAYER_TYPES = ("sliding_attention", "full_attention")
#: OLMo 1's parameter-free LayerNorms' eps (HF's ``OlmoLayerNorm``: fixed, not a config field).
OLMO_NORM_EPS = 1e-5


class ClippedAttention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` whose q, k and v projections' outputs are clamped
    to ``[-clip, clip]`` (OLMo 1's ``clip_qkv``; HF clamps each of the three, the same as the
    fused output at once) before RoPE; ``clip`` None: no clamp."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None, *,
                 clip: float | None, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(config, layer_idx, rope, qkv_bias=qkv_bias, o_bias=o_bias)
        self.clip = clip

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        return super().attend(positions, qkv)

    def extra_repr(self) -> str:
        return f"clip_qkv={self.clip}"


class OlmoForCausalLM(CausalLM):
    """OLMo 1 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        clip_qkv = getattr(config, "clip_qkv", None)
        clip = None if clip_qkv is None else float(clip_qkv)
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", False))
        hidden = int(config.hidden_size)

        def norm() -> LayerNorm:
            return LayerNorm(hidden, OLMO_NORM_EPS, affine=False)

        def layer(i: int) -> DecoderLayer:
            attention = ClippedAttention(config, i, rope, clip=clip, qkv_bias=bias,
                                         o_bias=bias)
            mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, attention, mlp, norm=norm)

        super().__init__(config, DecoderModel(config, layer, norm=norm))


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, olmo_decoder(config, lambda i: rope))


class Olmo3ForCausalLM(CausalLM):
    """OLMo 3 in the mrv2 model contract: OLMo 2's layers, local (sliding-window) and global
    per ``config.layer_types``, each kind with its RoPE (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"config.json layer_types must give each of the "
                             f"{config.num_hidden_layers} layers one of {', '.join(LAYER_TYPES)};"
                             f" got {types}")
        head_dim = head_dim_of(config)
        ropes = {kind: get_rope(config, head_dim, kind) for kind in set(types)}
        super().__init__(config, olmo_decoder(config, lambda i: ropes[types[i]]))


def olmo_decoder(config: PretrainedConfig, rope_of: Callable[[int], RotaryEmbedding],
                 mlp_of: Callable[[], nn.Module] | None = None) -> DecoderModel:
    """The post-norm layer stack of OLMo 2 / 3: layer ``i`` rotates with ``rope_of(i)`` and
    attends over the config's sliding window where its layer type is local
    (:func:`mrv2.layers.sliding_window_of`, inside :class:`~mrv2.layers.SelfAttention`);
    its MLP ``mlp_of()`` (default: the SwiGLU of ``intermediate_size``; FlexOlmo: OLMoE's
    experts)."""
    bias = bool(getattr(config, "attention_bias", False))

    def layer(i: int) -> PostNormDecoderLayer:
        attention = SelfAttention(config, i, rope_of(i), qkv_bias=bias, o_bias=bias,
                                  qk_norm="projection")
        mlp = (GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
               if mlp_of is None else mlp_of())
        return PostNormDecoderLayer(config, attention, mlp)

    return DecoderModel(config, layer)
