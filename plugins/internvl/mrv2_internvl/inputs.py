"""InternVL's images: the input processor (prompt expansion, the checkpoint's tiling image
processor) and the model state (the encoder cache, each step's image rows).

**Prompts.** A prompt carries one ``<IMG_CONTEXT>`` (``config.image_token_id``) per image where
the chat template puts it, as HF's ``InternVLProcessor`` takes it. Each is expanded as HF
expands it: ``<img>``, ``tokens_per_tile x tiles`` ``<IMG_CONTEXT>`` tokens, ``</img>`` (the
two marks' ids from the checkpoint's tokenizer). The context run is the image's
:class:`~mrv2.contract.requests.MultiModalItem`; attention stays causal, so a step may split
it.

**Images.** The checkpoint's image processor (``preprocessor_config.json``: GOT-OCR2's, with
``crop_to_patches`` on as HF's processor sets it: the image cut into up to ``max_patches``
square tiles of the vision tower's size by its aspect ratio, plus a thumbnail; its PIL backend
where torchvision is absent) gives each image's tiles; the content hash is over them.

**Each step** (:class:`InternVLModelState`): an image's rows come from the core's encoder cache
(:class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`: one run of the encoder over the
image's tiles).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import Any, cast

import torch

from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    preprocessor_config,
    run_image_processor,
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem, NewRequest

__all__ = ["InternVLInputProcessor", "InternVLModelState", "tokens_per_tile"]


def tokens_per_tile(hf_config: Any) -> int:
    """Soft tokens of one tile: ``(image_size / patch_size)**2 * downsample_ratio**2``."""
    vision = hf_config.vision_config
    size, patch = vision.image_size, vision.patch_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return int((int(size) // int(patch)) ** 2 * float(hf_config.downsample_ratio) ** 2)


class InternVLInputProcessor(InputProcessor):
    """InternVL's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.per_tile = tokens_per_tile(hf_config)
        self.start_id = self.end_id = -1
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                             "(the <img> / </img> ids)")
            return
        hf = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        ids = [hf.convert_tokens_to_ids(t) for t in ("<img>", "</img>")]
        unknown = getattr(hf, "unk_token_id", None)
        if any(not isinstance(i, int) or i == unknown for i in ids):
            self.images_refused = "the tokenizer has no <img> / </img> tokens"
            return
        self.start_id, self.end_id = int(ids[0]), int(ids[1])
        self.load_images(model_dir, "GotOcr2ImageProcessor")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<IMG_CONTEXT>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                "<IMG_CONTEXT>")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(self.image_processor, images, crop_to_patches=True)
        pixels = cast(torch.Tensor, out["pixel_values"])
        tiles = [int(n) for n in out["num_patches"]]
        firsts = list(accumulate(tiles, initial=0))  # image n's tiles: firsts[n]..firsts[n + 1]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            image = pixels[firsts[n]: firsts[n + 1]].contiguous()
            length = self.per_tile * tiles[n]
            return [self.start_id, *[self.image_token] * length, self.end_id], MultiModalItem(
                "image", {"pixel_values": image}, content_hash(image), offset + 1, length)

        return splice_placeholders(prompt_token_ids, places, expand)


class InternVLModelState(EncoderCacheModelState):
    """The model state of ``InternVLForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.per_tile = tokens_per_tile(hf_config)
        size = hf_config.vision_config.image_size
        self.side = int(size[0] if isinstance(size, (list, tuple)) else size)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[tiles, 3, S, S]`` pixels and ``tokens_per_tile * tiles``
        placeholders."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels = data.get("pixel_values")
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 4
                and tuple(pixels.shape[1:]) == (3, self.side, self.side)):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[tiles, 3, {self.side}, {self.side}]")
        if item.length != self.per_tile * pixels.shape[0]:
            raise ValueError(f"request {request.req_id!r}: an image of {pixels.shape[0]} tiles "
                             f"has {self.per_tile * pixels.shape[0]} tokens, got length "
                             f"{item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the encoder over the image's tiles: ``[tiles * tokens_per_tile,
        hidden_size]``."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        return cast(torch.Tensor, cast(Any, self.model).embed_image(pixels))

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over as many tiles as one image may have (the image processor's
        ``max_patches`` and a thumbnail: 13 unless ``preprocessor_config.json`` says otherwise,
        within ``max_prompt_tokens``), random pixels, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        most = int(preprocessor_config(self.config.model.model).get("max_patches") or 12) + 1
        tiles = min(most, max_prompt_tokens // max(1, self.per_tile))
        if tiles >= 1:
            pixels = torch.randn(tiles, 3, self.side, self.side, device=self.device)
            cast(Any, self.model).embed_image(pixels)
        return self.encoder_cache_bytes

