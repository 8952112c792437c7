"""Llama 4's image preprocessing in torch, without torchvision: what HF's
``Llama4ImageProcessorFast`` (transformers 5.17's ``image_processing_llama4.py``, which needs
torchvision) makes of an image, and the prompt layout HF's ``Llama4Processor`` gives it.

**Tiles.** ``S`` is ``size.height`` (= ``size.width``; 336 in Scout and Maverick). The
candidate canvases are ``(r * S, c * S)`` for every ``r * c <= max_patches``, in HF's
``find_supported_resolutions`` order. Each scales the image without distortion by
``min(r S / H, c S / W)``; HF picks the smallest such scale that is ``>= 1`` (the largest
with ``resize_to_max_canvas``), else the largest one below 1, and among the canvases of that
scale the smallest (first in order). The image is resized without distortion to fit the
canvas, but never upscaled past ``max(H, S) x max(W, S)`` (unless ``resize_to_max_canvas``),
padded with zeros on the right and bottom to the canvas, rescaled and normalized, and cut into
``r x c`` tiles of ``S x S``, row-major. Where ``r * c > 1`` the whole image, resized to
``S x S`` (distorted), rescaled and normalized alike, is a last, global tile. The arithmetic
of the canvas choice is HF's, types included (:func:`best_canvas`, :func:`resize_target`:
float32 where HF's sides are tensors), so the same sizes come out.

**Pixels.** RGB ``uint8`` ``[3, H, W]`` (PIL's ``convert("RGB")`` where ``do_convert_rgb``, as
HF converts). :func:`resize` (the core's ``resize_uint8``, with :func:`rgb_pixels` in
:mod:`mrv2.contract.input_processor`) is torchvision's ``resize`` of a ``uint8`` CPU image
restated: ``torch.nn.functional.interpolate`` with ``antialias=True`` (bilinear, or bicubic
for ``resample: 3``), on the ``uint8`` tensor where torchvision does that (bicubic; bilinear
where the CPU's capability is AVX2 or AVX512, or on ARM64), else in fp32, then rounded
(bicubic clamped first) to ``uint8``. It is the same torch call torchvision makes, so the
pixels are those of HF's fast processor on the same CPU (read from torchvision 0.29's source;
torchvision itself is not installed here to run). PIL's bilinear resize differs from it by one
level of 255 here and there, as torch's ``uint8`` and fp32 paths differ from each other.
Rescale and normalize are HF's Llama 4 override: the ``uint8`` pixels to bf16, times
``rescale_factor``, minus ``image_mean``, over ``image_std`` (both as bf16), each op rounded
to bf16; the tiles stay bf16 (``[tiles, 3, S, S]``, what HF returns), cast to the model's
dtype by the encoder.

**Prompt.** One ``<|image|>`` in the prompt per image is replaced by
``<|image_start|>``, then for a tiled image each row's tiles of ``N`` ``<|patch|>`` tokens
with ``<|tile_x_separator|>`` between them and a ``<|tile_y_separator|>`` after the row,
then ``<|image|>``, the global tile's ``N`` ``<|patch|>`` tokens and ``<|image_end|>``
(:func:`image_layout`, HF's ``_prompt_split_image``). ``N`` (``tokens_per_tile``) is ``(S //
patch_size)**2 * pixel_shuffle_ratio**2``: 144 in Scout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mrv2.contract.input_processor import resize_uint8 as resize
from mrv2.contract.input_processor import rgb_pixels

__all__ = ["IMAGE_TOKENS", "ImageSettings", "ImageTokens", "best_canvas", "image_layout",
           "layout_length", "normalize", "preprocess", "resize", "resize_target",
           "rgb_pixels", "supported_canvases"]

#: The layout tokens' names (HF's ``Llama4Processor`` defaults), as :class:`ImageTokens`
#: orders them.
IMAGE_TOKENS: tuple[str, ...] = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>",
                                 "<|tile_x_separator|>", "<|tile_y_separator|>")

#: PIL's resample codes supported, as ``interpolate`` modes.
_MODES = {2: "bilinear", 3: "bicubic"}
_PROCESSOR_TYPES = ("Llama4ImageProcessor", "Llama4ImageProcessorFast")


@dataclass(frozen=True)
class ImageTokens:
    """The ids of the layout tokens (:data:`IMAGE_TOKENS`, from the tokenizer)."""

    start: int
    end: int
    image: int
    patch: int
    tile_x: int
    tile_y: int


def _field(config: Mapping[str, Any], name: str, default: Any) -> Any:
    value = config.get(name)
    return default if value is None else value


@dataclass(frozen=True)
class ImageSettings:
    """The preprocessing settings of ``preprocessor_config.json`` (HF's class defaults where a
    field is absent): the tile side ``S``, ``max_patches``, ``resize_to_max_canvas``, the
    resize mode, ``rescale_factor``, ``image_mean``, ``image_std``, ``do_convert_rgb``."""

    tile: int = 336
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    mode: str = "bilinear"
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    convert_rgb: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ImageSettings:
        """The settings of a ``preprocessor_config.json`` dict; ValueError naming the file's
        field for a value HF's processor refuses or mrv2 does not implement."""
        where = "preprocessor_config.json"
        kind = str(config.get("image_processor_type") or "Llama4ImageProcessorFast")
        if kind not in _PROCESSOR_TYPES:
            raise ValueError(f"{where} image_processor_type = {kind!r}: expected one of "
                             f"{list(_PROCESSOR_TYPES)}")
        size = _field(config, "size", {"height": 336, "width": 336})
        sides = (size.get("height"), size.get("width")) if isinstance(size, Mapping) else ()
        if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) \
                or sides[0] < 1:
            raise ValueError(f"{where} size = {size!r}: expected a square "
                             "{'height': S, 'width': S}")
        max_patches = _field(config, "max_patches", 16)
        if not isinstance(max_patches, int) or isinstance(max_patches, bool) or max_patches < 1:
            raise ValueError(f"{where} max_patches = {max_patches!r}: a positive int")
        for name in ("do_resize", "do_rescale", "do_normalize"):
            if _field(config, name, True) is not True:
                raise ValueError(f"{where} {name} = {config.get(name)!r}: only true is "
                                 "supported (Llama 4 always resizes, rescales and normalizes)")
        resample = _field(config, "resample", 2)
        if resample not in _MODES:
            raise ValueError(f"{where} resample = {resample!r}: supported: 2 (bilinear), "
                             "3 (bicubic)")
        mean = _field(config, "image_mean", [0.5, 0.5, 0.5])
        std = _field(config, "image_std", [0.5, 0.5, 0.5])
        for name, value in (("image_mean", mean), ("image_std", std)):
            if not (isinstance(value, (list, tuple)) and len(value) == 3
                    and all(isinstance(v, (int, float)) for v in value)):
                raise ValueError(f"{where} {name} = {value!r}: three numbers (R, G, B)")
        if not all(std):
            raise ValueError(f"{where} image_std = {std!r}: must not be 0")
        return cls(tile=sides[0], max_patches=max_patches,
                   resize_to_max_canvas=bool(_field(config, "resize_to_max_canvas", False)),
                   mode=_MODES[resample],
                   rescale_factor=float(_field(config, "rescale_factor", 1 / 255)),
                   image_mean=tuple(float(v) for v in mean),
                   image_std=tuple(float(v) for v in std),
                   convert_rgb=bool(_field(config, "do_convert_rgb", True)))


