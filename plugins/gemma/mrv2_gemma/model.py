"""Gemma 3's text decoder (``Gemma3ForCausalLM``, HF ``Gemma3TextConfig``).

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

Refused with a ValueError naming the field: attention or final logit soft-capping (Gemma 2's),
bidirectional attention (EmbeddingGemma). The KV cache keeps every token of a local layer
(blocks outside the window are not freed yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    head_dim_of,
    norm_linear,
)
from mrv2.layers.embedding import VocabEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _check(config: PretrainedConfig) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"config.json {name} = {getattr(config, name)!r}: soft-capping "
                             "(Gemma 2) is not supported; Gemma 3 sets it to null")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.json use_bidirectional_attention = true (EmbeddingGemma) is "
                         "not supported: mrv2's attention is causal")
    kinds = set(config.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types holds {sorted(kinds)}: allowed values are "
                         "'sliding_attention' and 'full_attention'")


def gemma3_rope(config: PretrainedConfig, kind: str, head_dim: int) -> RotaryEmbedding:
    """The RoPE of ``kind`` layers (``"sliding_attention"`` / ``"full_attention"``) from
    ``config.rope_parameters[kind]`` (transformers 5; older configs' ``rope_local_base_freq``
    / ``rope_theta`` / ``rope_scaling`` are converted into it when the config loads)."""
    every = getattr(config, "rope_parameters", None) or {}
    params = every.get(kind) if isinstance(every, Mapping) else None
    if params is None:
        raise ValueError(f"config.json rope_parameters has no {kind!r} entry")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    scaling = None if rope_type == "default" else dict(params)
    return RotaryEmbedding(head_dim, max_position=int(config.max_position_embeddings),
                           base=float(params["rope_theta"]), scaling=scaling)


class ScaledEmbedding(VocabEmbedding):
    """Token embeddings times ``scale`` (rounded to the embedding's dtype first, as HF's
    ``Gemma3TextScaledWordEmbedding``); the tied LM head reads the unscaled table."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = cast(torch.Tensor, super().forward(input_ids))
        return rows * torch.tensor(self.scale, dtype=rows.dtype, device=rows.device)


class Gemma3DecoderLayer(nn.Module):
    """Attention and GeGLU MLP, each between a pre- and a post-norm (HF's names); the input
    norm runs fused with the QKV projection, the residual add fused into the next norm."""

    def __init__(self, config: PretrainedConfig, layer_idx: int,
                 ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        kind = config.layer_types[layer_idx]
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(  # (local layers: the window, from layer_types)
            config, layer_idx, ropes[kind], qkv_bias=bias, o_bias=bias, qk_norm=True,
            scale=float(config.query_pre_attn_scalar) ** -0.5)
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


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        _check(config)
        head_dim = head_dim_of(config)
        ropes = {kind: gemma3_rope(config, kind, head_dim) for kind in set(config.layer_types)}
        model = DecoderModel(config, lambda i: Gemma3DecoderLayer(config, i, ropes))
        model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                             float(config.hidden_size) ** 0.5)
        super().__init__(config, model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, every norm weight ``w`` loaded as ``1 + w`` (computed in
        fp32)."""
        return super().load_weights((name, _fold_norm(name, t)) for name, t in weights)


def _fold_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor


def gemma3_text_config(**overrides: Any) -> PretrainedConfig:
    """A ``Gemma3TextConfig`` (transformers) with ``overrides``, naming the architecture."""
    import transformers

    config = transformers.Gemma3TextConfig(**overrides)
    config.architectures = ["Gemma3ForCausalLM"]
    return cast("PretrainedConfig", config)
