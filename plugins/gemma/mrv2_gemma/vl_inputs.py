"""Gemma 3's images: the input processor (prompt expansion, the checkpoint's image processor)
and the model state (the encoder cache, each step's soft tokens and image spans).

**Prompts.** A prompt carries one ``<start_of_image>`` (``config.boi_token_index``) per image
where the chat template puts it, as in vLLM and HF. Each is expanded as HF's
``Gemma3Processor`` expands its text, ``"\\n\\n<start_of_image>" + mm_tokens_per_image x
<image_soft_token> + "<end_of_image>\\n\\n"``, here on token ids: the soft tokens are the
image's :class:`~mrv2.contract.requests.MultiModalItem` (``bidirectional``: they attend to
each other both ways, so a step never splits them). HF tokenizes the expanded *text*, so the
inserted newlines merge with newlines next to them (``"user\\n" + "\\n\\n"`` is one
``"\\n\\n\\n"`` token in Gemma's vocabulary); the expansion re-tokenizes such runs of newline
tokens on both sides with the checkpoint's tokenizer, to give HF's ids (vLLM merges the same
runs). Without a tokenizer (a bundled bench config) the newlines are left out, with a warning.

**Images.** The checkpoint's image processor (``preprocessor_config.json``: resize to
``image_size`` squared, rescale, normalize; its PIL backend where torchvision is absent)
makes ``[3, S, S]`` pixels per image; an item's content hash is over them. Pan-and-scan
(``do_pan_and_scan: true``, crops of one image as extra images) is refused at start-up with an
error naming the field: each image is embedded whole.

**Each step** (:class:`Gemma3VLModelState`): the soft tokens of the images the step computes
come from the core's encoder cache (:class:`~mrv2.contract.encoder_cache.
EncoderCacheModelState`; one run of the vision tower per image, reused across requests with
the same image), and the step's image spans go to the model's forward as ``bidirectional``.
Steps with image tokens run eager; decode steps and text-only prefill replay the graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    run_image_processor,
)
from mrv2.contract.requests import MultiModalItem, NewRequest

__all__ = ["Gemma3InputProcessor", "Gemma3VLModelState"]

_log = logging.getLogger(__name__)


class Gemma3InputProcessor(InputProcessor):
    """Gemma 3's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.boi = int(hf_config.boi_token_index)
        self.eoi = int(hf_config.eoi_token_index)
        self.image_token = int(hf_config.image_token_index)
        self.tokens_per_image = int(hf_config.mm_tokens_per_image)
        self._newline_ids: dict[int, bool] = {}
        if tokenizer is None:
            _log.warning("%s without a tokenizer (a bundled bench config): images go in "
                         "without the newlines HF puts around them", hf_config.architectures)
        self.load_images(model_dir, "Gemma3ImageProcessor")
        if self.image_processor is None:
            return
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ValueError("preprocessor_config.json do_pan_and_scan = true is not supported: "
                             "mrv2 embeds each image whole (set it to false)")
        side = int(hf_config.vision_config.image_size)
        size = getattr(self.image_processor, "size", None) or {}
        if (int(size.get("height", side)), int(size.get("width", side))) != (side, side):
            raise ValueError(f"preprocessor_config.json size = {size.get('height')} x "
                             f"{size.get('width')}: the vision tower takes {side} x {side} "
                             "images")

    def _is_newlines(self, token: int) -> bool:
        if self.tokenizer is None:
            return False
        known = self._newline_ids.get(token)
        if known is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            known = self._newline_ids[token] = bool(text) and set(text) == {"\n"}
        return known

    def _newlines(self, before: list[int], after: list[int]) -> list[int]:
        """``"\\n\\n"`` with the newline tokens ``before`` and ``after`` it, re-tokenized
        (nothing without a tokenizer)."""
        if self.tokenizer is None:
            return []
        text = self.tokenizer.decode(before + after, skip_special_tokens=False) + "\n\n"
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<start_of_image>`` placeholders and make the images' items (module
        doc); ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.boi,
                                                "<start_of_image>")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(self.image_processor, images)
        pixels = cast(torch.Tensor, out["pixel_values"])
        if pixels.shape[0] != len(images):
            raise ValueError(f"multi_modal_data.image: {len(images)} images gave "
                             f"{pixels.shape[0]} pixel tensors")
        ids: list[int] = []
        items: list[MultiModalItem] = []
        previous = 0
        for n, place in enumerate(places):
            ids.extend(prompt_token_ids[previous:place])
            k = 0  # newline tokens just before the placeholder merge with the inserted ones
            while k < len(ids) and self._is_newlines(ids[-1 - k]):
                k += 1
            before = ids[len(ids) - k:]
            del ids[len(ids) - k:]
            ids.extend(self._newlines(before, []))
            ids.append(self.boi)
            rows = pixels[n].contiguous()
            items.append(MultiModalItem("image", {"pixel_values": rows}, content_hash(rows),
                                        len(ids), self.tokens_per_image, bidirectional=True))
            ids.extend([self.image_token] * self.tokens_per_image)
            ids.append(self.eoi)
            end = nxt = place + 1  # newline tokens after it (up to the next placeholder) too
            stop = places[n + 1] if n + 1 < len(places) else len(prompt_token_ids)
            while nxt < stop and self._is_newlines(prompt_token_ids[nxt]):
                nxt += 1
            ids.extend(self._newlines([], prompt_token_ids[end:nxt]))
            previous = nxt
        ids.extend(prompt_token_ids[previous:])
        return ids, items


class Gemma3VLModelState(EncoderCacheModelState):
    """The model state of ``Gemma3ForConditionalGeneration`` (module doc): the core's encoder
    cache over the SigLIP encoder, and each step's image spans for the forward."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vision = cast(Any, model).vision
        self.pixel_shape = (int(vision.num_channels), int(vision.image_size),
                            int(vision.image_size))
        self.tokens_per_image = int(vision.tokens_per_image)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """One image through the encoder (random pixels, output dropped): the peak a step's
        image adds; returns :attr:`encoder_cache_bytes`."""
        if max_prompt_tokens >= self.tokens_per_image:
            pixels = torch.randn(1, *self.pixel_shape, device=self.device)
            cast(Any, self.model).embed_images(pixels)
        return self.encoder_cache_bytes

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``mm_tokens_per_image`` bidirectional placeholders and ``[C, S, S]``
        pixels."""
        super().check_item(request, item)
        pixels = item.data.get("pixel_values") if isinstance(item.data, Mapping) else None
        if not isinstance(pixels, torch.Tensor) or tuple(pixels.shape) != self.pixel_shape:
            shape = None if not isinstance(pixels, torch.Tensor) else tuple(pixels.shape)
            raise ValueError(f"request {request.req_id!r}: an image's pixel_values must be "
                             f"{self.pixel_shape}, got {shape}")
        if item.length != self.tokens_per_image or not item.bidirectional:
            raise ValueError(f"request {request.req_id!r}: an image has "
                             f"{self.tokens_per_image} bidirectional placeholders, got "
                             f"length {item.length} (bidirectional={item.bidirectional})")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the encoder: ``[mm_tokens_per_image, hidden_size]``."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        return cast(torch.Tensor, cast(Any, self.model).embed_images(pixels[None])[0])

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """The default inputs (image rows spliced in) and, for a step with image tokens, its
        image spans as ``bidirectional``."""
        inputs = super().prepare_inputs(batch)
        spans = self.step_spans(batch)
        if spans:
            inputs["bidirectional"] = spans
        return inputs
