"""Qwen-VL prompts with images: the checkpoint's own HF image processor, placeholder expansion.

A prompt carries one ``<|image_pad|>`` (``config.image_token_id``) per image where the chat
template puts it (``<|vision_start|><|image_pad|><|vision_end|>``), as vLLM expects. The
image processor of the checkpoint (``preprocessor_config.json``: resize within
``min_pixels``..``max_pixels``, normalize, cut into patches, ``image_grid_thw``) turns each
image into patch rows. Each placeholder is expanded to ``t * h * w / merge**2`` tokens. The
image's :class:`~mrv2.contract.requests.MultiModalItem` carries its patch rows and grid, and
names its content by a hash of the processed pixels.

transformers' ``AutoImageProcessor`` needs torchvision for Qwen2-VL's processor. Where
torchvision is absent (the CPU CI has none), the same processor's PIL backend
(``Qwen2VLImageProcessorPil``) is loaded from the same config file.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from pathlib import Path
from typing import Any

from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    run_image_processor,
    splice_placeholders,
)
from mrv2.contract.input_processor import load_image_processor as load_core_image_processor
from mrv2.contract.requests import MultiModalItem

__all__ = ["QwenVLInputProcessor", "load_image_processor"]


def load_image_processor(model_dir: str | Path) -> Any:
    """The checkpoint's HF image processor (``preprocessor_config.json``); its PIL backend
    where torchvision is not installed (:func:`mrv2.contract.input_processor.
    load_image_processor`)."""
    return load_core_image_processor(model_dir, "Qwen2VLImageProcessor")


class QwenVLInputProcessor(InputProcessor):
    """Qwen2.5-VL's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_processor = load_image_processor(model_dir)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the image placeholders and make the images' items (module doc)."""
        images, places = self.images_and_places(prompt_token_ids, mm_data,
                                                self.image_token_id, "<|image_pad|>")
        if not images:
            return list(prompt_token_ids), []
        out = run_image_processor(self.image_processor, images)
        pixels = out["pixel_values"]
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        firsts = list(accumulate((t * h * w for t, h, w in grids), initial=0))

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            t, h, w = grids[n]
            length = t * h * w // self.merge**2
            rows = pixels[firsts[n]: firsts[n + 1]].contiguous()
            return [self.image_token_id] * length, MultiModalItem(
                "image", {"pixel_values": rows, "grid_thw": (t, h, w)},
                content_hash((t, h, w), rows), offset, length)

        return splice_placeholders(prompt_token_ids, places, expand)

