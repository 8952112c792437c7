"""LLaVA's images: the input processor (prompt expansion, the checkpoint's CLIP image
processor) and the model state (the encoder cache, each step's image rows).

**Prompts.** A prompt carries one ``<image>`` (``config.image_token_id``, transformers 4's
``image_token_index``) per image where the chat template puts it, as HF's ``LlavaProcessor``
takes it. Each is expanded as that processor expands it: into ``tokens_per_image`` ``<image>``
tokens and nothing else (``(S / patch_size)**2`` patches, plus CLIP's CLS token
(``num_additional_image_tokens: 1`` in the published processors), less one for
``vision_feature_select_strategy: default``: 576 for LLaVA-1.5). That run is the image's
:class:`~mrv2.contract.requests.MultiModalItem`; attention stays causal, so a step may split it.

**Images.** The checkpoint's image processor (``preprocessor_config.json``:
``CLIPImageProcessor``, the shortest edge resized then center-cropped to the tower's
``image_size``, rescaled, normalized; its PIL backend where torchvision is absent) gives each
image's ``[3, S, S]`` pixels; the content hash is over them. A processor that does not crop to
the tower's size is refused naming ``crop_size`` (HF's model refuses such pixels too).

**Each step** (:class:`LlavaModelState`): an image's rows come from the core's encoder cache
(:class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`: one run of the encoder over the
image).
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
from mrv2_llava.clip import image_tokens

__all__ = ["LlavaInputProcessor", "LlavaModelState", "image_token_id"]


def image_token_id(hf_config: Any) -> int:
    """The ``<image>`` placeholder's id: ``image_token_id`` (transformers 5), else
    ``image_token_index``; ValueError naming both where the config has neither."""
    for field in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError("config.json has no image_token_id / image_token_index")


def _side(hf_config: Any) -> int:
    size = hf_config.vision_config.image_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


class LlavaInputProcessor(InputProcessor):
    """LLaVA's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = image_token_id(hf_config)
        self.tokens_per_image = image_tokens(hf_config)
        self.side = _side(hf_config)
        self.load_images(model_dir, "CLIPImageProcessor")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<image>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                "<image>")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        pixels = cast(torch.Tensor, run_image_processor(self.image_processor, images)
                      ["pixel_values"])
        if tuple(pixels.shape[1:]) != (3, self.side, self.side):
            raise ValueError(f"multi_modal_data.image: the image processor made pixels of "
                             f"{tuple(pixels.shape[1:])}; the vision tower takes "
                             f"(3, {self.side}, {self.side}) (check preprocessor_config.json "
                             "crop_size)")

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            image = pixels[n].contiguous()
            return [self.image_token] * self.tokens_per_image, MultiModalItem(
                "image", {"pixel_values": image}, content_hash(image), offset,
                self.tokens_per_image)

        return splice_placeholders(prompt_token_ids, places, expand)


class LlavaModelState(EncoderCacheModelState):
    """The model state of ``LlavaForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.tokens_per_image = image_tokens(hf_config)
        self.side = _side(hf_config)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[3, S, S]`` pixels and ``tokens_per_image`` placeholders."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels = data.get("pixel_values")
        if not (isinstance(pixels, torch.Tensor)
                and tuple(pixels.shape) == (3, self.side, self.side)):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[3, {self.side}, {self.side}]")
        if item.length != self.tokens_per_image:
            raise ValueError(f"request {request.req_id!r}: an image has "
                             f"{self.tokens_per_image} tokens, got length {item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the encoder over the image: ``[tokens_per_image, hidden_size]``."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        return cast(torch.Tensor, cast(Any, self.model).embed_image(pixels.unsqueeze(0)))

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over one image of random pixels (every image is the same size), when
        one fits in ``max_prompt_tokens``, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        if self.tokens_per_image <= max_prompt_tokens:
            pixels = torch.randn(1, 3, self.side, self.side, device=self.device)
            cast(Any, self.model).embed_image(pixels)
        return self.encoder_cache_bytes
