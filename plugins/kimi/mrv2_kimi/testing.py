"""Tiny random Kimi-Linear checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import DELTA_NET_DECAYS, save_tiny_model

#: A 4-layer Kimi-Linear: KDA layers 0, 1 and 3, an MLA layer 2 (no q LoRA), a dense MLP on
#: layer 0 and the MoE (four experts in two groups, a shared expert) on the others.
TINY_KIMI_LINEAR: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "linear_head_dim": 16,
    "linear_num_heads": 2, "linear_conv_kernel_dim": 4, "max_position_embeddings": 256,
    "layer_types": ["linear_attention", "linear_attention", "full_attention",
                    "linear_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": None,
}


def save_tiny_kimi_linear(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Kimi-Linear of :data:`TINY_KIMI_LINEAR` (``overrides`` change
    fields) to ``path`` (transformers writes the published layout: ``q/k/v_conv1d``,
    ``block_sparse_moe``, ``experts.{e}.w1/w2/w3``), weights redrawn far from their init and
    the decays in a real range (``A`` in [1, 16], ``dt_bias`` near 0); returns HF's model."""
    import transformers

    config = transformers.KimiLinearConfig(**{**TINY_KIMI_LINEAR, **overrides})
    return save_tiny_model(path, "KimiLinearForCausalLM", config, uniform=DELTA_NET_DECAYS)
