"""Step-3.7's images: the image processor (HF's ``Step3p7ImageProcessor`` restated in torch:
it needs torchvision), the input processor (prompt expansion) and the model state (the
encoder cache, each step's image rows).

**Views** (HF's ``_plan_patches`` / ``_get_image_patches``): an image whose short side is
under 32 pixels with an aspect ratio over 4 is zero-padded to a square (top-left kept); one
over ``max_image_size`` (3024) on its long side is scaled down to it (``int(side * scale)``).
The *global view* is the image resized to that size, then to ``size`` x ``size`` (728). Local
*crops*: where the long side fits ``size``, only an image more elongated than 1.5 is cut, by
windows of its short side; else windows of ``patch_size`` (504), or of ``min(short side,
patch_size)`` for a ratio over 4. Each side at least a window is snapped to a multiple of the
window (up where the rest exceeds a fifth of it), the image resized to the snapped size, cut
row-major into windows, each resized to ``patch_size`` x ``patch_size``. Resizes are
torchvision's antialiased bilinear on ``uint8`` (:func:`mrv2.contract.input_processor.
resize_uint8`), then ``(x - 255 mean) / (255 std)`` (CLIP's mean and std).

**Prompt**: each image is one ``<im_patch>`` (``image_token_id``: the text HF's processor
replaces, vLLM's placeholder), expanded as HF's ``Step3p7Processor.replace_image_token``: per
crop ``<patch_start>``, its features' ``<im_patch>`` run, ``<patch_end>``, and a
``<patch_newline>`` after the last crop of each row but the last; then ``<im_start>``, the
global view's run, ``<im_end>``. A view of ``s`` pixels gives ``(s / 56)**2`` features
(169 for 728, 81 for 504); ``size`` and ``patch_size`` must be multiples of ``4 *
vision_config.patch_size``, else images are refused naming the field (text prompts still
run). The whole layout is the item; attention stays causal, so a step may split it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch

from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    preprocessor_config,
    resize_uint8,
    rgb_pixels,
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2_step.vision import features_per_side

__all__ = ["Step3p7ImageProcessor", "Step3p7InputProcessor", "Step3p7ModelState", "TOKENS",
           "plan_views"]

#: HF ``Step3p7Processor``'s tokens, by role.
TOKENS: dict[str, str] = {
    "image": "<im_patch>", "patch_start": "<patch_start>", "patch_end": "<patch_end>",
    "newline": "<patch_newline>", "im_start": "<im_start>", "im_end": "<im_end>"}
#: OpenAI CLIP's mean and std (HF's defaults for Step-3.7).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def plan_views(width: int, height: int, size: int, patch_size: int, max_image_size: int
               ) -> tuple[tuple[int, int], tuple[int, int], int, int, int, bool]:
    """HF's ``_plan_patches`` (module doc): ``((width, height) of the global resize,
    (width, height) to crop from, window (0: no crops), crops across, crops down,
    square-padded)``."""
    padded = min(width, height) < 32 and max(width / height, height / width) > 4
    if padded:
        width = height = max(width, height)
    if max(width, height) > max_image_size:
        scale = max_image_size / max(width, height)
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= size:
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, patch_size)
    else:
        window = patch_size
    if window == 0:
        return (width, height), (width, height), 0, 0, 0, padded

    def snap(dim: int) -> int:
        if dim < window:
            return dim
        return window * (dim // window + int(dim % window > 0.2 * window))

    crop_w, crop_h = snap(width), snap(height)
    return ((width, height), (crop_w, crop_h), window, max(1, crop_w // window),
            max(1, crop_h // window), padded)


class Step3p7ImageProcessor:
    """HF's ``Step3p7ImageProcessor`` in plain torch (module doc); settings from the
    checkpoint's preprocessor config, HF's defaults for those it lacks. Calling it on images
    gives HF's ``pixel_values`` (``[images, 3, size, size]``), ``pixel_values_local``
    (``[crops, 3, patch_size, patch_size]``, every image's, in order), ``num_local_patches``
    and ``patch_newline_masks`` (unpadded)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        size = settings.get("size") or {"height": 728, "width": 728}
        self.size = int(size["height"]) if isinstance(size, Mapping) else int(size)
        self.patch_size = int(settings.get("patch_size") or 504)
        self.max_image_size = int(settings.get("max_image_size") or 3024)
        factor = float(settings.get("rescale_factor") or 1 / 255)
        self.mean = torch.tensor(settings.get("image_mean") or CLIP_MEAN).view(3, 1, 1) / factor
        self.std = torch.tensor(settings.get("image_std") or CLIP_STD).view(3, 1, 1) / factor
        self.convert_rgb = bool(settings.get("do_convert_rgb", True))

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """``uint8`` -> ``(x - 255 mean) / (255 std)`` in fp32."""
        return (pixels.float() - self.mean) / self.std

    def views(self, image: Any) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """One image's normalized global view ``[3, size, size]``, crops ``[n, 3, patch_size,
        patch_size]`` and newline mask (one flag a crop)."""
        pixels = rgb_pixels(image, self.convert_rgb)
        _, height, width = pixels.shape
        (gw, gh), (cw, ch), window, across, down, padded = plan_views(
            width, height, self.size, self.patch_size, self.max_image_size)
        if padded:
            side = max(width, height)
            square = torch.zeros(3, side, side, dtype=pixels.dtype)
            square[:, :height, :width] = pixels
            pixels = square
        whole = resize_uint8(resize_uint8(pixels, (gh, gw)), (self.size, self.size))
        crops = torch.empty(0, 3, self.patch_size, self.patch_size)
        if window:
            cut = resize_uint8(pixels, (ch, cw))
            tiles = [resize_uint8(cut[:, y:y + window, x:x + window],
                                  (self.patch_size, self.patch_size))
                     for y in range(0, ch, window) for x in range(0, cw, window)]
            crops = self.normalize(torch.stack(tiles))
        mask = [col == across - 1 and row < down - 1
                for row in range(down) for col in range(across)]
        return self.normalize(whole), crops, mask

    def __call__(self, images: list[Any]) -> dict[str, Any]:
        views = [self.views(image) for image in images]
        return {"pixel_values": torch.stack([v[0] for v in views]),
                "pixel_values_local": torch.cat([v[1] for v in views]),
                "num_local_patches": [v[1].shape[0] for v in views],
                "patch_newline_masks": [v[2] for v in views]}


def _check_view(field: str, pixels: int, side: int) -> str:
    """Why a view of ``pixels`` cannot be served (``side``: 4 patches), or ``""``."""
    if pixels < side or pixels % side:
        return (f"preprocessor_config.json {field}={pixels}: must be a multiple of {side} "
                "(4 x vision_config.patch_size: HF's processor counts (size / "
                f"{side})**2 image tokens a view)")
    return ""


class Step3p7InputProcessor(InputProcessor):
    """Step-3.7's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                                   "(the <im_start> / <patch_start> / ... ids)")
            return
        hf = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        unknown = getattr(hf, "unk_token_id", None)
        ids = {k: hf.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
        if ids["image"] != self.image_token:
            self.images_refused = (f"the tokenizer's <im_patch> is id {ids['image']}, but "
                                   f"config.json image_token_id is {self.image_token}")
            return
        missing = [TOKENS[k] for k, i in ids.items() if not isinstance(i, int) or i == unknown]
        if missing:
            self.images_refused = f"the tokenizer has no {' / '.join(missing)} tokens"
            return
        self.ids = {k: int(i) for k, i in ids.items()}
        settings = preprocessor_config(model_dir)
        if not settings:
            self.images_refused = (f"{model_dir} has no preprocessor_config.json (the image "
                                   "processor's settings)")
            return
        processor = Step3p7ImageProcessor(settings)
        side = 4 * int(hf_config.vision_config.patch_size)
        self.images_refused = (_check_view("size", processor.size, side)
                               or _check_view("patch_size", processor.patch_size, side))
        if self.images_refused:
            return
        self.image_processor = processor
        patch = int(hf_config.vision_config.patch_size)
        self.per_image = features_per_side(processor.size, patch) ** 2
        self.per_crop = features_per_side(processor.patch_size, patch) ** 2

    def layout(self, mask: list[bool]) -> list[int]:
        """The token ids of an image of ``len(mask)`` crops (``mask``: a newline after each
        flagged crop), as HF's ``replace_image_token`` makes them."""
        ids = self.ids
        out: list[int] = []
        for newline in mask:
            out += [ids["patch_start"], *[ids["image"]] * self.per_crop, ids["patch_end"]]
            if newline:
                out.append(ids["newline"])
        return out + [ids["im_start"], *[ids["image"]] * self.per_image, ids["im_end"]]

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand each image's ``<im_patch>`` (module doc) and make the images' items;
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                "<im_patch>", note=" (Step-3.7 takes images)")
        if not images:
            return list(prompt_token_ids), []
        processor = cast(Step3p7ImageProcessor, self.require_images())
        views = [processor.views(image) for image in images]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            whole, crops, mask = views[n]
            layout = self.layout(mask)
            data = {"pixel_values": whole[None].contiguous(),
                    "pixel_values_local": crops.contiguous(), "token_ids": layout}
            return layout, MultiModalItem("image", data, content_hash(whole, crops),
                                          offset, len(layout))

        return splice_placeholders(prompt_token_ids, places, expand)


