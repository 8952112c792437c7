"""LLaVA-NeXT's images: the input processor (prompt expansion, the checkpoint's anyres image
processor) and the model state (the encoder cache, each step's image rows).

**Prompts.** One ``<image>`` (``config.image_token_id``) per image, expanded as HF's
``LlavaNextProcessor`` expands it: into the image's
:func:`~mrv2_llava.llava_next.image_token_count` ``<image>`` tokens (it depends on the
image's real size). That run is the image's :class:`~mrv2.contract.requests.MultiModalItem`;
attention stays causal, so a step may split it.

**Images.** The checkpoint's image processor (``preprocessor_config.json``:
``LlavaNextImageProcessor``, its PIL backend where torchvision is absent) gives each image's
tiles (thumbnail first; the batch's padding tiles dropped) and real ``(h, w)``; the content
hash is over both. Its ``image_grid_pinpoints`` must be the model's (HF's model would split
the tiles wrongly otherwise): ValueError naming the field where they differ.

**Each step** (:class:`LlavaNextModelState`): an image's rows come from the core's encoder
cache (one run of the encoder over the image's tiles, packed with ``image_newline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    run_image_processor,
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2_llava.inputs import image_token_id
from mrv2_llava.llava_next import image_token_count, tile_grid

__all__ = ["LlavaNextInputProcessor", "LlavaNextModelState"]


def _side(hf_config: Any) -> int:
    size = hf_config.vision_config.image_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _pinpoints(value: Any) -> list[tuple[int, int]]:
    return [(int(p[0]), int(p[1])) for p in value or []]


class LlavaNextInputProcessor(InputProcessor):
    """LLaVA-NeXT's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = image_token_id(hf_config)
        self.side = _side(hf_config)
        self.load_images(model_dir, "LlavaNextImageProcessor")
        if self.image_processor is None:
            return
        theirs = _pinpoints(getattr(self.image_processor, "image_grid_pinpoints", None))
        if theirs != _pinpoints(hf_config.image_grid_pinpoints):
            self.images_refused = (f"preprocessor_config.json image_grid_pinpoints {theirs} differ "
                             f"from config.json's {hf_config.image_grid_pinpoints}")
            self.image_processor = None

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<image>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                "<image>")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(self.image_processor, images)
        pixels = cast(torch.Tensor, out["pixel_values"])
        sizes = [(int(h), int(w)) for h, w in out["image_sizes"].tolist()]
        if tuple(pixels.shape[2:]) != (3, self.side, self.side):
            raise ValueError(f"multi_modal_data.image: the image processor made tiles of "
                             f"{tuple(pixels.shape[2:])}; the vision tower takes "
                             f"(3, {self.side}, {self.side}) (check preprocessor_config.json)")

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            rows, cols = tile_grid(sizes[n], self.hf_config.image_grid_pinpoints, self.side)
            tiles = pixels[n, :rows * cols + 1].contiguous()
            length = image_token_count(self.hf_config, sizes[n])
            return [self.image_token] * length, MultiModalItem(
                "image", {"pixel_values": tiles, "image_size": sizes[n]},
                content_hash(tiles, sizes[n]), offset, length)

        return splice_placeholders(prompt_token_ids, places, expand)


class LlavaNextModelState(EncoderCacheModelState):
    """The model state of ``LlavaNextForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.side = _side(hf_config)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[rows * cols + 1, 3, S, S]`` tiles for its ``image_size`` and
        :func:`~mrv2_llava.llava_next.image_token_count` placeholders."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, size = data.get("pixel_values"), data.get("image_size")
        if not (isinstance(size, tuple) and len(size) == 2 and min(size) > 0):
            raise ValueError(f"request {request.req_id!r}: an image needs image_size (h, w)")
        rows, cols = tile_grid(size, self.hf_config.image_grid_pinpoints, self.side)
        shape = (rows * cols + 1, 3, self.side, self.side)
        if not (isinstance(pixels, torch.Tensor) and tuple(pixels.shape) == shape):
            raise ValueError(f"request {request.req_id!r}: an image of {size} needs "
                             f"pixel_values {list(shape)}")
        tokens = image_token_count(self.hf_config, size)
        if item.length != tokens:
            raise ValueError(f"request {request.req_id!r}: an image of {size} has {tokens} "
                             f"tokens, got length {item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the encoder over the image's tiles, packed: ``[tokens, hidden]``."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        size = cast(tuple[int, int], item.data["image_size"])
        return cast(torch.Tensor, cast(Any, self.model).embed_image(pixels, size))

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over an image of the pinpoint with the most tiles (random pixels,
        output dropped), when its tokens fit in ``max_prompt_tokens``; returns
        :attr:`encoder_cache_bytes`."""
        size = max(((int(p[0]), int(p[1])) for p in self.hf_config.image_grid_pinpoints),
                   key=lambda p: p[0] * p[1])
        if image_token_count(self.hf_config, size) <= max_prompt_tokens:
            rows, cols = tile_grid(size, self.hf_config.image_grid_pinpoints, self.side)
            pixels = torch.randn(rows * cols + 1, 3, self.side, self.side, device=self.device)
            cast(Any, self.model).embed_image(pixels, size)
        return self.encoder_cache_bytes
