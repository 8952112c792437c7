"""Helpers of the GLM plugin's tests: tiny GLM-4.x MoE checkpoints; running a model one step at
a time through the paged cache comes from :mod:`mrv2.testing` (no other plugin's test code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from mrv2.testing import (  # noqa: F401 (the GLM tests import these from here)
    poisoned_caches,
    redraw_weights,
    run_step,
    step_metadata,
    torch_context,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 32
VOCAB = 128

#: Every routing feature at once: 4 groups of 2 experts, 2 groups kept, 3 picks, 2 shared
#: experts, scaled weights; layer 0 dense, 1-2 sparse; partial rotary (12 of 24 dims), q/k/v
#: biases, head_dim not hidden / heads; one MTP layer in the checkpoint's config.
GLM: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "n_routed_experts": 8,
    "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "max_position_embeddings": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
}


def glm_config(**overrides: Any) -> transformers.Glm4MoeConfig:
    """The tiny GLM config, ``overrides`` applied."""
    config = transformers.Glm4MoeConfig(**{**GLM, **overrides})
    config.architectures = ["Glm4MoeForCausalLM"]
    return config


def save_hf_glm(path: Path, **overrides: Any) -> transformers.Glm4MoeForCausalLM:
    """A random HF ``Glm4MoeForCausalLM`` (:func:`mrv2.testing.redraw_weights`) saved."""
    torch.manual_seed(0)
    hf = transformers.Glm4MoeForCausalLM(glm_config(**overrides)).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def new_caches(config: Any, count: int) -> list[torch.Tensor]:
    """``count`` poisoned paged KV caches of the tiny GLM's shape."""
    return poisoned_caches(config.num_key_value_heads, config.head_dim, count, NUM_BLOCKS,
                           BLOCK_SIZE)