class Step3p7ModelState(EncoderCacheModelState):
    """The model state of ``Step3p7ForConditionalGeneration``: an image's rows are the
    encoder's features at its ``<im_patch>`` rows (the crops', then the global view's) and
    the layout tokens' text embeddings at the others."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.image_token = int(hf_config.image_token_id)
        self.patch = int(hf_config.vision_config.patch_size)
        self.channels = int(getattr(hf_config.vision_config, "num_channels", 3))

    def _tokens(self, pixels: torch.Tensor) -> int:
        return (features_per_side(int(pixels.shape[-2]), self.patch)
                * features_per_side(int(pixels.shape[-1]), self.patch))

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """A global view ``[1, C, S, S]``, crops ``[n, C, P, P]`` and ``token_ids`` of
        ``item.length`` ids holding their features' image tokens."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        whole, crops, ids = (data.get("pixel_values"), data.get("pixel_values_local"),
                             data.get("token_ids"))
        side = 4 * self.patch
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == self.channels
                   and t.shape[2] % side == 0 and t.shape[3] % side == 0
                   for t in (whole, crops)) or cast(torch.Tensor, whole).shape[0] != 1:
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values [1, "
                             f"{self.channels}, S, S] and pixel_values_local [n, "
                             f"{self.channels}, P, P] (S, P multiples of {side})")
        whole, crops = cast(torch.Tensor, whole), cast(torch.Tensor, crops)
        want = self._tokens(whole) + crops.shape[0] * self._tokens(crops)
        if not (isinstance(ids, list) and len(ids) == item.length
                and ids.count(self.image_token) == want):
            raise ValueError(f"request {request.req_id!r}: an image of {crops.shape[0]} crops "
                             f"needs token_ids of its {item.length} tokens holding {want} "
                             "image tokens")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The encoder over the crops, then the global view, at the ``<im_patch>`` rows; the
        layout tokens' text embeddings at the others."""
        model = cast(Any, self.model)
        crops = cast(torch.Tensor, item.data["pixel_values_local"])
        parts = [] if crops.shape[0] == 0 else [model.embed_image(self.upload(crops))]
        parts.append(model.embed_image(self.upload(cast(torch.Tensor,
                                                        item.data["pixel_values"]))))
        return self.splice_features(item.data["token_ids"], torch.cat(parts), self.image_token)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The global view and as many crops as a prompt of ``max_prompt_tokens`` may hold
        (random pixels, output dropped); returns :attr:`encoder_cache_bytes`."""
        settings = preprocessor_config(self.config.model.model)
        processor = Step3p7ImageProcessor(settings)
        size, crop = processor.size, processor.patch_size
        side = 4 * self.patch
        if size % side or crop % side:
            return self.encoder_cache_bytes  # (images are refused)
        per_image = features_per_side(size, self.patch) ** 2
        per_crop = features_per_side(crop, self.patch) ** 2
        if per_image + 2 > max_prompt_tokens:
            return self.encoder_cache_bytes
        crops = min(math.ceil(processor.max_image_size / 32),
                    (max_prompt_tokens - per_image - 2) // (per_crop + 3))
        model = cast(Any, self.model)
        model.embed_image(torch.randn(1, self.channels, size, size, device=self.device))
        if crops > 0:
            model.embed_image(torch.randn(crops, self.channels, crop, crop, device=self.device))
        return self.encoder_cache_bytes
