"""Gemma 3's vision-language checkpoints (``Gemma3ForConditionalGeneration``: gemma-3-4b-it,
12b-it, 27b-it and their fine-tunes): text and images.

HF's ``Gemma3ForConditionalGeneration`` is a SigLIP vision tower and a projector
(:class:`~mrv2_gemma.siglip.Gemma3VisionEncoder`: ``mm_tokens_per_image`` soft tokens an
image, 256 on the published checkpoints) and Gemma 3's text decoder
(:class:`~mrv2_gemma.model.Gemma3ForCausalLM`); ``config.json`` nests the decoder's config
under ``text_config``. :class:`Gemma3ForConditionalGeneration` builds both: the decoder from
the ``text_config`` (its ``max_position_embeddings`` is the engine's ``max_model_len``, its
``layer_types`` / ``sliding_window`` the local layers' windows), the LM head tied to the
embedding by the *top-level* ``tie_word_embeddings``, as HF ties it.

An image's soft tokens replace their placeholders' embeddings (not scaled by
``sqrt(hidden_size)``, as HF splices them after the scaled lookup) and **attend to each other
both ways** in every layer (HF's ``token_type_ids`` mask: causal OR same image; a local
layer's window still bounds it from below). The model state
(:class:`~mrv2_gemma.vl_inputs.Gemma3VLModelState`) hands the step's image spans to
:meth:`Gemma3ForConditionalGeneration.forward`, which sets them around the decoder
(:func:`mrv2.contract.forward_context.bidirectional_spans`); the core's attention layer then
recomputes those rows. The scheduler never splits an image across steps
(:attr:`mrv2.contract.requests.MultiModalItem.bidirectional`). Prompts and images: the input
processor (:class:`~mrv2_gemma.vl_inputs.Gemma3InputProcessor`).

Checkpoints load in the published layout, which transformers 5.17's ``save_pretrained`` still
writes (``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``,
``multi_modal_projector.*``), and in transformers' in-memory names (``model.language_model.*``,
``lm_head.weight``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from mrv2.contract.forward_context import BidirectionalSpan, bidirectional_spans
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_gemma.model import Gemma3ForCausalLM
from mrv2_gemma.siglip import Gemma3VisionEncoder

__all__ = ["ARCHITECTURE", "VISION_PREFIXES", "Gemma3ForConditionalGeneration"]

ARCHITECTURE = "Gemma3ForConditionalGeneration"

#: Checkpoint names of the vision tower and the projector: transformers' in-memory names,
#: then the published layout's.
VISION_PREFIXES: tuple[str, ...] = ("model.vision_tower.", "model.multi_modal_projector.",
                                    "vision_tower.", "multi_modal_projector.")

class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's vision-language checkpoint: the text decoder and the image encoder
    (``vision``; module docstring). ``config`` is the composite ``Gemma3Config``
    (``self.hf_config``); ``self.config`` is its ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, ARCHITECTURE))
        self.hf_config = config
        self.vision = Gemma3VisionEncoder(config)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` pixels -> ``[N, mm_tokens_per_image, hidden_size]`` soft tokens,
        in the model dtype."""
        return self.vision(pixel_values).to(self.model.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                bidirectional: Sequence[BidirectionalSpan] | None = None) -> torch.Tensor:
        """The decoder's forward; ``bidirectional``: the step's image spans, whose tokens
        attend to each other both ways (the model state's, for steps with image tokens)."""
        with bidirectional_spans(bidirectional):
            return super().forward(input_ids, positions, inputs_embeds)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: a vision tower or projector tensor,
        which :meth:`load_weights` hands to the encoder): ``model.language_model.*`` and
        ``language_model.model.*`` are ``model.*``, ``language_model.lm_head.*`` is
        ``lm_head.*``."""
        if name.startswith(VISION_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text decoder's tensors (norm weights as offsets) through its loader, the
        vision tower's and the projector's through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision, VISION_PREFIXES,
                                     weights, "vision")
