"""Tiny random MiniMax-Text-01 checkpoints (HF's ``MiniMaxForCausalLM``) for the plugin's CPU
tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import save_tiny_model

#: A 4-layer MiniMax-Text-01: lightning attention on layers 0, 2 and 3, softmax attention on
#: layer 1, four experts (top 2) everywhere, residual factors away from 1, HF's lightning
#: block of 4 tokens (its prefill crosses blocks).
TINY_MINIMAX: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 4,
    "max_position_embeddings": 256,
    "layer_types": ["linear_attention", "full_attention", "linear_attention",
                    "linear_attention"],
    "full_attn_alpha_factor": 0.8, "full_attn_beta_factor": 1.3,
    "linear_attn_alpha_factor": 1.2, "linear_attn_beta_factor": 0.7,
    "mlp_alpha_factor": 0.9, "mlp_beta_factor": 1.1,
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
}


def save_tiny_minimax(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF MiniMax of :data:`TINY_MINIMAX` (``overrides`` change fields)
    to ``path``, weights redrawn far from their init; returns HF's model."""
    import transformers

    config = transformers.MiniMaxConfig(**{**TINY_MINIMAX, **overrides})
    return save_tiny_model(path, "MiniMaxForCausalLM", config)
