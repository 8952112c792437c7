"""Gemma 4's multimodal checkpoints (``Gemma4ForConditionalGeneration``: a vision tower, an
audio tower, their embedders and Gemma 4's text decoder) served for **text prompts only**.

``config.json`` nests the decoder's config under ``text_config``;
:class:`Gemma4ForConditionalGeneration` is :class:`~mrv2_gemma.gemma4.Gemma4ForCausalLM` built
from it, the LM head tied by the *top-level* ``tie_word_embeddings`` as HF ties it. For a
prompt without media HF runs the text decoder alone, with one change this model makes too:
the media placeholder ids (``image_token_id``, ``video_token_id``, ``audio_token_id``) are
embedded (per-layer embeddings included) as ``text_config.pad_token_id``.

Not supported: images, video and audio. The towers and embedders are not built; their
tensors are skipped at load (a text tensor matching no parameter is still an error). A prompt
with ``multi_modal_data`` (or a media part in ``LLM.chat`` / the chat API) is refused when it
arrives, before anything of it runs, by :class:`Gemma4MediaRefused`.

Checkpoints load in transformers 5.17's names, which its ``save_pretrained`` writes
(``model.language_model.*``, ``lm_head.weight`` when untied, ``model.vision_tower.*``,
``model.audio_tower.*``, ``model.embed_vision.*``, ``model.embed_audio.*``), and in the older
published layout (``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``
...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.requests import MultiModalItem
from mrv2.model_loader.build import text_config_of
from mrv2_gemma.gemma4 import Gemma4ForCausalLM

__all__ = ["ARCHITECTURE", "MEDIA_PREFIXES", "Gemma4ForConditionalGeneration",
           "Gemma4MediaRefused", "gemma4_text_config"]

ARCHITECTURE = "Gemma4ForConditionalGeneration"

_MEDIA_MODULES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
#: Checkpoint names of the media towers and embedders (skipped at load).
MEDIA_PREFIXES: tuple[str, ...] = tuple("model." + m for m in _MEDIA_MODULES) + _MEDIA_MODULES

#: The text decoder's checkpoint prefixes and the names the decoder loads them as.
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def gemma4_text_config(config: Any) -> Any:
    """The decoder's config of a ``Gemma4Config`` (its ``text_config``), with
    ``tie_word_embeddings`` set from the top level (in place, so every reader agrees).
    ValueError where the config has no text config."""
    text = text_config_of(config)
    if text is config:
        raise ValueError(f"config.json of {ARCHITECTURE} has no text_config")
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = bool(tied)
    return text


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4's multimodal checkpoint as its text decoder: text prompts only, the media
    weights skipped (module docstring). ``config`` is the composite ``Gemma4Config``
    (``self.hf_config``); ``self.config`` is its ``text_config``."""

    def __init__(self, config: Any) -> None:
        super().__init__(gemma4_text_config(config))
        self.hf_config = config
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(self.text_ids(input_ids), positions, inputs_embeds)

    def rename(self, name: str) -> str | None:
        """A checkpoint name as the decoder's (None: a media tensor, skipped):
        ``model.language_model.*`` / ``language_model.model.*`` are ``model.*``,
        ``language_model.lm_head.*`` is ``lm_head.*``."""
        if name.startswith(MEDIA_PREFIXES):
            return None
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        return super().rename(name)


class Gemma4MediaRefused(InputProcessor):
    """The input processor of ``Gemma4ForConditionalGeneration``: refuses every prompt that
    carries media, naming the architecture, before anything of it runs (module docstring).
    A ``multi_modal_data`` with no items passes as text."""

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """ValueError for any media item; the prompt unchanged when there is none."""
        carried = sorted(key for key, value in mm_data.items() if _has_items(value))
        if carried:
            raise ValueError(
                f"multi_modal_data ({', '.join(carried)}): media are not supported for "
                f"{ARCHITECTURE}; mrv2 serves this architecture's text prompts only (send the "
                "prompt without images, video or audio)")
        return list(prompt_token_ids), []


def _has_items(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0
    return True
