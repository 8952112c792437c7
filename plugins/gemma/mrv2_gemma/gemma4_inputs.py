"""Gemma 4's images: the input processor (prompt expansion, the checkpoint's image processor)
and the model state (the encoder cache, each step's soft tokens and image spans).

**Prompts.** A prompt carries one image token (``config.image_token_id``) per image where the
chat template puts it, as in HF and vLLM. Each is expanded as HF's ``Gemma4Processor``
expands it: ``<boi>`` (``boi_token_id``), as many image tokens as the image has soft tokens,
``<eoi>`` (``eoi_token_id``); no text around it. The soft tokens are the image's
:class:`~mrv2.contract.requests.MultiModalItem`, ``bidirectional`` when the text config says
``use_bidirectional_attention: "vision"`` (their tokens then attend to each other both ways on
the sliding layers, and no step splits them). Video and audio are refused, naming the key.

**Images.** The checkpoint's image processor (``preprocessor_config.json``: an aspect-ratio
preserving resize to at most ``max_soft_tokens`` pooled patches, rescale, patches padded to
``max_soft_tokens * pooling_kernel_size**2`` with positions ``(-1, -1)``; its PIL backend where
torchvision is absent) makes each image's patch rows and positions; an item's content hash is
over both. The number of soft tokens varies with the image's aspect ratio.

**Each step** (:class:`Gemma4VLModelState`): the soft tokens of the images the step computes
come from the core's encoder cache (:class:`~mrv2.contract.encoder_cache.
EncoderCacheModelState`; one run of the vision encoder per image), and the step's image spans
go to the model's forward as ``bidirectional``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    preprocessor_config,
    run_image_processor,
)
from mrv2.contract.requests import MultiModalItem, NewRequest

__all__ = ["Gemma4InputProcessor", "Gemma4VLModelState"]


class Gemma4InputProcessor(InputProcessor):
    """Gemma 4's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.boi = int(hf_config.boi_token_id)
        self.eoi = int(hf_config.eoi_token_id)
        text = getattr(hf_config, "text_config", hf_config)
        self.bidirectional = getattr(text, "use_bidirectional_attention", None) == "vision"
        if getattr(hf_config, "vision_config", None) is None:
            self.images_refused = "the checkpoint has no vision_config (a text-only Gemma 4)"
            return
        self.load_images(model_dir, "Gemma4ImageProcessor")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the image placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(
            prompt_token_ids, mm_data, self.image_token, only_with_items=True,
            note=" (Gemma 4's video and audio are not supported yet)")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(self.image_processor, images)
        pixels = cast(torch.Tensor, out["pixel_values"])
        positions = cast(torch.Tensor, out["image_position_ids"])
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        ids: list[int] = []
        items: list[MultiModalItem] = []
        previous = 0
        for n, place in enumerate(places):
            ids.extend(prompt_token_ids[previous:place])
            ids.append(self.boi)
            rows, where = pixels[n].contiguous(), positions[n].contiguous()
            items.append(MultiModalItem(
                "image", {"pixel_values": rows, "position_ids": where},
                content_hash(rows, where), len(ids), counts[n],
                bidirectional=self.bidirectional))
            ids.extend([self.image_token] * counts[n])
            ids.append(self.eoi)
            previous = place + 1
        ids.extend(prompt_token_ids[previous:])
        return ids, items


class Gemma4VLModelState(EncoderCacheModelState):
    """The model state of ``Gemma4ForConditionalGeneration`` with images (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vision = cast(Any, model).vision
        #: The width of an image's patch rows and the pooling kernel (None: no vision tower).
        self.pixel_width: int | None = None
        self.pool: int | None = None
        if vision is not None:
            self.pixel_width = int(vision.vision_tower.patch_embedder.input_proj.in_features)
            self.pool = int(vision.kernel)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[patches, C * P * P]`` pixels, ``[patches, 2]`` positions and as many
        placeholders as its real patches pool to."""
        super().check_item(request, item)
        if self.pixel_width is None or self.pool is None:
            raise ValueError(f"request {request.req_id!r}: the checkpoint has no vision tower")
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, where = data.get("pixel_values"), data.get("position_ids")
        if not (isinstance(pixels, torch.Tensor) and isinstance(where, torch.Tensor)
                and pixels.dim() == 2 and pixels.shape[1] == self.pixel_width
                and tuple(where.shape) == (pixels.shape[0], 2)):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[patches, {self.pixel_width}] and position_ids [patches, 2]")
        width, height = _grid(where)
        real = int((where[:, 0] >= 0).sum())
        ordered = bool((where[:real, 0] >= 0).all())
        if (not ordered or real != width * height or width % self.pool
                or height % self.pool):
            raise ValueError(f"request {request.req_id!r}: an image's position_ids must make a "
                             f"{self.pool}-divisible grid from (0, 0), padding at the end")
        if real // self.pool**2 != item.length:
            raise ValueError(f"request {request.req_id!r}: an image of {real} patches has "
                             f"{real // self.pool**2} soft tokens, got length {item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the vision encoder: ``[soft tokens, hidden_size]``."""
        where = cast(torch.Tensor, item.data["position_ids"])
        grid = _grid(where)  # (host tensors: no device read)
        rows = grid[0] * grid[1]  # the real patches, first (the padding is not copied)
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"])[:rows])
        where = self.upload(where[:rows])
        return cast(torch.Tensor, cast(Any, self.model).embed_image(pixels, where, grid))

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over one image of the processor's largest size (``max_soft_tokens``
        pooled patches, 280 unless ``preprocessor_config.json`` says otherwise; random pixels,
        a square grid), output dropped; returns :attr:`encoder_cache_bytes`."""
        if self.pixel_width is not None and self.pool is not None:
            most = int(preprocessor_config(self.config.model.model).get("max_soft_tokens")
                       or 280)
            side = math.isqrt(min(most, max(1, max_prompt_tokens))) * self.pool
            grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side),
                                              indexing="xy"), dim=-1).reshape(-1, 2)
            pixels = torch.rand(side * side, self.pixel_width)
            cast(Any, self.model).embed_image(pixels.to(self.device), grid.to(self.device),
                                              (side, side))
        return self.encoder_cache_bytes

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """The default inputs (image rows spliced in) and, for a step with image tokens, its
        image spans as ``bidirectional``."""
        inputs = super().prepare_inputs(batch)
        spans = self.step_spans(batch)
        if spans:
            inputs["bidirectional"] = spans
        return inputs


def _grid(positions: torch.Tensor) -> tuple[int, int]:
    """``(width, height)`` in patches of an image's CPU ``position_ids`` (``(-1, -1)``:
    padding)."""
    real = positions[positions[:, 0] >= 0]
    if not len(real):
        return 0, 0
    return int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1

