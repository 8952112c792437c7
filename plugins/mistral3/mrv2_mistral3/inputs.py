"""Mistral 3's images: the input processor (prompt expansion, the checkpoint's Pixtral image
processor) and the model state (the encoder cache, each step's image rows).

**Prompts.** A prompt carries one ``[IMG]`` (``config.image_token_index``) per image where the
chat template puts it, as in HF and vLLM. Each is expanded as HF's ``PixtralProcessor``
expands it: for each row of the image's merged patch grid, ``cols`` ``[IMG]`` tokens and an
``[IMG_BREAK]``, the last row's break an ``[IMG_END]`` (the two ids from the checkpoint's
tokenizer). The whole run, ``rows * (cols + 1)`` tokens, is the image's
:class:`~mrv2.contract.requests.MultiModalItem`; attention stays causal, so a step may split it.

**Images.** The checkpoint's image processor (``preprocessor_config.json``: resized within
``size.longest_edge`` to multiples of ``patch_size * spatial_merge_size``, rescaled,
normalized; its PIL backend where torchvision is absent) gives each image's pixels and real
size; the item keeps the pixels cropped to that size, and its content hash is over them.

**Each step** (:class:`Mistral3ModelState`): an image's rows come from the core's encoder
cache (:class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`): one run of the encoder,
its features at the ``[IMG]`` rows and the text embeddings of ``[IMG_BREAK]`` / ``[IMG_END]``
at the others, as HF leaves them.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from mrv2.contract.staging import to_device

__all__ = ["Mistral3InputProcessor", "Mistral3ModelState", "image_layout"]


def image_layout(image_size: tuple[int, int], cell: int) -> tuple[int, int]:
    """``(rows, cols)`` of an image's merged patch grid: its real ``(h, w)`` in pixels over
    ``cell = patch_size * spatial_merge_size``."""
    return image_size[0] // cell, image_size[1] // cell


class Mistral3InputProcessor(InputProcessor):
    """Mistral 3's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_index)
        self.cell = int(hf_config.vision_config.patch_size) * int(hf_config.spatial_merge_size)
        self.break_id = self.end_id = -1
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                             "(the [IMG_BREAK] / [IMG_END] ids)")
            return
        hf = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        ids = [hf.convert_tokens_to_ids(t) for t in ("[IMG_BREAK]", "[IMG_END]")]
        unknown = getattr(hf, "unk_token_id", None)
        if any(not isinstance(i, int) or i == unknown for i in ids):
            self.images_refused = "the tokenizer has no [IMG_BREAK] / [IMG_END] tokens"
            return
        self.break_id, self.end_id = int(ids[0]), int(ids[1])
        self.load_images(model_dir, "PixtralImageProcessor")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``[IMG]`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                "[IMG]")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(  # (HF's PixtralProcessor passes the merged patch)
            self.image_processor, images, patch_size={"height": self.cell, "width": self.cell})
        pixels = cast(torch.Tensor, out["pixel_values"])
        sizes = [(int(h), int(w)) for h, w in out["image_sizes"].tolist()]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            (h, w), (rows, cols) = sizes[n], image_layout(sizes[n], self.cell)
            image = pixels[n, :, :h, :w].contiguous()
            data = {"pixel_values": image, "image_size": (h, w), "break_id": self.break_id,
                    "end_id": self.end_id}
            tokens: list[int] = []
            for row in range(rows):
                tokens.extend([self.image_token] * cols)
                tokens.append(self.end_id if row == rows - 1 else self.break_id)
            return tokens, MultiModalItem("image", data, content_hash(image), offset,
                                          rows * (cols + 1))

        return splice_placeholders(prompt_token_ids, places, expand)


class Mistral3ModelState(EncoderCacheModelState):
    """The model state of ``Mistral3ForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.cell = int(hf_config.vision_config.patch_size) * int(hf_config.spatial_merge_size)
        self.channels = int(getattr(hf_config.vision_config, "num_channels", 3))

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[C, h, w]`` pixels (multiples of the merged patch) and
        ``rows * (cols + 1)`` placeholders."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, size = data.get("pixel_values"), data.get("image_size")
        if not (isinstance(pixels, torch.Tensor) and isinstance(size, tuple)
                and tuple(pixels.shape) == (self.channels, *size)
                and size[0] % self.cell == 0 and size[1] % self.cell == 0 and min(size) > 0):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[{self.channels}, h, w] with (h, w) = image_size, multiples of "
                             f"{self.cell}")
        rows, cols = image_layout(size, self.cell)
        if item.length != rows * (cols + 1):
            raise ValueError(f"request {request.req_id!r}: an image of {rows} x {cols} merged "
                             f"patches has {rows * (cols + 1)} tokens, got length "
                             f"{item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The image's ``rows * (cols + 1)`` rows: one run of the encoder at the ``[IMG]``
        rows, the ``[IMG_BREAK]`` / ``[IMG_END]`` text embeddings at the row ends."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        size = cast(tuple[int, int], item.data["image_size"])
        model = cast(Any, self.model)
        features = model.embed_image(pixels, size)  # [rows * cols, hidden]
        rows, cols = image_layout(size, self.cell)
        ends = to_device([item.data["break_id"], item.data["end_id"]], torch.int64,
                         self.device)  # (staged: a plain torch.tensor on CUDA would sync)
        ends = model.embed_input_ids(ends).to(features.dtype)
        out = torch.empty(rows, cols + 1, features.shape[-1], dtype=features.dtype,
                          device=features.device)
        out[:, :cols] = features.view(rows, cols, -1)
        out[:, cols] = ends[0]
        out[-1, cols] = ends[1]
        return out.view(rows * (cols + 1), -1)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over the largest image the processor makes (a square of
        ``size.longest_edge`` pixels, 1,024 unless ``preprocessor_config.json`` says
        otherwise, within ``max_prompt_tokens``), random pixels, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        size = preprocessor_config(self.config.model.model).get("size")
        longest = size.get("longest_edge") if isinstance(size, dict) else None
        side = int(longest or 1024) // self.cell
        while side > 1 and side * (side + 1) > max_prompt_tokens:
            side -= 1
        if side >= 1:
            pixels = torch.randn(self.channels, side * self.cell, side * self.cell,
                                 device=self.device)
            cast(Any, self.model).embed_image(pixels, (side * self.cell, side * self.cell))
        return self.encoder_cache_bytes

