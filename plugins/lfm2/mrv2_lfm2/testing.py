"""Tiny random LFM2 and LFM2-MoE checkpoints for the plugin's CPU tests and the GPU tests."""

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


#: A 5-layer LFM2-MoE: a convolution and an attention layer with dense SwiGLUs of 96
#: (``num_dense_layers`` 2), then convolution, attention, convolution layers each with a
#: sparse MoE block of 8 experts of 32, two a token, sigmoid scores with an expert bias,
#: renormalized and scaled by 1.5 (LFM2-8B-A1B: 1.0; here not 1, so the factor counts);
#: width-4 convolutions with biases, an untied LM head.
TINY_LFM2_MOE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
    "moe_intermediate_size": 32, "num_dense_layers": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "use_expert_bias": True, "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "layer_types": ["conv", "full_attention", "conv", "full_attention", "conv"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 4, "conv_bias": True,
    "norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_lfm2_moe(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF LFM2-MoE of :data:`TINY_LFM2_MOE` (``overrides`` change fields)
    to ``path``, weights redrawn far from their init and each MoE block's ``expert_bias``
    (a buffer HF inits to zeros) uniform in [-0.3, 0.3) so it changes picks; returns HF's
    model."""
    import transformers

    config = transformers.Lfm2MoeConfig(**{**TINY_LFM2_MOE, **overrides})
    config.architectures = ["Lfm2MoeForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Lfm2MoeForCausalLM(config).float().eval()
    redraw_weights(hf, std=0.15)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith(".feed_forward.expert_bias"):
                buffer.copy_((torch.rand(buffer.shape, generator=gen) - 0.5) * 0.6)
    hf.save_pretrained(path)
    return hf
