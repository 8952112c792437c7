"""Llama 4's images: the input processor (prompt expansion, the image preprocessing of
:mod:`mrv2_llama4.images`) and the model state (the encoder cache, each step's image rows).

**Prompts.** A prompt carries one ``<|image|>`` per image where the chat template puts it, as
HF's ``Llama4Processor`` takes it. Each is expanded as that processor expands it
(:func:`~mrv2_llama4.images.image_layout`): ``<|image_start|>``, the tiles' ``<|patch|>``
runs with their separators, ``<|image|>``, the global tile's run, ``<|image_end|>``; the ids
come from the checkpoint's tokenizer, and ``<|patch|>`` / ``<|image_start|>`` /
``<|image_end|>`` must be ``config.json``'s ``image_token_index`` / ``boi_token_index`` /
``eoi_token_index`` (images are refused naming the field otherwise; text prompts still run).
The whole expansion is the image's :class:`~mrv2.contract.requests.MultiModalItem`;
attention stays causal, so a step may split it. A prompt that already holds ``<|patch|>``
tokens beside images is refused (give one ``<|image|>`` per image). Video and other media
are refused naming the field, as are more images than ``--limit-mm-per-prompt``.

**Images.** The checkpoint's ``preprocessor_config.json``
(:class:`~mrv2_llama4.images.ImageSettings`; its tile side must be the tower's
``vision_config.image_size``) drives :func:`~mrv2_llama4.images.preprocess`: each image's
``[tiles, 3, S, S]`` bf16 pixels and its ``(rows, cols)`` tile grid make the content hash.

**Each step** (:class:`Llama4ImageModelState`): an image's rows come from the core's encoder
cache (:class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`): one run of the encoder
over the image's tiles, its features at the ``<|patch|>`` rows (tile by tile, in order, as HF
scatters them) and the layout tokens' text embeddings at the others. The state also sizes the
text model's RoPE table to the context length, as
:class:`~mrv2_llama4.state.Llama4ModelState` does.
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
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2.model_loader.build import text_config_of
from mrv2_llama4.images import (
    IMAGE_TOKENS,
    ImageSettings,
    ImageTokens,
    image_layout,
    layout_length,
    preprocess,
)
from mrv2_llama4.model import Llama4ForCausalLM
from mrv2_llama4.state import context_length
from mrv2_llama4.vision import tile_side, tokens_per_tile

__all__ = ["Llama4ImageModelState", "Llama4InputProcessor", "image_token_ids"]

_IMAGES_ONLY = " (Llama 4 takes images only)"
#: ``config.json`` fields the tokenizer's layout tokens must agree with.
_CONFIG_IDS = (("patch", "<|patch|>", "image_token_index"),
               ("start", "<|image_start|>", "boi_token_index"),
               ("end", "<|image_end|>", "eoi_token_index"))


def image_token_ids(tokenizer: Any, hf_config: Any) -> ImageTokens:
    """The layout tokens' ids (:data:`~mrv2_llama4.images.IMAGE_TOKENS`) from ``tokenizer``
    (the engine's, or HF's); ValueError naming the token or the ``config.json`` field where
    one is missing or disagrees with the config."""
    hf = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
    unknown = getattr(hf, "unk_token_id", None)
    ids: list[int] = []
    for name in IMAGE_TOKENS:
        found = hf.convert_tokens_to_ids(name)
        if not isinstance(found, int) or found == unknown:
            raise ValueError(f"the tokenizer has no {name} token")
        ids.append(found)
    tokens = ImageTokens(*ids)
    for attr, name, field in _CONFIG_IDS:
        want = getattr(hf_config, field, None)
        if getattr(tokens, attr) != want:
            raise ValueError(f"the tokenizer's {name} is id {getattr(tokens, attr)}, but "
                             f"config.json {field} is {want}")
    return tokens


class Llama4InputProcessor(InputProcessor):
    """Llama 4's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc).
    :attr:`image_processor` is the :class:`~mrv2_llama4.images.ImageSettings` (None where
    images are refused, for the reason in :attr:`images_refused`)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        vc = hf_config.vision_config
        self.per_tile = tokens_per_tile(vc)
        self.tokens: ImageTokens | None = None
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's "
                                   f"tokenizer (the ids of {', '.join(IMAGE_TOKENS)})")
            return
        try:
            self.tokens = image_token_ids(tokenizer, hf_config)
            raw = preprocessor_config(model_dir)
            if not raw:
                raise ValueError(f"no readable preprocessor_config.json in {model_dir!r}: a "
                                 "vision-language checkpoint ships its image processor's "
                                 "config")
            settings = ImageSettings.from_config(raw)
            if settings.tile != tile_side(vc):
                raise ValueError(f"preprocessor_config.json size = {settings.tile} x "
                                 f"{settings.tile}: the vision tower takes tiles of "
                                 f"vision_config.image_size = {tile_side(vc)}")
        except ValueError as why:  # (text prompts still run; images are refused)
            self.images_refused = str(why)
            return
        self.image_processor = settings

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<|image|>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input, before any image is processed."""
        if self.tokens is None:
            given = mm_data.get("image", [])
            if not isinstance(given, (list, tuple)) or given:
                self.require_images()
            self.images_and_places(prompt_token_ids, mm_data, -1, note=_IMAGES_ONLY)
            return list(prompt_token_ids), []
        tokens = self.tokens
        images, places = self.images_and_places(prompt_token_ids, mm_data, tokens.image,
                                                "<|image|>", note=_IMAGES_ONLY)
        if not images:
            return list(prompt_token_ids), []
        settings = cast(ImageSettings, self.require_images())
        if tokens.patch in prompt_token_ids:
            raise ValueError(f"multi_modal_data.image: the prompt already holds <|patch|> "
                             f"tokens (id {tokens.patch}); give one <|image|> per image, "
                             "which is expanded here")
        processed = [preprocess(image, settings) for image in images]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            tiles, (rows, cols) = processed[n]
            layout = image_layout(rows, cols, self.per_tile, tokens)
            return layout, MultiModalItem(
                "image", {"pixel_values": tiles, "token_ids": layout},
                content_hash(tiles, (rows, cols)), offset, len(layout))

        return splice_placeholders(prompt_token_ids, places, expand)


class Llama4ImageModelState(EncoderCacheModelState):
    """The model state of ``Llama4ForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        if isinstance(model, Llama4ForCausalLM):
            model.size_rope_table(context_length(text_config_of(hf_config),
                                                 config.model.fixed_max_model_len))
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vision = model.vision
        self.patch_token = int(hf_config.image_token_index)
        self.tile_shape = (int(vision.num_channels), int(vision.tile), int(vision.tile))
        self.per_tile = int(vision.tokens_per_tile)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[tiles, C, S, S]`` pixels and ``token_ids`` of ``item.length`` ids
        holding ``tiles * tokens_per_tile`` ``<|patch|>`` tokens."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, ids = data.get("pixel_values"), data.get("token_ids")
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and pixels.shape[0] >= 1
                and tuple(pixels.shape[1:]) == self.tile_shape):
            shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else None
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[tiles, {', '.join(map(str, self.tile_shape))}], got {shape}")
        want = int(pixels.shape[0]) * self.per_tile
        if not (isinstance(ids, list) and len(ids) == item.length
                and ids.count(self.patch_token) == want):
            raise ValueError(f"request {request.req_id!r}: an image of {pixels.shape[0]} tiles "
                             f"needs token_ids of its {item.length} tokens holding {want} "
                             f"<|patch|> tokens (id {self.patch_token})")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The image's ``item.length`` rows: one run of the encoder over its tiles at the
        ``<|patch|>`` rows, the layout tokens' text embeddings at the others."""
        model = cast(Any, self.model)
        features = model.embed_image(self.upload(cast(torch.Tensor,
                                                      item.data["pixel_values"])))
        return self.splice_features(item.data["token_ids"], features, self.patch_token)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over the most tiles one image may have (``max_patches`` from
        ``preprocessor_config.json``, 16 by default, plus the global tile; fewer where the
        layout would not fit in ``max_prompt_tokens``), random pixels, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        settings = preprocessor_config(self.config.model.model)
        count = settings.get("max_patches")
        tiles = count if isinstance(count, int) and count >= 1 else ImageSettings.max_patches
        while tiles > 1 and layout_length(tiles, self.per_tile) > max_prompt_tokens:
            tiles -= 1
        if layout_length(tiles, self.per_tile) <= max_prompt_tokens:
            frames = tiles + 1 if tiles > 1 else 1
            pixels = torch.randn(frames, *self.tile_shape, device=self.device)
            cast(Any, self.model).embed_image(pixels)
        return self.encoder_cache_bytes