def supported_canvases(max_patches: int, tile: int) -> list[tuple[int, int]]:
    """Every ``(r * tile, c * tile)`` with ``r * c <= max_patches``, in HF's
    ``find_supported_resolutions`` order (grouped by aspect ratio ``r / c`` in order of first
    appearance, tile counts from ``max_patches`` down, ``r`` ascending)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_patches, 0, -1):
        for rows in (r for r in range(1, count + 1) if count % r == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [(r * tile, c * tile) for pairs in by_ratio.values() for r, c in pairs]


def best_canvas(image_size: tuple[int, int], canvases: list[tuple[int, int]],
                to_max: bool = False) -> torch.Tensor:
    """HF's ``get_best_fit``: the canvas (an int64 ``[2]`` tensor ``(height, width)``, as HF
    keeps it) an ``image_size = (H, W)`` image is laid on (module doc). Float32 scales, as
    HF's tensor arithmetic has them."""
    height, width = image_size
    table = torch.tensor(canvases, dtype=torch.int64)
    scale_w = table[:, 1] / width
    scale_h = table[:, 0] / height
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up) > 0:
        chosen = torch.max(up) if to_max else torch.min(up)
    else:
        chosen = torch.max(scales[scales < 1])
    fits = table[scales == chosen]
    if len(fits) > 1:
        return fits[torch.argmin(fits[:, 0] * fits[:, 1])]
    return fits[0]


