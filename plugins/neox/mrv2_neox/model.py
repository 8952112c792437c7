"""EleutherAI's GPT-NeoX (``GPTNeoXForCausalLM``: Pythia 70M-12B, GPT-NeoX-20B) and
Stability's StableLM (``StableLmForCausalLM``: StableLM-2 1.6B / 12B, StableLM-3B-4E1T,
StableCode), as HF transformers' ``modeling_gpt_neox`` / ``modeling_stablelm``.

Both families:

- LayerNorms with a bias (``layer_norm_eps``; the core's :class:`~mrv2.layers.LayerNorm`),
  the final one included; the head size is ``hidden_size // num_attention_heads`` (a
  ``head_dim`` in the config is not read, as HF's attention does not read it).
- Partial RoPE: the first ``int(head_dim * partial_rotary_factor)`` dims of each head rotate
  in halves (HF's ``rotate_half``: the core's layout, no rows to reorder), the rest pass
  through; ``partial_rotary_factor`` from ``rope_parameters`` (transformers 5 converts
  GPT-NeoX's ``rotary_pct`` / ``rotary_emb_base`` and StableLM's top-level factor into it).
- ``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(n)`` (the core's
  :class:`~mrv2.layers.ParallelDecoderLayer`), or the sequential block (the core's
  :class:`~mrv2.layers.DecoderLayer` on LayerNorms).

GPT-NeoX: multi-head attention (a stray ``num_key_value_heads`` is ignored, as HF does), the
fused ``attention.query_key_value`` checkpoint tensor laid out per head as ``[heads, 3,
head_dim]`` (HF views it ``[..., heads, 3 * head_dim]`` and chunks each head into q, k, v),
split into the core's q / k / v shards as it loads (weight and bias; other layouts, packed
integer formats, are refused by name); ``attention.dense`` as the output projection; biases on
all four per ``attention_bias``; the parallel block's MLP has a norm of its own
(``post_attention_layernorm``) and sums ``(mlp + attn) + x``; the MLP is ``dense_h_to_4h``,
``hidden_act`` (``gelu``, ``gelu_fast``, ``gelu_new``...), ``dense_4h_to_h``, with biases;
the untied head ``embed_out`` (transformers 5's ``lm_head`` too), tied per
``tie_word_embeddings``. The checkpoints' causal-mask buffers (``attention.bias``,
``attention.masked_bias``) and RoPE caches are skipped.

StableLM: grouped-query attention, q/k/v biases per ``use_qkv_bias`` (never on ``o_proj``);
``qk_layernorm``: q and k normalized per head by a bias-free LayerNorm with each head's own
weight (``q_layernorm.norms.{h}.weight``), before the rotation (this rank's heads under tensor
parallelism); the parallel block feeds the MLP from the input norm (no
``post_attention_layernorm``) and sums ``(x + attn) + mlp``; a SwiGLU MLP without biases.
Dropout is ignored (inference).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from mrv2.layers import (
    STACKED_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    GatedMLP,
    LayerNorm,
    ParallelDecoderLayer,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
)
from mrv2.layers.weights import StackedMapping
from mrv2_neox.layers import HeadLayerNorm, QKNormAttention

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: GPT-NeoX's fused q/k/v tensor: (its attention's prefix, what it is).
_QKV = re.compile(r"^(gpt_neox\.layers\.\d+\.attention)\.query_key_value\.(\w+)$")
#: GPT-NeoX checkpoints' causal-mask buffers (older exports save them).
_MASK_BUFFER = re.compile(r"\.attention\.(bias|masked_bias)$")
#: GPT-NeoX layer names -> the core's, first match wins.
_LAYER_RENAMES = (("attention.dense.", "self_attn.o_proj."), ("attention.", "self_attn."),
                  ("mlp.dense_h_to_4h.", "mlp.up_proj."), ("mlp.dense_4h_to_h.", "mlp.down_proj."))
#: StableLM's per-head q/k norm weight: (layer, q/k, head).
_HEAD_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)"
                        r"\.weight$")


def config_shape(config: PretrainedConfig, kv_heads: int | None = None,
                 eps_field: str = "layer_norm_eps") -> SimpleNamespace:
    """What the core's decoder and attention read of ``config``: the head size as HF's
    attention derives it (``hidden_size // num_attention_heads``), ``kv_heads`` key/value
    heads (as many as query heads by default), the LayerNorms' eps (``config.<eps_field>``:
    GPT-J's is ``layer_norm_epsilon``)."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    arch = type(config).__name__
    if hidden % heads:
        raise ValueError(f"{arch}: hidden_size ({hidden}) must be a multiple of "
                         f"num_attention_heads ({heads})")
    kv = heads if kv_heads is None else kv_heads
    if heads % kv:
        raise ValueError(f"{arch}: num_key_value_heads ({kv}) must divide "
                         f"num_attention_heads ({heads})")
    return SimpleNamespace(
        vocab_size=int(config.vocab_size), hidden_size=hidden,
        num_hidden_layers=int(config.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=hidden // heads,
        rms_norm_eps=float(getattr(config, eps_field)))


def _rope(config: PretrainedConfig, head_dim: int) -> RotaryEmbedding | None:
    """The partial RoPE of ``config`` (:func:`~mrv2.layers.get_rope`); None where it rotates
    no dims (``partial_rotary_factor`` 0)."""
    rope = get_rope(config, head_dim)
    return rope if rope.rotary_dim > 0 else None


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX / Pythia in the mrv2 model contract (module docstring)."""

    #: q/k/v only: the MLP's ``up_proj`` is a projection of its own, not a gate/up shard.
    stacked_params: ClassVar[StackedMapping] = tuple(
        entry for entry in STACKED_PARAMS if entry[0] == "qkv_proj")

    def __init__(self, config: PretrainedConfig) -> None:
        shape = config_shape(config)
        rope = _rope(config, shape.head_dim)
        bias = bool(getattr(config, "attention_bias", True))
        parallel = bool(getattr(config, "use_parallel_residual", True))
        hidden, eps = shape.hidden_size, shape.rms_norm_eps

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> nn.Module:
            attention = SelfAttention(shape, i, rope, qkv_bias=bias, o_bias=bias)
            mlp = DenseMLP(hidden, int(config.intermediate_size), str(config.hidden_act),
                           bias=True)
            if parallel:
                return ParallelDecoderLayer(attention, mlp, norm, residual_last=True,
                                            mlp_norm=True)
            return DecoderLayer(shape, attention, mlp, norm=norm)

        super().__init__(config, DecoderModel(shape, layer, norm=norm))
        self._heads, self._head_dim = shape.num_attention_heads, shape.head_dim

    def rename(self, name: str) -> str | None:
        """HF's GPT-NeoX names as the core's (``gpt_neox.embed_in`` -> ``model.embed_tokens``,
        ``attention.dense`` -> ``self_attn.o_proj``, ``mlp.dense_h_to_4h`` / ``dense_4h_to_h``
        -> ``mlp.up_proj`` / ``down_proj``, ``final_layer_norm`` -> ``model.norm``,
        ``embed_out`` -> ``lm_head``); the causal-mask buffers skipped. The fused
        ``query_key_value`` keeps its name (no parameter: :meth:`load_weights` splits it, and
        a LoRA adapter on it is refused as a module that is not adaptable)."""
        if _MASK_BUFFER.search(name):
            return None
        if name.startswith("embed_out."):
            name = "lm_head." + name.removeprefix("embed_out.")
        elif name.startswith("gpt_neox."):
            name = "model." + name.removeprefix("gpt_neox.")
            name = name.replace("model.embed_in.", "model.embed_tokens.", 1).replace(
                "model.final_layer_norm.", "model.norm.", 1)
            for old, new in _LAYER_RENAMES:
                if f".{old}" in name:
                    name = name.replace(f".{old}", f".{new}", 1)
                    break
        return super().rename(name)

    def _split_qkv(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each fused ``query_key_value`` weight / bias as its
        ``q_proj``, ``k_proj`` and ``v_proj`` parts (rows ``[heads, 3, head_dim]``: part ``j``
        of every head), and ``embed_out`` named ``lm_head`` (so a tied model's head is
        recognized)."""
        rows = 3 * self._heads * self._head_dim
        for name, t in weights:
            if name.startswith("embed_out."):
                name = "lm_head." + name.removeprefix("embed_out.")
            m = _QKV.match(name)
            if m is None:
                yield name, t
                continue
            if m.group(2) not in ("weight", "bias") or t.dim() == 0 or t.shape[0] != rows:
                raise ValueError(
                    f"checkpoint tensor {name!r} {tuple(t.shape)}: GPT-NeoX's fused q/k/v "
                    f"tensor is split per head as it loads ({rows} rows, [heads, 3, head_dim]); "
                    f"this tensor's layout (a packed integer format?) does not allow it")
            per_head = t.reshape(self._heads, 3, self._head_dim, *t.shape[1:])
            for j, part in enumerate("qkv"):
                yield (f"{m.group(1)}.{part}_proj.{m.group(2)}",
                       per_head[:, j].reshape(rows // 3, *t.shape[1:]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the fused q/k/v split as they stream (:meth:`_split_qkv`)."""
        return super().load_weights(self._split_qkv(weights))


class StableLmForCausalLM(CausalLM):
    """StableLM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        heads = int(config.num_attention_heads)
        shape = config_shape(config, int(getattr(config, "num_key_value_heads", None) or heads))
        rope = _rope(config, shape.head_dim)
        qkv_bias = bool(getattr(config, "use_qkv_bias", False))
        qk_norm = bool(getattr(config, "qk_layernorm", False))
        parallel = bool(getattr(config, "use_parallel_residual", False))
        hidden, eps = shape.hidden_size, shape.rms_norm_eps

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> nn.Module:
            attention = (QKNormAttention(shape, i, rope, qkv_bias=qkv_bias, eps=eps) if qk_norm
                         else SelfAttention(shape, i, rope, qkv_bias=qkv_bias))
            mlp = GatedMLP(hidden, int(config.intermediate_size), str(config.hidden_act))
            if parallel:
                return ParallelDecoderLayer(attention, mlp, norm, residual_last=False)
            return DecoderLayer(shape, attention, mlp, norm=norm)

        super().__init__(config, DecoderModel(shape, layer, norm=norm))

    def _head_norm(self, name: str, layer: int, kind: str) -> HeadLayerNorm:
        layers = self.model.layers
        norm = getattr(layers[layer].self_attn, f"{kind}_layernorm", None) if (
            layer < len(layers)) else None
        if not isinstance(norm, HeadLayerNorm):
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{type(self).__name__} (config.qk_layernorm is "
                             f"{self.config.qk_layernorm!r}, or no layer {layer})")
        return norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors; each head's q/k norm weight (``norms.{h}.weight``) into its
        row of the layer's :class:`~mrv2_neox.layers.HeadLayerNorm` where this rank keeps the
        head. A norm counts as loaded once the checkpoint gave every one of its heads."""
        heads_seen: dict[str, set[int]] = {}
        norms: dict[str, HeadLayerNorm] = {}

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                m = _HEAD_NORM.match(name)
                if m is None:
                    yield name, t
                    continue
                layer, kind, head = int(m.group(1)), m.group(2), int(m.group(3))
                norm = self._head_norm(name, layer, kind)
                try:
                    norm.load_head(head, t)
                except ValueError as error:
                    raise ValueError(f"cannot load checkpoint tensor {name!r}: {error}") from error
                param = f"model.layers.{layer}.self_attn.{kind}_layernorm.weight"
                norms[param] = norm
                heads_seen.setdefault(param, set()).add(head)

        loaded = super().load_weights(others())
        return loaded | {param for param, seen in heads_seen.items()
                         if len(seen) == norms[param].total_heads}
