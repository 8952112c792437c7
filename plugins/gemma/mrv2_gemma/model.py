"""Gemma 3's text decoder (``Gemma3ForCausalLM``, HF ``Gemma3TextConfig``) and Gemma 2
(``Gemma2ForCausalLM``).

What sets it apart from the usual pre-norm decoder, each built from the core's layers:

- **Local and global layers.** ``config.layer_types`` makes most layers ``sliding_attention``
  (a query sees its last ``sliding_window`` keys, its own included: the core's
  :class:`~mrv2.layers.Attention` ``sliding_window``) and every sixth ``full_attention``;
  each kind has its own RoPE (``rope_parameters["sliding_attention"]``: base 10,000;
  ``["full_attention"]``: base 1,000,000, with linear scaling on the 4B+ checkpoints).
- **Four norms a layer**: ``input_layernorm`` before attention, ``post_attention_layernorm``
  on its output before the residual add, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP; q/k norms per head, as Qwen3.
- **Norm weights are offsets**: Gemma's RMSNorm multiplies by ``1 + weight``. The loader
  adds the 1 (in fp32, before the weight takes the model dtype), so the core's RMSNorm and its
  fused kernels run them unchanged. (HF multiplies in fp32 before rounding; in bf16 the folded
  weight and the core's norm round once more, within bf16's precision.)
- **GeGLU MLP** (``gelu_pytorch_tanh``), **scaled embeddings** (``* sqrt(hidden_size)``,
  the factor rounded to the model dtype as HF does), scores scaled by
  ``query_pre_attn_scalar ** -0.5``, tied embeddings.

Gemma 2 is the same decoder without q/k norms, with one RoPE for every layer and with
soft-capped logits: attention scores ``50 * tanh(score / 50)`` (the core's
:class:`~mrv2.layers.Attention` ``logit_softcap``) and final logits ``30 * tanh(logit / 30)``.

Refused with a ValueError naming the field: soft-capping in a Gemma 3 config, bidirectional
attention (EmbeddingGemma). A local layer's KV blocks that fall out of its window go back to
the pool (its own block table: :mod:`mrv2.runner.kv_tables`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_linear,
)
from mrv2.layers.embedding import ScaledEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _check(config: PretrainedConfig, softcaps: bool) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if not softcaps and getattr(config, name, None) is not None:
            raise ValueError(f"config.json {name} = {getattr(config, name)!r}: soft-capping "
                             "is Gemma 2's; Gemma 3 sets it to null")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.json use_bidirectional_attention = true (EmbeddingGemma) is "
                         "not supported: mrv2's attention is causal")
    kinds = set(config.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types holds {sorted(kinds)}: allowed values are "
                         "'sliding_attention' and 'full_attention'")


class GemmaDecoderLayer(nn.Module):
    """Attention and GeGLU MLP, each between a pre- and a post-norm (HF's names); the input
    norm runs fused with the QKV projection, the residual add fused into the next norm.
    ``qk_norm``: Gemma 3's per-head q/k norms; the attention soft-cap: Gemma 2's."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding,
                 qk_norm: bool) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        softcap = getattr(config, "attn_logit_softcapping", None)
        self.self_attn = SelfAttention(  # (local layers: the window, from layer_types)
            config, layer_idx, rope, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            logit_softcap=None if softcap is None else float(softcap))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            config.hidden_activation)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                    hidden_states, residual)
        attn = self.post_attention_layernorm(self.self_attn.attend(positions, qkv))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class _Gemma(CausalLM):
    """What Gemma 2 and 3 share: scaled embeddings, norms as offsets, final soft-cap."""

    def __init__(self, config: PretrainedConfig, make_layer: Any) -> None:
        model = DecoderModel(config, make_layer)
        model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                             float(config.hidden_size) ** 0.5, round_scale=True)
        super().__init__(config, model)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_softcap = None if cap is None else float(cap)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, every norm weight ``w`` loaded as ``1 + w`` (computed in
        fp32)."""
        return super().load_weights((name, _fold_norm(name, t)) for name, t in weights)


class Gemma3ForCausalLM(_Gemma):
    """Gemma 3's text decoder in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        _check(config, softcaps=False)
        head_dim = head_dim_of(config)
        ropes = {kind: get_rope(config, head_dim, kind) for kind in set(config.layer_types)}
        super().__init__(config, lambda i: GemmaDecoderLayer(
            config, i, ropes[config.layer_types[i]], qk_norm=True))


class Gemma2ForCausalLM(_Gemma):
    """Gemma 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        _check(config, softcaps=True)
        rope = get_rope(config, head_dim_of(config))
        super().__init__(config, lambda i: GemmaDecoderLayer(config, i, rope, qk_norm=False))


def _fold_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
