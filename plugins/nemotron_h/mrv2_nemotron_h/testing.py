"""Tiny random Nemotron-H checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import SSM_DECAYS, save_tiny_model

#: A 5-layer Nemotron-H: two Mamba-2 mixers (4 heads in 2 groups), one attention layer (GQA,
#: no RoPE), two squared-ReLU MLPs; HF's chunked scan in chunks of 8 tokens (several per
#: prompt); ``time_step_min`` high enough that its clamp changes some ``dt``.
TINY_NEMOTRON_H: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention",
                          "mlp"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16,
    "conv_kernel": 4, "chunk_size": 8, "time_step_min": 0.05, "use_conv_bias": True,
    "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "max_position_embeddings": 256,
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_nemotron_h(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Nemotron-H of :data:`TINY_NEMOTRON_H` (``overrides`` change
    fields) to ``path``, weights redrawn far from their init and the SSM's decays in a real
    range (``A`` in [1, 4.5], ``dt_bias`` in [-3, 0]: ``dt`` both sides of ``time_step_min``);
    returns HF's model."""
    import transformers

    config = transformers.NemotronHConfig(**{**TINY_NEMOTRON_H, **overrides})
    return save_tiny_model(path, "NemotronHForCausalLM", config, uniform=SSM_DECAYS)
