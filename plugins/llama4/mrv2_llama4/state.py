"""Llama 4's engine-side pieces: the model state, which sizes the RoPE table to the engine's
context length, and the multimodal checkpoints' input processor, which refuses images (the
vision tower is not served yet; text prompts run)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mrv2.config import EngineConfig
from mrv2.contract.batch import InputBuffers
from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.model_state import ModelState
from mrv2.contract.requests import MultiModalItem
from mrv2.model_loader.build import text_config_of
from mrv2_llama4.model import Llama4ForCausalLM

__all__ = ["Llama4InputProcessor", "Llama4ModelState", "context_length"]


def context_length(text_config: Any, max_model_len: int | None) -> int:
    """The engine's context length: ``max_model_len``, or where unset the runner's default,
    ``max_position_embeddings``. (Any length runs: the chunked-attention layers attend within
    their chunks of ``attention_chunk_size`` positions.)"""
    return int(max_model_len if max_model_len is not None
               else text_config.max_position_embeddings)


class Llama4ModelState(ModelState):
    """The core's decoder-only state; first sizes the model's RoPE table to the engine's
    context length (:func:`context_length`; not the 10M positions of Scout's
    ``max_position_embeddings``), before anything runs."""

    def __init__(self, model: nn.Module, hf_config: Any, config: EngineConfig,
                 buffers: InputBuffers, block_size: int, device: torch.device) -> None:
        if isinstance(model, Llama4ForCausalLM):
            model.size_rope_table(context_length(text_config_of(hf_config),
                                                 config.model.max_model_len))
        super().__init__(model, hf_config, config, buffers, block_size, device)


class Llama4InputProcessor(InputProcessor):
    """Refuses every media item of a prompt to ``Llama4ForConditionalGeneration`` with a
    ValueError naming ``multi_modal_data.<kind>``: its vision tower is not served yet (text
    prompts need no processor and run)."""

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Never returns for media; a prompt with an empty ``multi_modal_data`` passes as
        text."""
        if not mm_data:
            return list(prompt_token_ids), []
        kind = next(iter(mm_data))
        raise ValueError(f"multi_modal_data.{kind}: Llama 4's vision encoder is not supported "
                         f"by mrv2 yet; Llama4ForConditionalGeneration serves text prompts only")
