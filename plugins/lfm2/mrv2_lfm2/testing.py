"""Tiny random LFM2 checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import redraw_weights

#: A 4-layer LFM2: convolution layers (width 4: a prompt of more than 3 tokens fills the
#: state) around two attention layers (4 heads of 16, 2 key/value heads), biases on the
#: convolutions, an untied LM head; ``intermediate_size`` 144 -> 96 -> times 1.3 = 124 ->
#: rounded up to 128 (``block_multiple_of`` 32).
TINY_LFM2: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 144, "num_hidden_layers": 4,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 4, "conv_bias": True,
    "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.3,
    "block_multiple_of": 32, "norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_lfm2(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF LFM2 of :data:`TINY_LFM2` (``overrides`` change fields) to
    ``path``, weights redrawn far from their init; returns HF's model."""
    import transformers

    config = transformers.Lfm2Config(**{**TINY_LFM2, **overrides})
    config.architectures = ["Lfm2ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Lfm2ForCausalLM(config).float().eval()
    redraw_weights(hf, std=0.15)
    hf.save_pretrained(path)
    return hf
