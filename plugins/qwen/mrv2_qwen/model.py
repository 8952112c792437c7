"""Qwen3 dense decoder (``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm before RoPE."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from mrv2.layers import (
    Attention,
    LMHead,
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    SiluAndMul,
    VocabEmbedding,
    get_rope,
    norm_linear,
)
from mrv2.model_loader import load_stacked_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def head_dim_of(config: PretrainedConfig) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when it is unset."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


class Qwen3Attention(nn.Module):
    """Fused QKV projection, q/k RMSNorm per head, RoPE, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=bias
        )
        self.o_proj = RowLinear(num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(
            num_heads, num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the QKV projection: q/k norms, RoPE, attention, output projection."""
        q, k, v = self.qkv_proj.split(qkv)
        # Per-head q/k norms (both built with config.rms_norm_eps) fused into the rotation.
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb, qk_norm=norms)
        return self.o_proj(out)


class Qwen3MLP(nn.Module):
    """SwiGLU MLP with fused gate/up projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"Qwen3 MLP supports hidden_act 'silu' only, got {config.hidden_act!r}"
            )
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size])
        self.act_fn = SiluAndMul()
        self.down_proj = RowLinear(size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual add is fused into the following norm."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx, rope)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm runs fused with the projection after it (one launch per decode step).
        qkv, residual = norm_linear(
            self.input_layernorm, self.self_attn.qkv_proj, hidden_states, residual
        )
        hidden_states = self.self_attn.attend(positions, qkv)
        act, residual = norm_linear(
            self.post_attention_layernorm, self.mlp.gate_up_proj, hidden_states, residual,
            silu_and_mul=True,
        )
        return self.mlp.down_proj(act), residual


class Qwen3Model(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rope = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, rope) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 causal LM in the mrv2 model contract (flat token batch, paged attention)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = Qwen3Model(config)
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]`` -> final hidden states ``[T, hidden_size]``
        (``inputs_embeds`` ``[T, hidden_size]``, when given, replaces the token embeddings)."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden_size]`` input embeddings."""
        return cast(torch.Tensor, self.model.embed_tokens(input_ids))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` in the model dtype."""
        return self.lm_head(hidden_states)

    def _rename(self, name: str) -> str | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors; returns the parameter names loaded."""
        return load_stacked_weights(self, weights, STACKED_PARAMS, self._rename)
