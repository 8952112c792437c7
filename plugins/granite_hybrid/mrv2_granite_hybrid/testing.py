"""Tiny random Granite 4.0-H, Bamba and Granite 3.x MoE checkpoints for the plugin's CPU tests
and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import SSM_DECAYS, save_tiny_model

#: A 4-layer Granite 4.0-H: Mamba-2 mixers (8 heads of 16 in 2 groups: each rank one group at
#: TP=2) around two attention layers (GQA), MoE of 4 experts (top 2) plus the shared MLP;
#: every multiplier away from 1; HF's chunked scan in chunks of 8 tokens; a ``dt`` clamp
#: whose both ends change some time steps.
TINY_GRANITE_HYBRID: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 48,
    "shared_intermediate_size": 80, "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "time_step_limit": (0.05, 0.6),
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "embedding_multiplier": 3.0, "attention_multiplier": 0.2, "residual_multiplier": 0.6,
    "logits_scaling": 1.7, "position_embedding_type": "nope",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": True,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}

#: A 3-layer Bamba (Mamba-2, attention, Mamba-2) of the same sizes, its dense gated MLP of
#: ``intermediate_size``.
TINY_BAMBA: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "attn_layer_indices": [1], "num_attention_heads": 4, "num_key_value_heads": 2,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_conv_bias": True,
    "mamba_proj_bias": True, "time_step_limit": (0.05, 0.6),
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


#: A 3-layer Granite 3.x MoE (GQA attention with RoPE; 4 experts, top 2): every multiplier
#: away from 1 (the embeddings' small enough that the tied LM head's greedy tokens do not
#: just repeat one token). ``GraniteMoeShared`` adds a shared expert of
#: ``shared_intermediate_size``.
TINY_GRANITE_MOE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "embedding_multiplier": 0.5, "attention_multiplier": 0.2, "residual_multiplier": 1.2,
    "logits_scaling": 1.7,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": True,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_granite_hybrid(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Granite 4.0-H of :data:`TINY_GRANITE_HYBRID` (``overrides``
    change fields) to ``path``; returns HF's model."""
    import transformers

    config = transformers.GraniteMoeHybridConfig(**{**TINY_GRANITE_HYBRID, **overrides})
    return save_tiny_model(path, "GraniteMoeHybridForCausalLM", config, uniform=SSM_DECAYS)


def save_tiny_bamba(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Bamba of :data:`TINY_BAMBA` (``overrides`` change fields) to
    ``path``; returns HF's model."""
    import transformers

    config = transformers.BambaConfig(**{**TINY_BAMBA, **overrides})
    return save_tiny_model(path, "BambaForCausalLM", config, uniform=SSM_DECAYS)


def save_tiny_granite_moe(path: str | Path, shared: bool = False, swa: bool = False,
                          **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``GraniteMoeForCausalLM`` (``shared``:
    ``GraniteMoeSharedForCausalLM``, ``shared_intermediate_size`` 80 unless overridden;
    ``swa``: ``GraniteMoeSWAForCausalLM``, its attention sinks drawn in [-1, 2), far from HF's
    zeros) of :data:`TINY_GRANITE_MOE` (``overrides`` change fields) to ``path``; returns
    HF's model."""
    import transformers

    name = "GraniteMoeSWA" if swa else "GraniteMoeShared" if shared else "GraniteMoe"
    fields = {**TINY_GRANITE_MOE, **({"shared_intermediate_size": 80} if shared else {}),
              **overrides}
    config = getattr(transformers, name + "Config")(**fields)
    return save_tiny_model(path, name + "ForCausalLM", config,
                           uniform={"self_attn.sinks": (-1.0, 2.0)})
