"""Gemma 3's vision-language checkpoints (``Gemma3ForConditionalGeneration``: gemma-3-4b-it,
12b-it, 27b-it and their fine-tunes) served for **text prompts only**.

HF's ``Gemma3ForConditionalGeneration`` is a SigLIP vision tower, a projector and Gemma 3's
text decoder (:class:`~mrv2_gemma.model.Gemma3ForCausalLM`); ``config.json`` nests the
decoder's config under ``text_config``. For a prompt without images HF runs the text decoder
alone (token embeddings times ``sqrt(hidden_size)``, causal local/global attention, the LM
head), which is what :class:`Gemma3ForConditionalGeneration` computes, built from the
``text_config`` (its ``max_position_embeddings`` is the engine's ``max_model_len``, its
``layer_types`` / ``sliding_window`` the local layers' windows). The LM head is tied to the
embedding by the *top-level* ``tie_word_embeddings``, as HF ties it.

Not supported yet: images. The vision tower and the projector are not built; their tensors
are skipped at load (text tensors that match no parameter are still errors). A prompt with
``multi_modal_data`` (or an image part in ``LLM.chat`` / the chat API) is refused when it
arrives, before anything of it runs, by :class:`Gemma3ImagesRefused`. Serving images would
need the SigLIP tower, the projector's pooling, and the bidirectional attention HF applies
among each image's tokens (the engine's attention is causal).

Checkpoints load in the published layout, which transformers 5.17's ``save_pretrained`` still
writes (``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``,
``multi_modal_projector.*``), and in transformers' in-memory names (``model.language_model.*``,
``lm_head.weight``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.requests import MultiModalItem
from mrv2.model_loader.build import text_config_of
from mrv2_gemma.model import Gemma3ForCausalLM

__all__ = ["ARCHITECTURE", "VISION_PREFIXES", "Gemma3ForConditionalGeneration",
           "Gemma3ImagesRefused", "gemma3_text_config"]

ARCHITECTURE = "Gemma3ForConditionalGeneration"

#: Checkpoint names of the vision tower and the projector (skipped at load): transformers'
#: in-memory names, then the published layout's.
VISION_PREFIXES: tuple[str, ...] = ("model.vision_tower.", "model.multi_modal_projector.",
                                    "vision_tower.", "multi_modal_projector.")

#: The text decoder's checkpoint prefixes and the names the decoder loads them as.
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),  # transformers' in-memory names
    ("language_model.model.", "model."),  # the published layout (and save_pretrained's)
    ("language_model.lm_head.", "lm_head."),
)


def gemma3_text_config(config: Any) -> Any:
    """The text decoder's config of a ``Gemma3Config`` (its ``text_config``), with
    ``tie_word_embeddings`` set from the top level, where HF ties the LM head by it (set on
    the text config in place, so every reader of it agrees). ValueError where the config has
    no text config."""
    text = text_config_of(config)
    if text is config:
        raise ValueError(f"config.json of {ARCHITECTURE} has no text_config")
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = bool(tied)
    return text


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's vision-language checkpoint as its text decoder: text prompts only, the vision
    weights skipped (module docstring). ``config`` is the composite ``Gemma3Config``
    (``self.hf_config``); ``self.config`` is its ``text_config``."""

    def __init__(self, config: Any) -> None:
        super().__init__(gemma3_text_config(config))
        self.hf_config = config

    def rename(self, name: str) -> str | None:
        """A checkpoint name as the decoder's (None: a vision tower or projector tensor,
        skipped): ``model.language_model.*`` and ``language_model.model.*`` are ``model.*``,
        ``language_model.lm_head.*`` is ``lm_head.*``."""
        if name.startswith(VISION_PREFIXES):
            return None
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text decoder's tensors (norm weights as offsets); the vision tower's and the
        projector's are passed over unread."""
        return super().load_weights(
            (name, tensor) for name, tensor in weights if not name.startswith(VISION_PREFIXES))


class Gemma3ImagesRefused(InputProcessor):
    """The input processor of ``Gemma3ForConditionalGeneration``: refuses every prompt that
    carries media, naming the architecture, before anything of it runs (images are not
    supported yet: module docstring). A ``multi_modal_data`` with no items passes as text."""

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """ValueError for any media item; the prompt unchanged when there is none."""
        carried = sorted(key for key, value in mm_data.items() if _has_items(value))
        if carried:
            raise ValueError(
                f"multi_modal_data ({', '.join(carried)}): images are not supported for "
                f"{ARCHITECTURE} yet; mrv2 serves this architecture's text prompts only "
                "(send the prompt without images)")
        return list(prompt_token_ids), []


def _has_items(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0
    return True
