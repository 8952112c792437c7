"""Gemma 4's multimodal checkpoints (``Gemma4ForConditionalGeneration``: a vision tower, an
audio tower, their embedders and Gemma 4's text decoder): text, images, videos and audio.

``config.json`` nests the decoder's config under ``text_config``;
:class:`Gemma4ForConditionalGeneration` is :class:`~mrv2_gemma.gemma4.Gemma4ForCausalLM` built
from it, the LM head tied by the *top-level* ``tie_word_embeddings`` as HF ties it, plus the
image encoder (:class:`~mrv2_gemma.gemma4_vision.Gemma4VisionEncoder`) when the config has a
``vision_config`` and the audio encoder (:class:`~mrv2_gemma.gemma4_audio.Gemma4AudioEncoder`)
when it has an ``audio_config``; both are replicated under tensor parallelism. As in HF, the
media placeholder ids (``image_token_id``, ``video_token_id``, ``audio_token_id``) are
embedded (per-layer embeddings included) as ``text_config.pad_token_id``; an image's or a
clip's soft tokens then replace its placeholders' embeddings. A video's frames are images
of the vision tower (:meth:`Gemma4ForConditionalGeneration.embed_image`), each its own item.
An image's or a frame's tokens, with ``use_bidirectional_attention: "vision"``, attend to each
other both ways on the sliding layers (the step's spans, from the model state, set around the
decoder by :meth:`Gemma4ForConditionalGeneration.forward`); a clip's stay causal, as in HF.
Prompts, images, videos and audio: the input processor and model state of
:mod:`mrv2_gemma.gemma4_inputs`.

The tensors of a tower the config has no section for are skipped at load (a text tensor
matching no parameter is still an error).

Checkpoints load in transformers 5.17's names, which its ``save_pretrained`` writes
(``model.language_model.*``, ``lm_head.weight`` when untied, ``model.vision_tower.*``,
``model.audio_tower.*``, ``model.embed_vision.*``, ``model.embed_audio.*``), and in the older
published layout (``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``
...).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from mrv2.contract.forward_context import BidirectionalSpan, bidirectional_spans
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_gemma.gemma4 import Gemma4ForCausalLM
from mrv2_gemma.gemma4_audio import AUDIO_CHECKPOINT_PREFIXES, Gemma4AudioEncoder
from mrv2_gemma.gemma4_vision import VISION_CHECKPOINT_PREFIXES, Gemma4VisionEncoder

__all__ = ["ARCHITECTURE", "MEDIA_PREFIXES", "Gemma4ForConditionalGeneration"]

ARCHITECTURE = "Gemma4ForConditionalGeneration"

_MEDIA_MODULES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
#: Checkpoint names of the media towers and embedders (the decoder skips them; the vision
#: tower's and embedder's go to the image encoder, the audio ones to the audio encoder).
MEDIA_PREFIXES: tuple[str, ...] = tuple("model." + m for m in _MEDIA_MODULES) + _MEDIA_MODULES

class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4's multimodal checkpoint: its text decoder with the image and audio encoders
    its config has (module docstring). ``config`` is the composite ``Gemma4Config``
    (``self.hf_config``); ``self.config`` is its ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision", "audio")

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, ARCHITECTURE))
        self.hf_config = config
        #: The image encoder (None: a checkpoint without ``vision_config``).
        self.vision = (Gemma4VisionEncoder(config)
                       if getattr(config, "vision_config", None) is not None else None)
        #: The audio encoder (None: a checkpoint without ``audio_config``).
        self.audio = (Gemma4AudioEncoder(config)
                      if getattr(config, "audio_config", None) is not None else None)
        ids = (getattr(config, name, None) for name in
               ("image_token_id", "video_token_id", "audio_token_id"))
        #: Placeholder ids embedded as the pad token, as HF embeds them without media.
        self.media_ids = tuple(int(i) for i in ids if i is not None)
        self.pad_id = int(getattr(self.config, "pad_token_id", None) or 0)

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with every media placeholder id replaced by the pad id."""
        if not self.media_ids:
            return input_ids
        media = input_ids == self.media_ids[0]
        for media_id in self.media_ids[1:]:
            media = media | (input_ids == media_id)
        return input_ids.masked_fill(media, self.pad_id)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(self.text_ids(input_ids))

    def embed_image(self, pixel_values: torch.Tensor, position_ids: torch.Tensor,
                    grid: tuple[int, int]) -> torch.Tensor:
        """One image's patches and positions (its ``(width, height)`` patch grid known on the
        host) -> its soft tokens ``[n, hidden_size]`` in the model dtype."""
        if self.vision is None:
            raise ValueError(f"{ARCHITECTURE}: the checkpoint has no vision_config")
        tokens = self.vision(pixel_values, position_ids, grid)
        return tokens.to(self.model.embed_tokens.weight.dtype)

    def embed_audio(self, input_features: torch.Tensor) -> torch.Tensor:
        """One clip's valid log-mel frames ``[frames, mel]`` -> its soft tokens
        ``[ceil(ceil(frames / 2) / 2), hidden_size]`` in the model dtype."""
        if self.audio is None:
            raise ValueError(f"{ARCHITECTURE}: the checkpoint has no audio_config")
        return self.audio(input_features).to(self.model.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                bidirectional: Sequence[BidirectionalSpan] | None = None) -> torch.Tensor:
        """The decoder's forward over the ids with placeholders as pad; ``bidirectional``: the
        step's image spans (the model state's, for steps with image tokens)."""
        with bidirectional_spans(bidirectional):
            return super().forward(self.text_ids(input_ids), positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through its loader, the vision tower's and embedder's through
        the image encoder's, the audio tower's and embedder's through the audio encoder's (a
        tower the config lacks: its tensors skipped)."""
        load_text = super().load_weights

        def text_and_audio(rest: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_text_and_encoder(load_text, self.audio, AUDIO_CHECKPOINT_PREFIXES,
                                         rest, "audio")

        return load_text_and_encoder(text_and_audio, self.vision, VISION_CHECKPOINT_PREFIXES,
                                     weights, "vision")

    def rename(self, name: str) -> str | None:
        """A checkpoint name as the decoder's (None: a media tensor, skipped):
        ``model.language_model.*`` / ``language_model.model.*`` are ``model.*``,
        ``language_model.lm_head.*`` is ``lm_head.*``."""
        if name.startswith(MEDIA_PREFIXES):
            return None
        return super().rename(vl_text_name(name))
