"""Aya Vision's images: the input processor (prompt expansion, the checkpoint's tiling image
processor) and the model state (the encoder cache, each step's image rows). Command A Vision
(:mod:`mrv2_cohere.cohere2_vision`) shares the model state and
:class:`TiledImageInputProcessor`'s expansion loop, with its own layout and tiling.

**Placeholders.** HF's ``AyaVisionProcessor`` replaces each ``<image>`` of the *text* (its
``image_token``, as the chat template writes it) before tokenizing; the model's
``config.image_token_id`` is ``<|IMG_PATCH|>``, the token each image feature lands on. A
prompt here marks an image with either: the tokenizer's ids of ``<image>`` (one token where
the tokenizer has it as an added token, else the run of ids it encodes to, found as a run;
what a text prompt or a chat template gives), or one ``<|IMG_PATCH|>`` (``image_token_id``: a
token-id prompt's single-id placeholder, as vLLM's token prompts take it). One per image.

**Images.** The checkpoint's image processor (GOT-OCR2's, its PIL backend where torchvision is
absent) with ``crop_to_patches`` on, as HF's processor sets it: the image resized to the grid
of ``size`` tiles (at most ``max_patches``, at least ``min_patches``) whose aspect ratio is
nearest its own, cut row-major, and a thumbnail of the whole image last where there is more
than one tile. The content hash is over the tiles.

**Layout.** As HF's ``replace_image_token``: ``<|START_OF_IMG|>``, then for tiles ``1 .. n-1``
``TILE_i`` and ``tokens_per_tile`` ``<|IMG_PATCH|>``, then ``TILE_GLOBAL`` and the thumbnail's
(or the single tile's) ``<|IMG_PATCH|>`` run, then ``<|END_OF_IMG|>``; the text through the
checkpoint's tokenizer (``TILE_i`` is whatever ids it gives). The whole layout is the item;
attention stays causal, so a step may split it. ``tokens_per_tile = (img_size // (patch_size
* downsample_factor))**2`` in ``processor_config.json`` (169 for Aya Vision's 364-pixel tiles)
must equal the model's ``(image_size / patch_size / downsample_factor)**2``, else images are
refused naming the fields (text prompts still run).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any, cast

import torch

from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    preprocessor_config,
    run_image_processor,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2_cohere.aya_vision import tokens_per_tile

__all__ = ["AyaVisionInputProcessor", "AyaVisionModelState", "TiledImageInputProcessor",
           "image_prompt"]

#: HF ``AyaVisionProcessor``'s token names and sizes, by its ``__init__`` argument names.
DEFAULTS: dict[str, Any] = {
    "image_token": "<image>", "start_of_img_token": "<|START_OF_IMG|>",
    "end_of_img_token": "<|END_OF_IMG|>", "img_patch_token": "<|IMG_PATCH|>",
    "tile_token": "TILE", "tile_global_token": "TILE_GLOBAL",
    "img_size": 364, "patch_size": 28, "downsample_factor": 1}


def image_prompt(tiles: int, per_tile: int, names: Mapping[str, Any] = DEFAULTS) -> str:
    """The text HF's processor puts in place of an image of ``tiles`` frames (the thumbnail
    counted; module doc), ``per_tile`` patch tokens each."""
    patch = str(names["img_patch_token"]) * per_tile
    text = str(names["start_of_img_token"])
    for idx in range(1, tiles):  # (the tiles before the thumbnail; none for one tile)
        text += f"{names['tile_token']}_{idx}{patch}"
    return text + f"{names['tile_global_token']}{patch}{names['end_of_img_token']}"


def _settings(model_dir: str) -> dict[str, Any]:
    """HF's processor settings in ``processor_config.json`` (its top level, as
    ``save_pretrained`` writes them), :data:`DEFAULTS` for those it lacks."""
    try:
        data = json.loads((Path(model_dir) / "processor_config.json").read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    return {key: value if data.get(key) is None else data[key]
            for key, value in DEFAULTS.items()}


def find_runs(ids: Sequence[int], patterns: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(position, length)`` of each non-overlapping occurrence of any of ``patterns`` in
    ``ids``, left to right (the longest pattern first where two start at one position)."""
    ordered = sorted((list(p) for p in patterns if p), key=len, reverse=True)
    found, i = [], 0
    while i < len(ids):
        for p in ordered:
            if list(ids[i:i + len(p)]) == p:
                found.append((i, len(p)))
                i += len(p)
                break
        else:
            i += 1
    return found


