"""Mistral 3's vision-language checkpoints (``Mistral3ForConditionalGeneration``: Mistral Small
3.1 / 3.2 24B, Ministral 3 and their fine-tunes) in the mrv2 model contract.

HF's model is Mistral's text decoder (Llama's layers; a ``sliding_window``, where the config
sets one, on every layer; ``text_config.model_type`` one of :data:`TEXT_KINDS`, any other
refused naming it) plus the image encoder (:class:`~mrv2_mistral3.vision.
Mistral3VisionEncoder`: the Pixtral vision tower and the projector with its patch merger).
The decoder is built from ``text_config``, the LM head tied by the *top-level*
``tie_word_embeddings`` as HF ties it. An image's features replace its ``[IMG]`` placeholders'
embeddings; the ``[IMG_BREAK]`` / ``[IMG_END]`` tokens between its rows keep their text
embeddings (the model state, :mod:`mrv2_mistral3.inputs`, assembles an image's rows).
Attention stays causal, as in HF. Ministral 3's decoder (``ministral3``) also scales each
query at position ``p`` by ``1 + beta * log(1 + floor(p / original_max_position_embeddings))``
(``rope_parameters``' ``llama_4_scaling_beta`` and ``original_max_position_embeddings``).

Checkpoints load in transformers 5.17's names (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.weight``) and in the
published layout (``language_model.model.*``, ``language_model.lm_head.weight``,
``vision_tower.*``, ``multi_modal_projector.*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    ScaledQueryAttention,
    SelfAttention,
    get_rope,
    head_dim_of,
    llama4_query_scaling,
)
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_mistral3.vision import VISION_CHECKPOINT_PREFIXES, Mistral3VisionEncoder

__all__ = ["ARCHITECTURE", "Mistral3ForConditionalGeneration"]

ARCHITECTURE = "Mistral3ForConditionalGeneration"
#: The text decoders built here (HF's classes for them have the same bias-free layers).
TEXT_KINDS = ("llama", "ministral", "ministral3", "mistral")


def query_scaling(text: Any) -> tuple[float, float] | None:
    """Ministral 3's per-position query scale ``(beta, original_max_position_embeddings)``
    (the core's :func:`~mrv2.layers.llama4_query_scaling`; None for the other decoders)."""
    if text.model_type != "ministral3":
        return None
    return llama4_query_scaling(text, "text_config.rope_parameters")


class Mistral3ForConditionalGeneration(CausalLM):
    """Mistral 3: Mistral's text decoder and the image encoder (``vision``; module doc).
    ``config`` is the composite ``Mistral3Config`` (``self.hf_config``); ``self.config`` is its
    ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        text = vl_text_config(config, ARCHITECTURE)
        kind = getattr(text, "model_type", None)
        if kind not in TEXT_KINDS:
            raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported "
                             f"for {ARCHITECTURE}; supported: {sorted(TEXT_KINDS)}")
        scaling = query_scaling(text)
        rope = get_rope(text, head_dim_of(text))
        bias = bool(getattr(text, "attention_bias", False))
        mlp_bias = bool(getattr(text, "mlp_bias", False))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(text, i, rope, qkv_bias=bias, o_bias=bias) \
                if scaling is None else ScaledQueryAttention(text, i, rope, scaling,
                                                             qkv_bias=bias, o_bias=bias)
            mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act,
                           bias=mlp_bias)
            return DecoderLayer(text, attention, mlp)

        super().__init__(text, DecoderModel(text, layer))
        self.hf_config = config
        self.vision = Mistral3VisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor, image_size: tuple[int, int]
                    ) -> torch.Tensor:
        """One image's pixels ``[C, H, W]`` (its real ``(h, w)`` known on the host) -> its
        features ``[rows * cols, hidden_size]`` (merged patches, row-major) in the model
        dtype."""
        return self.vision(pixel_values, image_size).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: an image-encoder tensor, which
        :meth:`load_weights` hands to the encoder)."""
        if name.startswith(VISION_CHECKPOINT_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through its loader, the vision tower's and the projector's
        through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision,
                                     VISION_CHECKPOINT_PREFIXES, weights, "vision")
