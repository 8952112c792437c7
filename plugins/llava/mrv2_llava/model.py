"""LLaVA's vision-language checkpoints (``LlavaForConditionalGeneration``: LLaVA-1.5 and the
models built like it, in transformers' format) in the mrv2 model contract.

HF's model is a text decoder (the ``text_config``) plus the image encoder
(:class:`~mrv2_llava.clip.LlavaVisionEncoder`: a CLIP or SigLIP vision tower, the selected
layers' features and the two-layer projector). The decoder is built here from the core's
layers for the kinds in :data:`TEXT_KINDS` (Llama and Mistral: no biases unless
``attention_bias`` / ``mlp_bias``, Mistral's ``sliding_window`` where the config sets one;
Qwen2: biased q/k/v; Qwen3: per-head q/k norms) and refused with a ValueError naming
``text_config.model_type`` for any other; the LM head is tied by the *top-level*
``tie_word_embeddings`` as HF ties it. An image's features replace its ``<image>``
placeholders' embeddings; attention stays causal, as in HF.

Checkpoints load in transformers 5.17's names (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.weight``), in 5.17's
``save_pretrained`` layout and in the published ``llava-hf`` one (``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower[.vision_model].*``,
``multi_modal_projector.*``).
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
from mrv2_llava.clip import VISION_CHECKPOINT_PREFIXES, LlavaVisionEncoder

__all__ = ["ARCHITECTURE", "TEXT_KINDS", "LlavaForConditionalGeneration"]

ARCHITECTURE = "LlavaForConditionalGeneration"

#: The text decoders built here: ``model_type`` -> (q/k/v bias, per-head q/k norms).
TEXT_KINDS: dict[str, tuple[bool, bool]] = {"llama": (False, False), "mistral": (False, False),
                                            "qwen2": (True, False), "qwen3": (False, True)}


def text_config(config: Any, architecture: str = ARCHITECTURE) -> Any:
    """``config.text_config`` (:func:`~mrv2.model_loader.build.vl_text_config`); ValueError
    naming ``text_config.model_type`` where it is of a kind not built here."""
    text = vl_text_config(config, architecture)
    kind = getattr(text, "model_type", None)
    if kind not in TEXT_KINDS:
        raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported for "
                         f"{architecture}; supported: {sorted(TEXT_KINDS)}")
    return text


def build_decoder(text: Any) -> tuple[Any, DecoderModel]:
    """The text decoder of ``text`` (a config of a kind in :data:`TEXT_KINDS`) on the core's
    layers: ``(text, DecoderModel)``, for :class:`~mrv2.layers.CausalLM`'s constructor."""
    qkv_bias, qk_norm = TEXT_KINDS[text.model_type]
    attention_bias = bool(getattr(text, "attention_bias", False))
    mlp_bias = bool(getattr(text, "mlp_bias", False))
    rope = get_rope(text, head_dim_of(text))

    def layer(i: int) -> DecoderLayer:
        attention = SelfAttention(text, i, rope, qkv_bias=qkv_bias or attention_bias,
                                  qk_norm=qk_norm, o_bias=attention_bias)
        mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act, bias=mlp_bias)
        return DecoderLayer(text, attention, mlp)

    return text, DecoderModel(text, layer)


class LlavaForConditionalGeneration(CausalLM):
    """LLaVA: the text decoder and the image encoder (``vision``; module doc). ``config`` is
    the composite ``LlavaConfig`` (``self.hf_config``); ``self.config`` is its
    ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        super().__init__(*build_decoder(text_config(config)))
        self.hf_config = config
        self.vision = LlavaVisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images ``[N, 3, S, S]`` -> their features ``[N * tokens_per_image, hidden_size]``
        in the model dtype."""
        return self.vision(pixel_values).flatten(0, 1).to(self.model.embed_tokens.weight.dtype)

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
