"""Idefics3's vision-language checkpoints (``Idefics3ForConditionalGeneration``: Idefics3-8B-
Llama3; ``SmolVLMForConditionalGeneration``: SmolVLM / SmolVLM2 256M, 500M, 2.2B, images only)
in the mrv2 model contract.

HF's model is a Llama text decoder (the ``text_config``) plus the image encoder
(:class:`~mrv2_idefics3.vision.Idefics3VisionEncoder`: the SigLIP-style tower over each tile,
the pixel shuffle, the modality projection). The decoder is built from the core's layers as
Llama's is (``LlamaForCausalLM``: no biases unless ``attention_bias`` / ``mlp_bias``); any
other ``text_config.model_type`` is refused with a ValueError naming it. The LM head is tied by
the *top-level* ``tie_word_embeddings`` as HF ties it. An image's features replace its
``<image>`` tokens' embeddings, the layout tokens between them (``<fake_token_around_image>``,
``<row_i_col_j>``, ``<global-img>``, newlines) keep their text embeddings, and attention
stays causal over all of them, as in HF (no bidirectional image span: HF's text model is the
plain causal ``LlamaModel``).

Checkpoints load in transformers' names (``model.text_model.*``, ``model.vision_model.*``,
``model.connector.*``, ``lm_head.weight``: the in-memory, ``save_pretrained`` and published
layout alike), also without the ``model.`` wrapper.
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
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config
from mrv2_idefics3.vision import VISION_CHECKPOINT_PREFIXES, Idefics3VisionEncoder

__all__ = ["TEXT_KINDS", "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]

#: ``text_config.model_type`` of the decoders built here.
TEXT_KINDS: tuple[str, ...] = ("llama",)
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (("model.text_model.", "model."),
                                               ("text_model.", "model."))


def text_config(config: Any, architecture: str) -> Any:
    """``config.text_config`` (:func:`~mrv2.model_loader.build.vl_text_config`: the top-level
    ``tie_word_embeddings`` set on it); ValueError naming ``text_config.model_type`` where it
    is of a kind not built here."""
    text = vl_text_config(config, architecture)
    kind = getattr(text, "model_type", None)
    if kind not in TEXT_KINDS:
        raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported for "
                         f"{architecture}; supported: {list(TEXT_KINDS)}")
    return text


def build_decoder(text: Any) -> DecoderModel:
    """Llama's decoder of ``text`` on the core's layers (as ``LlamaForCausalLM`` builds it)."""
    rope = get_rope(text, head_dim_of(text))
    attention_bias = bool(getattr(text, "attention_bias", False))
    mlp_bias = bool(getattr(text, "mlp_bias", False))

    def layer(i: int) -> DecoderLayer:
        attention = SelfAttention(text, i, rope, qkv_bias=attention_bias, o_bias=attention_bias)
        mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act, bias=mlp_bias)
        return DecoderLayer(text, attention, mlp)

    return DecoderModel(text, layer)


class Idefics3ForConditionalGeneration(CausalLM):
    """Idefics3: the Llama decoder and the image encoder (``vision``; module doc). ``config``
    is the composite ``Idefics3Config`` (``self.hf_config``); ``self.config`` is its
    ``text_config``."""

    architecture: ClassVar[str] = "Idefics3ForConditionalGeneration"

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        text = text_config(config, self.architecture)
        super().__init__(text, build_decoder(text))
        self.hf_config = config
        self.vision = Idefics3VisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles ``[tiles, 3, S, S]`` -> their features ``[tiles *
        tokens_per_tile, hidden_size]`` (tile by tile, in order) in the model dtype."""
        features = self.vision(pixel_values).flatten(0, 1)
        return features.to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: an image-encoder tensor, which
        :meth:`load_weights` hands to the encoder)."""
        if name.startswith(VISION_CHECKPOINT_PREFIXES):
            return None
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through its loader, the tower's and the connector's through
        the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision,
                                     VISION_CHECKPOINT_PREFIXES, weights, "vision")


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM / SmolVLM2 (``SmolVLMConfig``): Idefics3's model under another name (HF's
    ``SmolVLMModel`` only rewrites the feature merge, to the same rows); images only."""

    architecture: ClassVar[str] = "SmolVLMForConditionalGeneration"
