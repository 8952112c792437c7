"""Llama 4's text model state, which sizes the RoPE table to the engine's context length (the
multimodal checkpoints' state and input processor, which do the same and serve images, are
in :mod:`mrv2_llama4.inputs`)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mrv2.config import EngineConfig
from mrv2.contract.batch import InputBuffers
from mrv2.contract.model_state import ModelState
from mrv2.layers.rotary import context_limit
from mrv2.model_loader.build import text_config_of
from mrv2_llama4.model import Llama4ForCausalLM

__all__ = ["Llama4ModelState", "context_length"]


def context_length(text_config: Any, max_model_len: int | None) -> int:
    """The engine's context length: ``max_model_len``, or where unset the runner's default,
    :func:`context_limit` (``max_position_embeddings``: Llama 4's ``llama3`` scaling states
    its length there). (Any length runs: the chunked-attention layers attend within their
    chunks of ``attention_chunk_size`` positions.)"""
    return int(max_model_len if max_model_len is not None
               else cast(int, context_limit(text_config)[0]))


class Llama4ModelState(ModelState):
    """The core's decoder-only state; first sizes the model's RoPE table to the engine's
    context length (:func:`context_length`; not the 10M positions of Scout's
    ``max_position_embeddings``), before anything runs."""

    def __init__(self, model: nn.Module, hf_config: Any, config: EngineConfig,
                 buffers: InputBuffers, block_size: int, device: torch.device) -> None:
        if isinstance(model, Llama4ForCausalLM):
            model.size_rope_table(context_length(text_config_of(hf_config),
                                                 config.model.fixed_max_model_len))
        super().__init__(model, hf_config, config, buffers, block_size, device)
