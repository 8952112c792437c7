"""InternVL's vision-language checkpoints in transformers' format
(``InternVLForConditionalGeneration``: InternVL3 1B-78B, InternVL3.5 dense) in the mrv2 model
contract.

HF's model is a text decoder (the ``text_config``: Qwen2, Qwen3 or Llama) plus the image
encoder (:class:`~mrv2_internvl.vision.InternVLVisionEncoder`: InternViT over each tile of an
image, pixel shuffle, the projector). The decoder is built here from the core's layers for
those three kinds (Qwen2: biased q/k/v; Qwen3: per-head q/k norms; Llama: neither; biases
per ``attention_bias`` / ``mlp_bias`` where the config sets them) and refused
with a ValueError naming ``text_config.model_type`` for any other; the LM head is tied by the
*top-level* ``tie_word_embeddings`` as HF ties it. An image's features replace its
``<IMG_CONTEXT>`` placeholders' embeddings; attention stays causal, as in HF.

Checkpoints load in transformers 5.17's names (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.weight``) and in the
layout without ``model.`` (``language_model.model.*``, ``language_model.lm_head.weight``,
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
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_internvl.vision import VISION_CHECKPOINT_PREFIXES, InternVLVisionEncoder

__all__ = ["ARCHITECTURE", "TEXT_KINDS", "InternVLForConditionalGeneration"]

ARCHITECTURE = "InternVLForConditionalGeneration"

#: The text decoders built here: ``model_type`` -> (q/k/v bias, per-head q/k norms).
TEXT_KINDS: dict[str, tuple[bool, bool]] = {"qwen2": (True, False), "qwen3": (False, True),
                                            "llama": (False, False)}

def _text_config(config: Any) -> Any:
    """``config.text_config`` (:func:`~mrv2.model_loader.build.vl_text_config`); ValueError
    where it is of a kind not built here."""
    text = vl_text_config(config, ARCHITECTURE)
    kind = getattr(text, "model_type", None)
    if kind not in TEXT_KINDS:
        raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported for "
                         f"{ARCHITECTURE}; supported: {sorted(TEXT_KINDS)}")
    return text


class InternVLForConditionalGeneration(CausalLM):
    """InternVL: the text decoder and the image encoder (``vision``; module doc). ``config``
    is the composite ``InternVLConfig`` (``self.hf_config``); ``self.config`` is its
    ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        text = _text_config(config)
        qkv_bias, qk_norm = TEXT_KINDS[text.model_type]
        bias = qkv_bias or bool(getattr(text, "attention_bias", False))
        rope = get_rope(text, head_dim_of(text))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(text, i, rope, qkv_bias=bias, qk_norm=qk_norm,
                                      o_bias=bool(getattr(text, "attention_bias", False)))
            mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act,
                           bias=bool(getattr(text, "mlp_bias", False)))
            return DecoderLayer(text, attention, mlp)

        super().__init__(text, DecoderModel(text, layer))
        self.hf_config = config
        self.vision = InternVLVisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles ``[tiles, 3, S, S]`` -> its features ``[tiles * tokens_per_tile,
        hidden_size]`` in the model dtype."""
        return self.vision(pixel_values).to(self.model.embed_tokens.weight.dtype)

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
