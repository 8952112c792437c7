"""Tiny random Mamba-2 checkpoints for the plugin's CPU tests and the GPU tests, and HF's gated
norm made per group (the original Mamba-2's, which this plugin runs) for references with
``n_groups`` above 1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import SSM_DECAYS, save_tiny_model

#: A 3-layer Mamba-2: 8 heads of 16 channels (``expand`` 2 over a hidden size of 64) in 2
#: groups (each rank one group at TP=2) of a 16-wide state; HF's chunked scan in chunks of 8
#: tokens (several per prompt); a ``dt`` clamp whose both ends change some time steps; biased
#: projections; the LM head untied.
TINY_MAMBA2: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "expand": 2, "num_heads": 8, "head_dim": 16,
    "n_groups": 2, "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 3,
    "chunk_size": 8, "time_step_limit": (0.05, 0.6), "use_bias": True, "use_conv_bias": True,
    "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_mamba2(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``Mamba2ForCausalLM`` of :data:`TINY_MAMBA2` (``overrides``
    change fields) to ``path``, weights redrawn far from their init and the SSM's decays in a
    real range (``A`` in [1, 4.5], ``dt_bias`` in [-3, 0]: ``dt`` on both sides of the clamp's
    ends); returns HF's model."""
    import transformers

    config = transformers.Mamba2Config(**{**TINY_MAMBA2, **overrides})
    return save_tiny_model(path, "Mamba2ForCausalLM", config, uniform=SSM_DECAYS)


def _per_group_forward(n_groups: int) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.to(torch.float32))
        g = h.view(*h.shape[:-1], n_groups, h.shape[-1] // n_groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.view(h.shape).to(dtype)
    return forward


@contextmanager
def hf_gated_norm_per_group(n_groups: int) -> Iterator[None]:
    """Within the block, HF's Mamba-2 ``MambaRMSNormGated`` normalises each of ``n_groups``
    groups of channels on its own (``mamba_ssm``'s ``RMSNormGated(group_size=d_ssm //
    ngroups)``, what this plugin computes) instead of all channels at once."""
    from transformers.models.mamba2 import modeling_mamba2

    cls = modeling_mamba2.MambaRMSNormGated
    original = cls.forward
    cls.forward = _per_group_forward(n_groups)  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.forward = original  # type: ignore[method-assign]


#: A 3-layer Mamba-1: 128 channels (``expand`` 2 over a hidden size of 64), a 16-wide state
#: per channel, a time step of rank 8, biased projections, the LM head untied.
TINY_MAMBA1: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "expand": 2, "state_size": 16, "conv_kernel": 4,
    "time_step_rank": 8, "num_hidden_layers": 3, "use_bias": True, "use_conv_bias": True,
    "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
    "use_associative_scan": False,
}

#: A 4-layer Jamba: Mamba-1 layers 0, 2, 3 (as TINY_MAMBA1's mixers), attention at layer 1
#: (4 query heads, 2 KV heads), 4 experts (top 2) at layers 1 and 3, dense MLPs elsewhere.
TINY_JAMBA: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
    "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
    "attn_layer_period": 3, "attn_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_dt_rank": 8, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "use_mamba_kernels": False,
    "use_associative_scan": False, "tie_word_embeddings": False, "eos_token_id": 1,
    "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_mamba1(path: str | Path, family: str = "Mamba", **overrides: Any
                     ) -> torch.nn.Module:
    """Save a random fp32 HF ``{family}ForCausalLM`` (``Mamba``, ``FalconMamba`` or ``Jamba``)
    of :data:`TINY_MAMBA1` (Jamba: :data:`TINY_JAMBA`; ``overrides`` change fields) to
    ``path``, weights redrawn far from their init and the SSM's decays in a real range (``A``
    in [-4.5, -1], ``dt_proj``'s bias in [-3, 0]); returns HF's model."""
    import transformers

    base = TINY_JAMBA if family == "Jamba" else TINY_MAMBA1
    config = getattr(transformers, f"{family}Config")(**{**base, **overrides})
    return save_tiny_model(path, f"{family}ForCausalLM", config,
                           uniform={"A_log": (0.0, 1.5), "dt_proj.bias": (-3.0, 0.0)})


#: A 5-layer Zamba2: Mamba-2 layers (4 heads of 16 channels, 2 groups of a 16-wide state,
#: chunks of 8 tokens) and hybrid layers 1, 3, 4 invoking 2 shared blocks (block 0 twice:
#: invocations 0 and 2; block 1 once), attention over 64 channels in 4 heads of 16 (2 KV
#: heads would be refused with adapters: 4), RoPE, q/k/v and MLP adapters of rank 8, exact
#: GELU, the LM head tied.
TINY_ZAMBA2: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 5,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 2,
    "n_mamba_heads": 4, "chunk_size": 8, "time_step_min": 0.05, "intermediate_size": 48,
    "hidden_act": "gelu", "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8,
    "use_mem_rope": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "use_mamba_kernels": False,
    "tie_word_embeddings": True, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_zamba2(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``Zamba2ForCausalLM`` of :data:`TINY_ZAMBA2` (``overrides``
    change fields) to ``path``, weights redrawn far from their init (the adapters too) and the
    SSM's decays in a real range (``A`` in [-4.5, -1], ``dt_bias`` in [-3, 0]: some ``dt``
    below the ``time_step_min`` clamp); returns HF's model."""
    import transformers

    config = transformers.Zamba2Config(**{**TINY_ZAMBA2, **overrides})
    return save_tiny_model(path, "Zamba2ForCausalLM", config, uniform=SSM_DECAYS)
