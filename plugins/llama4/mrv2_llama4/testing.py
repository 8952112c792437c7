"""Tiny random Llama 4 checkpoints (text-only and multimodal) for the plugin's CPU tests and
the GPU tests, built and saved by HF transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import redraw_weights

__all__ = ["TINY_LLAMA4", "TINY_VISION", "save_tiny_llama4", "save_tiny_llama4_vl"]

#: A 4-layer Llama 4 text model where every option bites: layers 0 and 1 RoPE (llama3
#: scaling, q/k norm, chunked attention: chunks of 64, as long as the context), 2 and 3 NoPE
#: with the query temperature (``floor_scale`` 2: the scale grows every other position);
#: layers 1 and 3 MoE (4 experts, top-1 sigmoid, a shared expert), 0 and 2 dense (a wider
#: MLP). GQA (4 query heads, 2 KV heads) of head_dim 16.
TINY_LLAMA4: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 32,
    "intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2, "no_rope_layers": [1, 1, 0, 0], "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 2, "attn_scale": 0.5,
    "attention_chunk_size": 64, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16},
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}

#: The smallest vision tower HF builds (one layer; never run: images are refused).
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 64, "vision_output_dim": 32, "image_size": 28, "patch_size": 14,
    "projector_input_dim": 32, "projector_output_dim": 32,
}


def save_tiny_llama4(path: str | Path, std: float = 0.15, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``Llama4ForCausalLM`` of :data:`TINY_LLAMA4` (``overrides``
    change fields; weights redrawn with ``std``: attention and routing decisive) to
    ``path``; returns HF's model."""
    import transformers

    config = transformers.Llama4TextConfig(**{**TINY_LLAMA4, **overrides})
    config.architectures = ["Llama4ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Llama4ForCausalLM(config).float().eval()
    redraw_weights(hf, std=std)
    hf.save_pretrained(path)
    return hf


def save_tiny_llama4_vl(path: str | Path, std: float = 0.15, **overrides: Any
                        ) -> torch.nn.Module:
    """Save a random fp32 HF ``Llama4ForConditionalGeneration`` whose text model is
    :data:`TINY_LLAMA4` (``overrides`` change its fields) and whose vision tower is
    :data:`TINY_VISION`, image tokens at the top of the vocabulary; returns HF's model."""
    import transformers

    text = {**TINY_LLAMA4, **overrides}
    config = transformers.Llama4Config(
        text_config=text, vision_config=dict(TINY_VISION), image_token_index=125,
        boi_token_index=126, eoi_token_index=127, tie_word_embeddings=False)
    config.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config).float().eval()
    redraw_weights(hf, std=std)
    hf.save_pretrained(path)
    return hf
