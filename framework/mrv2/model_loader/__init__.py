"""Checkpoint loading: safetensors iteration, weight-name mapping helpers, dummy weights."""

from mrv2.model_loader.loader import (
    default_weight_loader,
    expert_weight_target,
    init_dummy_weights,
    iter_safetensors,
    load_model_weights,
    load_param,
    load_stacked_weights,
)

__all__ = [
    "default_weight_loader",
    "expert_weight_target",
    "init_dummy_weights",
    "iter_safetensors",
    "load_model_weights",
    "load_param",
    "load_stacked_weights",
]