def resize_target(image_size: tuple[int, int], canvas: torch.Tensor, tile: int,
                  to_max: bool = False) -> tuple[int, int]:
    """The size the image is resized to (module doc): HF's upscaling limit, then HF's
    ``get_max_res_without_distortion``, op for op. A limited side is a Python int and a
    canvas side a 0-d tensor, so a scale is a float64 or a float32 as it is in HF."""
    height, width = image_size
    target_h: Any = canvas[0]
    target_w: Any = canvas[1]
    if not to_max:  # (Python's min keeps its first argument on a tie, as HF's call does)
        target_h = min(max(height, tile), target_h)
        target_w = min(max(width, tile), target_w)
    scale_w = target_w / width
    scale_h = target_h / height
    if scale_w < scale_h:
        new_w, new_h = target_w, min(math.floor(height * scale_w), target_h)
    else:
        new_h, new_w = target_h, min(math.floor(width * scale_h), target_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def normalize(pixels: torch.Tensor, settings: ImageSettings) -> torch.Tensor:
    """HF's Llama 4 rescale and normalize of ``uint8`` pixels, in bf16 (module doc)."""
    x = pixels.to(torch.bfloat16) * settings.rescale_factor
    mean = torch.as_tensor(settings.image_mean, dtype=torch.bfloat16).view(-1, 1, 1)
    std = torch.as_tensor(settings.image_std, dtype=torch.bfloat16).view(-1, 1, 1)
    return x.sub(mean).div_(std)


def preprocess(image: Any, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int]]:
    """One image -> ``(tiles [T, 3, S, S] bf16, (rows, cols))``: the ``rows x cols`` tiles
    row-major, then the global tile where ``rows * cols > 1`` (module doc)."""
    pixels = rgb_pixels(image, settings.convert_rgb)
    size = (int(pixels.shape[1]), int(pixels.shape[2]))
    tile = settings.tile
    canvas = best_canvas(size, supported_canvases(settings.max_patches, tile),
                         settings.resize_to_max_canvas)
    resized = resize(pixels, resize_target(size, canvas, tile, settings.resize_to_max_canvas),
                     settings.mode)
    canvas_h, canvas_w = int(canvas[0]), int(canvas[1])
    padded = F.pad(resized, (0, canvas_w - resized.shape[2], 0, canvas_h - resized.shape[1]))
    rows, cols = canvas_h // tile, canvas_w // tile
    tiles = normalize(padded, settings).view(3, rows, tile, cols, tile)
    tiles = tiles.permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
    if rows * cols > 1:
        whole = normalize(resize(pixels, (tile, tile), settings.mode), settings)
        tiles = torch.cat([tiles, whole[None]])
    return tiles.contiguous(), (rows, cols)


def image_layout(rows: int, cols: int, per_tile: int, tokens: ImageTokens) -> list[int]:
    """The token ids an image of ``rows x cols`` tiles takes in the prompt (module doc; HF's
    ``_prompt_split_image``), ``per_tile`` ``<|patch|>`` tokens a tile."""
    ids = [tokens.start]
    if rows * cols > 1:
        for _ in range(rows):
            for col in range(cols):
                ids.extend([tokens.patch] * per_tile)
                if col < cols - 1:
                    ids.append(tokens.tile_x)
            ids.append(tokens.tile_y)
    ids.append(tokens.image)
    ids.extend([tokens.patch] * per_tile)
    ids.append(tokens.end)
    return ids


def layout_length(tiles: int, per_tile: int) -> int:
    """The length of :func:`image_layout` for ``tiles = rows * cols`` tiles (it depends on
    the count only)."""
    return per_tile + 3 + (tiles * (per_tile + 1) if tiles > 1 else 0)
