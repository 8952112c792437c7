"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) and Qwen2-VL
(``Qwen2VLForConditionalGeneration``: the same decoder, its own vision tower) in the mrv2 model
contract.

The language model is Qwen2's decoder (q/k/v biased, no q/k norm) over the flat token batch,
rotating by M-RoPE (:mod:`mrv2_qwen_vl.mrope`: its positions are ``[3, T]``, which the model
state computes on the device each step). The vision tower (:mod:`mrv2_qwen_vl.vision`) is a
submodule, run by :class:`~mrv2_qwen_vl.model_state.QwenVLModelState` on a step's new images
and videos, not by ``forward``: the forward takes their embeddings spliced into ``inputs_embeds``.

Checkpoints load as published (``model.layers.*``, ``visual.*``, ``lm_head.weight``) and as
transformers' in-memory names (``model.language_model.*``, ``model.visual.*``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from mrv2.layers import CausalLM, DecoderLayer, DecoderModel, GatedMLP, SelfAttention, head_dim_of
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config
from mrv2_qwen_vl.mrope import get_mrope
from mrv2_qwen_vl.vision import CHECKPOINT_PREFIXES, Qwen25VisionTower, QwenVisionBase
from mrv2_qwen_vl.vision_qwen2 import Qwen2VisionTower

__all__ = ["Qwen25VLForConditionalGeneration", "Qwen2VLForConditionalGeneration"]


def load_text_and_vision(model: CausalLM, visual: Any, prefixes: tuple[str, ...],
                         weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """A vision-language checkpoint's tensors: those under ``prefixes`` (the tower's) through
    ``visual.load_weights``, the rest (``model.language_model.*`` read as ``model.*``) through
    the text decoder's loader; the parameter names loaded."""
    renamed = ((name.replace("model.language_model.", "model.", 1), tensor)
               for name, tensor in weights)
    return load_text_and_encoder(functools.partial(CausalLM.load_weights, model), visual,
                                 prefixes, renamed, "visual")


class Qwen25VLForConditionalGeneration(CausalLM):
    """Qwen2.5-VL: Qwen2 text decoder with M-RoPE, plus the vision tower (``visual``)."""

    #: The vision tower's class (built from ``config.vision_config``).
    tower_class: ClassVar[type[QwenVisionBase]] = Qwen25VisionTower

    media_encoders: ClassVar[tuple[str, ...]] = ("visual",)

    def __init__(self, config: Any) -> None:
        text = vl_text_config(config)
        rope = get_mrope(text, head_dim_of(text))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(text, i, rope, qkv_bias=True)
            mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)
            return DecoderLayer(text, attention, mlp)

        super().__init__(text, DecoderModel(text, layer))
        self.hf_config = config
        self.visual = self.tower_class(config.vision_config)

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                     ) -> torch.Tensor:
        """``[N, out_hidden]`` merged image tokens of the images in ``pixel_values`` (their
        patch rows in order) with patch grids ``grid_thw``, in the model dtype."""
        return self.visual(pixel_values, grid_thw).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's: transformers' ``model.language_model.*``
        is ``model.*`` (LoRA adapters of these models use either)."""
        return super().rename(name.replace("model.language_model.", "model.", 1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Text weights through the decoder's loader, ``visual.*`` through the tower's."""
        return load_text_and_vision(self, self.visual, CHECKPOINT_PREFIXES, weights)


class Qwen2VLForConditionalGeneration(Qwen25VLForConditionalGeneration):
    """Qwen2-VL, the first generation: the same Qwen2 decoder with M-RoPE, positions and
    checkpoint layout (its videos' frame groups advance the temporal position by 1, not by
    Qwen2.5-VL's ``tokens_per_second`` interval: the input processor sets it), with its own
    tower (:class:`~mrv2_qwen_vl.vision_qwen2.Qwen2VisionTower`:
    LayerNorm blocks, full attention in every block)."""

    tower_class = Qwen2VisionTower
