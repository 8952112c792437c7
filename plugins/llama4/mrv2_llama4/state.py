"""Llama 4's engine-side pieces: the model state, which refuses a context its chunked
attention would need (the core attends causally only), and the multimodal checkpoints' input
processor, which refuses images (the vision tower is not served yet; text prompts run)."""

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
from mrv2_llama4.model import chunked_layers

__all__ = ["Llama4InputProcessor", "Llama4ModelState", "check_max_model_len"]


def check_max_model_len(text_config: Any, max_model_len: int | None) -> None:
    """ValueError naming ``max_model_len`` and ``attention_chunk_size`` where the context
    would pass a chunk of a chunked-attention layer: the core's attention has no chunked mode,
    and up to ``attention_chunk_size`` positions chunked attention is causal attention.
    ``max_model_len`` None: the engine's default, ``max_position_embeddings``."""
    if not any(chunked_layers(text_config)):
        return
    chunk = int(text_config.attention_chunk_size)
    length = int(max_model_len if max_model_len is not None
                 else text_config.max_position_embeddings)
    if length > chunk:
        where = "" if max_model_len is not None else " (max_position_embeddings, the default)"
        raise ValueError(
            f"max_model_len={length}{where} exceeds attention_chunk_size={chunk}: Llama 4's "
            f"chunked-attention layers see only their chunk of attention_chunk_size positions, "
            f"which mrv2 does not implement; set max_model_len <= {chunk} (where chunked "
            f"attention equals causal attention)")


class Llama4ModelState(ModelState):
    """The core's decoder-only state, after :func:`check_max_model_len` (before the KV cache
    is sized)."""

    def __init__(self, model: nn.Module, hf_config: Any, config: EngineConfig,
                 buffers: InputBuffers, block_size: int, device: torch.device) -> None:
        check_max_model_len(text_config_of(hf_config), config.model.max_model_len)
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
