"""Tiny random Qwen3-Next checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import redraw_weights

#: A 4-layer Qwen3-Next: three Gated DeltaNet layers and one gated full-attention layer,
#: twice as many value heads as key heads, the MoE with a gated shared expert (dense layer 1).
TINY_QWEN3_NEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "max_position_embeddings": 256,
    "layer_types": ["linear_attention", "linear_attention", "full_attention",
                    "linear_attention"],
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
}


def save_tiny_qwen3_next(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Qwen3-Next of :data:`TINY_QWEN3_NEXT` (``overrides`` change
    fields) to ``path``, weights redrawn far from their init and the decays in a real range
    (``A`` in [1, 16], ``dt_bias`` near 0); returns HF's model."""
    import transformers

    config = transformers.Qwen3NextConfig(**{**TINY_QWEN3_NEXT, **overrides})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(config).float().eval()
    redraw_weights(hf, std=0.15)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(0.0, 2.7)
                layer.linear_attn.dt_bias.uniform_(-0.5, 0.5)
    hf.save_pretrained(path)
    return hf
