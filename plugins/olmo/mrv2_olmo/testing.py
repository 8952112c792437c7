"""Tiny random OLMo hybrid checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import SSM_DECAYS, save_tiny_model

#: A 4-layer OLMo hybrid: Gated DeltaNet layers 0, 2, 3 (2 key heads of 16, 4 value heads of
#: 16: two value heads per key head), attention at layer 1 (4 query heads, 2 KV heads) with
#: transformers' default RoPE, ``beta`` up to 2, the LM head untied.
TINY_OLMO_HYBRID: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention",
                    "linear_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_olmo_hybrid(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``OlmoHybridForCausalLM`` of :data:`TINY_OLMO_HYBRID`
    (``overrides`` change fields) to ``path``, weights redrawn far from their init and the
    decays in a real range (``A_log`` in [0, 1.5], ``dt_bias`` in [-3, 0]); returns HF's
    model."""
    import transformers

    config = transformers.OlmoHybridConfig(**{**TINY_OLMO_HYBRID, **overrides})
    return save_tiny_model(path, "OlmoHybridForCausalLM", config, uniform=SSM_DECAYS)
