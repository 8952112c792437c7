"""Tiny random Falcon-H1 checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import SSM_DECAYS, save_tiny_model

#: A 3-layer Falcon-H1: each layer attention (4 heads of 24, 2 key/value heads: ``head_dim``
#: apart from ``hidden_size / heads``) beside a Mamba-2 mixer (8 heads of 16 in 2 groups:
#: ``mamba_d_ssm`` 128, not ``mamba_expand * hidden_size``), the gated norm before the gate;
#: every multiplier away from 1 (each of ``ssm_multipliers`` and ``mlp_multipliers``
#: different); HF's chunked scan in chunks of 8 tokens; a ``dt`` clamp whose both ends change
#: some time steps.
TINY_FALCON_H1: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "mamba_d_ssm": 128, "mamba_expand": 3, "mamba_n_heads": 8, "mamba_d_head": "auto",
    "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_chunk_size": 8,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "projectors_bias": False,
    "mamba_rms_norm": True, "mamba_norm_before_gate": True, "time_step_limit": (0.05, 0.6),
    "embedding_multiplier": 2.5, "lm_head_multiplier": 0.7, "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.8, "key_multiplier": 0.6, "ssm_in_multiplier": 1.2,
    "ssm_out_multiplier": 0.9, "ssm_multipliers": [0.5, 1.5, 0.7, 1.3, 0.8],
    "mlp_multipliers": [1.4, 0.6],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_falcon_h1(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Falcon-H1 of :data:`TINY_FALCON_H1` (``overrides`` change fields)
    to ``path``, weights redrawn far from their init and the SSM's decays in a real range
    (``A`` in [1, 4.5], ``dt_bias`` in [-3, 0]: ``dt`` on both sides of the clamp's ends);
    returns HF's model."""
    import transformers

    config = transformers.FalconH1Config(**{**TINY_FALCON_H1, **overrides})
    return save_tiny_model(path, "FalconH1ForCausalLM", config, uniform=SSM_DECAYS)