class TiledImageInputProcessor(InputProcessor):
    """What Aya Vision's and Command A Vision's input processors share: each image's
    placeholder (one of :attr:`patterns`, a run of ids) replaced by :meth:`layout` of its tile
    count, the tiles from the checkpoint's image processor with ``crop_to_patches`` on, one
    item per image (``pixel_values`` and the layout's ``token_ids``, for
    :class:`AyaVisionModelState`). A subclass sets :attr:`image_token` (the id each image
    feature lands on), :attr:`per_tile`, :attr:`patterns`, :attr:`placeholder_label` (the
    placeholders as an error message names them), :attr:`family` and the image processor,
    and implements :meth:`layout`."""

    family = "this model"

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.per_tile = tokens_per_tile(hf_config)
        self.patterns: list[list[int]] = [[self.image_token]]
        self.placeholder_label = f"token {self.image_token}"

    def layout(self, tiles: int) -> list[int]:
        """The token ids of an image of ``tiles`` frames, as HF's processor makes them."""
        raise NotImplementedError

    def check_tile_size(self, hf_config: Any) -> None:
        """Refuse images (naming the field) where the image processor's ``size`` is not the
        model's tile (``vision_config.image_size``)."""
        size = getattr(self.image_processor, "size", None)
        side = int(hf_config.vision_config.image_size)
        if self.image_processor is not None and (
                getattr(size, "height", None), getattr(size, "width", None)) != (side, side):
            self.image_processor = None
            self.images_refused = (f"preprocessor_config.json size={size!r}: the model's tiles "
                                   f"are {side} x {side} (vision_config.image_size)")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand each image's placeholder (module doc) and make the images' items;
        ValueError naming the field for bad input."""
        images = self.checked_images(mm_data, note=f" ({self.family} takes images only)")
        runs = find_runs(prompt_token_ids, self.patterns)
        if len(runs) != len(images):
            raise ValueError(
                f"multi_modal_data.image: {len(images)} images but the prompt has {len(runs)} "
                f"image placeholders ({self.placeholder_label}); put one per image")
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        out = run_image_processor(self.image_processor, images, crop_to_patches=True)
        pixels = cast(torch.Tensor, out["pixel_values"])
        counts = [int(n) for n in out["num_patches"]]
        firsts = list(accumulate(counts, initial=0))
        ids: list[int] = []
        items: list[MultiModalItem] = []
        start = 0
        for n, (place, length) in enumerate(runs):
            ids.extend(prompt_token_ids[start:place])
            tiles = pixels[firsts[n]:firsts[n + 1]].contiguous()
            layout = self.layout(counts[n])
            items.append(MultiModalItem("image", {"pixel_values": tiles, "token_ids": layout},
                                        content_hash(tiles), len(ids), len(layout)))
            ids.extend(layout)
            start = place + length
        ids.extend(prompt_token_ids[start:])
        return ids, items


class AyaVisionInputProcessor(TiledImageInputProcessor):
    """Aya Vision's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc).
    :attr:`per_tile` is the image tokens of a tile."""

    family = "Aya Vision"

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.names = _settings(model_dir)
        self.placeholder_label = (f"{self.names['image_token']} or "
                                  f"{self.names['img_patch_token']}, token {self.image_token}")
        self._layouts: dict[int, list[int]] = {}
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                                   "(the <|START_OF_IMG|> / TILE / <|IMG_PATCH|> ids)")
            return
        hf = self.hf_tokenizer = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        text = [int(t) for t in hf.encode(str(self.names["image_token"]),
                                          add_special_tokens=False)]
        if text and text != [self.image_token]:
            self.patterns.append(text)
        names, unknown = self.names, getattr(hf, "unk_token_id", None)
        patch = hf.convert_tokens_to_ids(names["img_patch_token"])
        ends = [hf.convert_tokens_to_ids(names[k]) for k in ("start_of_img_token",
                                                               "end_of_img_token")]
        want = (int(names["img_size"]) // (int(names["patch_size"])
                                           * int(names["downsample_factor"]))) ** 2
        if patch != self.image_token:
            self.images_refused = (f"the tokenizer's {names['img_patch_token']} is id {patch}, "
                                   f"but config.json image_token_id is {self.image_token}")
        elif any(not isinstance(i, int) or i == unknown for i in ends):
            self.images_refused = (f"the tokenizer has no {names['start_of_img_token']} / "
                                   f"{names['end_of_img_token']} tokens")
        elif want != self.per_tile:
            self.images_refused = (
                f"processor_config.json img_size={names['img_size']}, patch_size="
                f"{names['patch_size']}, downsample_factor={names['downsample_factor']} give "
                f"{want} image tokens a tile, but the model's tiles give {self.per_tile} "
                "(vision_config.image_size / patch_size / downsample_factor)")
        if self.images_refused:
            return
        self.start_id, self.end_id = int(ends[0]), int(ends[1])
        self.load_images(model_dir, "GotOcr2ImageProcessor")
        self.check_tile_size(hf_config)

    def layout(self, tiles: int) -> list[int]:
        """The token ids of an image of ``tiles`` frames, as HF's processor makes them;
        ValueError naming the field where the tokenizer splits the image tokens."""
        if tiles not in self._layouts:
            text = image_prompt(tiles, 1, self.names)
            ids = [int(t) for t in self.hf_tokenizer.encode(text, add_special_tokens=False)]
            if ids.count(self.image_token) != tiles or ids[0] != self.start_id \
                    or ids[-1] != self.end_id:
                raise ValueError("multi_modal_data.image: the tokenizer does not keep "
                                 f"{self.names['img_patch_token']} and the image start / end "
                                 "marks as single tokens")
            out: list[int] = []
            for t in ids:
                out.extend([t] * self.per_tile if t == self.image_token else [t])
            self._layouts[tiles] = out
        return self._layouts[tiles]


class AyaVisionModelState(EncoderCacheModelState):
    """The model state of ``AyaVisionForConditionalGeneration`` and
    ``Cohere2VisionForConditionalGeneration``: an image's rows are the encoder's features at
    its ``<|IMG_PATCH|>`` rows (``image_token_id``; tile by tile, the thumbnail last) and the
    layout tokens' text embeddings at the others."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.image_token = int(hf_config.image_token_id)
        self.per_tile = tokens_per_tile(hf_config)
        self.side = int(hf_config.vision_config.image_size)
        self.channels = int(getattr(hf_config.vision_config, "num_channels", 3))

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[tiles, C, S, S]`` pixels and ``token_ids`` of ``item.length`` ids
        holding ``tiles * per_tile`` image tokens."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, ids = data.get("pixel_values"), data.get("token_ids")
        shape = (self.channels, self.side, self.side)
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and pixels.shape[0] >= 1
                and tuple(pixels.shape[1:]) == shape):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[tiles, {', '.join(map(str, shape))}]")
        want = pixels.shape[0] * self.per_tile
        if not (isinstance(ids, list) and len(ids) == item.length
                and ids.count(self.image_token) == want):
            raise ValueError(f"request {request.req_id!r}: an image of {pixels.shape[0]} tiles "
                             f"needs token_ids of its {item.length} tokens holding {want} "
                             "image tokens")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the encoder over the image's tiles at the ``<|IMG_PATCH|>`` rows, the
        layout tokens' text embeddings at the others."""
        model = cast(Any, self.model)
        features = model.embed_image(self.upload(cast(torch.Tensor,
                                                      item.data["pixel_values"])))
        return self.splice_features(item.data["token_ids"], features, self.image_token)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over the most tiles an image may have (``max_patches`` and the
        thumbnail, from the preprocessor config; 13 with Aya Vision's), fewer where the layout
        would not fit ``max_prompt_tokens``; random pixels, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        settings = preprocessor_config(self.config.model.model)
        most = int(settings.get("max_patches", 12) or 1)
        tiles = most + 1 if most > 1 else 1
        while tiles > 1 and tiles * (self.per_tile + 4) + 2 > max_prompt_tokens:
            tiles -= 1
        if tiles == 2:  # (two frames are never made: one tile has no thumbnail)
            tiles = 1
        if self.per_tile + 3 <= max_prompt_tokens:
            pixels = torch.randn(tiles, self.channels, self.side, self.side, device=self.device)
            cast(Any, self.model).embed_image(pixels)
        return self.encoder_cache_bytes
