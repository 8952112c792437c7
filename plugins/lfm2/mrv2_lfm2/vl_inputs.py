"""LFM2-VL's images: the preprocessing, the input processor (prompt expansion) and the model
state (the encoder cache, each step's image rows).

**Preprocessing.** HF's ``Lfm2VlImageProcessor`` (transformers 5.17) has only a torchvision
backend, which the CPU CI lacks, so :func:`preprocess` restates it in torch with the core's
:func:`~mrv2.contract.input_processor.resize_uint8` (torchvision's resize on the same CPU)
and the checkpoint's settings (``processor_config.json``'s ``image_processor`` or
``preprocessor_config.json``; HF's defaults for fields it leaves out). With ``P =
encoder_patch_size``, ``f = downsample_factor`` and ``T = tile_size``, an ``H x W`` image is
*smart-resized* to ``h x w`` (multiples of ``P * f``, aspect kept, ``min_image_tokens`` to
``max_image_tokens`` tokens). It is *large* where HF's rounded area exceeds
``max_image_tokens * (P f)**2 * max_pixels_tolerance``; a large image with splitting on
(``do_image_splitting`` and not ``min_tiles == max_tiles == 1``) is resized to ``rows * T x
cols * T`` for the grid whose aspect is closest among ``min_tiles .. max_tiles`` tiles (HF's
``find_closest_aspect_ratio``, ties to the larger grid where the image covers half of it),
cut into ``rows x cols`` tiles (row-major) and, with ``use_thumbnail``, followed by the
smart-resized image as a thumbnail; any other image is the smart-resized image alone. Each
frame is rescaled and normalized in fp32 as HF fuses them (``(x - mean / r) / (std / r)``)
and cut into ``P x P`` patches, row-major, each ``(row, column, channel)``: the tower's input.
The item's content hash is over the patches and the frames' ``(h, w)`` patch grids.

**Prompts.** A prompt carries one ``<image>`` (``config.image_token_id``) per image, as HF's
``Lfm2VlProcessor`` takes it, expanded as it expands it (``use_image_special_tokens``, its
default): ``<|image_start|>``, then for a tiled image per tile ``<|img_row_r_col_c|>`` and
``(T / P / f)**2`` ``<image>`` tokens, then (``use_thumbnail``) ``<|img_thumbnail|>`` and the
thumbnail's ``(h / P / f) * (w / P / f)`` ``<image>`` tokens; for an untiled image only its
``<image>`` tokens; then ``<|image_end|>``. The tags are the tokenizer's ids for them. The
whole expansion is the image's :class:`~mrv2.contract.requests.MultiModalItem`; attention
stays causal (HF's text model is LFM2's), so a step may split it.

**Each step** (:class:`Lfm2VlModelState`): an image's rows come from the core's encoder cache:
one run of the encoder over its frames, its rows at the ``<image>`` tokens (frame by frame,
in order, as HF scatters them) and the text embeddings of the tags at the others. The
convolution layers' per-request state is the core's, as for LFM2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
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

__all__ = ["ImageSettings", "Lfm2VlInputProcessor", "Lfm2VlModelState", "preprocess"]

START, END, THUMBNAIL, IMAGE = ("<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                                "<image>")
_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes supported


@dataclass(frozen=True)
class ImageSettings:
    """HF's ``Lfm2VlImageProcessor`` fields (its defaults where the checkpoint leaves one
    out)."""

    patch: int = 16
    factor: int = 2
    tile: int = 512
    splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    thumbnail: bool = True
    min_tokens: int = 64
    max_tokens: int = 256
    tolerance: float = 2.0
    mode: str = "bilinear"
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    convert_rgb: bool = True

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> ImageSettings:
        """From the checkpoint's settings dict; ValueError naming the field for one that is
        not supported."""
        d = cls()

        def get(name: str, default: Any) -> Any:
            value = settings.get(name)
            return default if value is None else value

        resample = get("resample", 2)
        if resample not in _MODES:
            raise ValueError(f"preprocessor_config.json resample={resample!r}: supported: "
                             f"{sorted(_MODES)} (bilinear, bicubic)")
        out = cls(
            patch=int(get("encoder_patch_size", d.patch)),
            factor=int(get("downsample_factor", d.factor)), tile=int(get("tile_size", d.tile)),
            splitting=bool(get("do_image_splitting", d.splitting)),
            min_tiles=int(get("min_tiles", d.min_tiles)),
            max_tiles=int(get("max_tiles", d.max_tiles)),
            thumbnail=bool(get("use_thumbnail", d.thumbnail)),
            min_tokens=int(get("min_image_tokens", d.min_tokens)),
            max_tokens=int(get("max_image_tokens", d.max_tokens)),
            tolerance=float(get("max_pixels_tolerance", d.tolerance)), mode=_MODES[resample],
            rescale=float(get("rescale_factor", 1 / 255)) if get("do_rescale", True) else None,
            mean=tuple(get("image_mean", d.mean)) if get("do_normalize", True) else None,
            std=tuple(get("image_std", d.std)) if get("do_normalize", True) else None,
            convert_rgb=bool(get("do_convert_rgb", True)))
        if out.patch < 1 or out.factor < 1 or out.tile < out.patch * out.factor \
                or (out.tile // out.patch) % out.factor:
            raise ValueError(f"preprocessor_config.json tile_size={out.tile}: its "
                             f"{out.tile // max(out.patch, 1)} patches a side (encoder_patch_"
                             f"size {out.patch}) must be a positive multiple of "
                             f"downsample_factor {out.factor}")
        if out.splitting and not 1 <= out.min_tiles <= out.max_tiles:
            raise ValueError(f"preprocessor_config.json min_tiles={out.min_tiles}, max_tiles="
                             f"{out.max_tiles}: need 1 <= min_tiles <= max_tiles")
        return out

    def tokens(self, h: int, w: int) -> int:
        """Image tokens of a frame of ``h x w`` patches."""
        return (h // self.factor) * (w // self.factor)


def _round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


def smart_resize(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """HF's ``smart_resize``: the ``(h, w)`` pixels (multiples of ``patch * factor``) an
    untiled image or a thumbnail is resized to."""
    total = s.patch * s.factor
    low = s.min_tokens * s.patch ** 2 * s.factor ** 2
    high = s.max_tokens * s.patch ** 2 * s.factor ** 2
    h = max(total, _round_by(height, total))
    w = max(total, _round_by(width, total))
    if h * w > high:
        beta = math.sqrt((height * width) / high)
        h = max(total, math.floor(height / beta / total) * total)
        w = max(total, math.floor(width / beta / total) * total)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h = math.ceil(height * beta / total) * total
        w = math.ceil(width * beta / total) * total
    return h, w


@lru_cache(maxsize=64)
def _ratios(low: int, high: int) -> list[tuple[int, int]]:
    ratios = {(w, h) for n in range(low, high + 1) for w in range(1, n + 1)
              for h in range(1, n + 1) if low <= w * h <= high}
    return sorted(ratios, key=lambda r: r[0] * r[1])


def grid_of(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """HF's ``find_closest_aspect_ratio``: the ``(rows, cols)`` of tiles a large image is
    cut into."""
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for ratio in _ratios(s.min_tiles, s.max_tiles):
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * s.tile * s.tile * ratio[0] * ratio[1]:
            best = ratio
    return best[1], best[0]


def _patches(frame: torch.Tensor, s: ImageSettings) -> torch.Tensor:
    """A uint8 ``[3, H, W]`` frame rescaled and normalized as HF fuses them, as its ``[H / P *
    W / P, P * P * 3]`` patches (module doc)."""
    x = frame.to(torch.float32)
    if s.mean is not None and s.std is not None:
        mean = torch.tensor(s.mean, dtype=torch.float32)
        std = torch.tensor(s.std, dtype=torch.float32)
        if s.rescale is not None:
            mean, std = mean * (1.0 / s.rescale), std * (1.0 / s.rescale)
        x = (x - mean[:, None, None]) / std[:, None, None]
    elif s.rescale is not None:
        x = x * s.rescale
    c, height, width = x.shape
    p = s.patch
    x = x.reshape(c, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
    return x.reshape((height // p) * (width // p), p * p * c)


def preprocess(image: Any, s: ImageSettings
               ) -> tuple[torch.Tensor, list[tuple[int, int]], tuple[int, int]]:
    """One image -> ``(patches [sum h * w, P * P * 3] fp32, each frame's (h, w) patch grid,
    (rows, cols))``: the tiles row-major then the thumbnail, or the one resized image
    (``rows = cols = 1``; module doc)."""
    pixels = rgb_pixels(image, s.convert_rgb)
    height, width = int(pixels.shape[1]), int(pixels.shape[2])
    total = s.patch * s.factor
    rounded = max(s.patch, _round_by(height, total)) * max(s.patch, _round_by(width, total))
    large = rounded > s.max_tokens * s.patch ** 2 * s.factor ** 2 * s.tolerance
    splitting = s.splitting and not s.min_tiles == s.max_tiles == 1
    new = smart_resize(height, width, s)
    frames: list[torch.Tensor] = []
    rows = cols = 1
    if large and splitting:
        rows, cols = grid_of(height, width, s)
        whole = resize_uint8(pixels, (rows * s.tile, cols * s.tile), s.mode)
        tiles = whole.reshape(3, rows, s.tile, cols, s.tile).permute(1, 3, 0, 2, 4)
        frames.extend(tiles.reshape(rows * cols, 3, s.tile, s.tile))
        if rows * cols == 1:  # (HF then counts the smart-resized image's tokens: a mismatch)
            raise ValueError(f"multi_modal_data.image: a {height} x {width} image makes one "
                             f"{s.tile}-pixel tile, which HF's processor miscounts; set "
                             f"preprocessor_config.json min_tiles >= 2")
        if s.thumbnail:
            frames.append(resize_uint8(pixels, new, s.mode))
    else:
        frames.append(resize_uint8(pixels, new, s.mode))
    patches = torch.cat([_patches(frame, s) for frame in frames])
    shapes = [(int(f.shape[1]) // s.patch, int(f.shape[2]) // s.patch) for f in frames]
    return patches, shapes, (rows, cols)


class Lfm2VlInputProcessor(InputProcessor):
    """LFM2-VL's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.settings = ImageSettings()
        self._tags: dict[str, list[int]] = {}
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                                   f"(the {START} / {END} / tile tag ids)")
            return
        self.hf_tokenizer = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        settings = preprocessor_config(model_dir)
        if not settings:
            self.images_refused = (f"no image processor settings in {model_dir!r} "
                                   "(processor_config.json's image_processor section or "
                                   "preprocessor_config.json)")
            return
        try:
            self.settings = ImageSettings.of(settings)
            self._check(hf_config)
        except ValueError as why:  # (text prompts still run; images are refused)
            self.images_refused = str(why)
            return
        self.image_processor = self.settings  # (images are processed: see preprocess)

    def _check(self, hf_config: Any) -> None:
        s = self.settings
        patch = hf_config.vision_config.patch_size
        factor = getattr(hf_config, "downsample_factor", 2)
        if s.patch != patch or s.factor != factor:
            raise ValueError(f"preprocessor_config.json encoder_patch_size={s.patch} / "
                             f"downsample_factor={s.factor}, but config.json has vision_config."
                             f"patch_size={patch} / downsample_factor={factor}")
        hf = self.hf_tokenizer
        found = hf.convert_tokens_to_ids(getattr(hf, "image_token", None) or IMAGE)
        if found != self.image_token:
            raise ValueError(f"the tokenizer's {IMAGE} is id {found}, but config.json "
                             f"image_token_id is {self.image_token}")
        self.start, self.end = self.tag(START), self.tag(END)

    def tag(self, text: str) -> list[int]:
        """The token ids of a layout tag (``<|image_start|>``, ``<|img_row_1_col_2|>``...);
        ValueError naming the field where the tokenizer splits out an ``<image>``."""
        if text not in self._tags:
            ids = [int(t) for t in self.hf_tokenizer.encode(text, add_special_tokens=False)]
            if self.image_token in ids or not ids:
                raise ValueError(f"multi_modal_data.image: the tokenizer makes {ids} of {text}")
            self._tags[text] = ids
        return self._tags[text]

    def layout(self, shapes: list[tuple[int, int]], rows: int, cols: int) -> list[int]:
        """The token ids of an image (module doc)."""
        s, image = self.settings, self.image_token
        ids = list(self.start)
        if rows * cols > 1:
            for n in range(rows * cols):
                ids += self.tag(f"<|img_row_{n // cols + 1}_col_{n % cols + 1}|>")
                ids += [image] * s.tokens(*shapes[n])
            if len(shapes) > rows * cols:
                ids += self.tag(THUMBNAIL) + [image] * s.tokens(*shapes[-1])
        else:
            ids += [image] * s.tokens(*shapes[0])
        return ids + self.end

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<image>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                IMAGE)
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        done = [preprocess(image, self.settings) for image in images]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            patches, shapes, (rows, cols) = done[n]
            layout = self.layout(shapes, rows, cols)
            return layout, MultiModalItem(
                "image", {"patches": patches, "shapes": shapes, "token_ids": layout},
                content_hash(patches, shapes), offset, len(layout))

        return splice_placeholders(prompt_token_ids, places, expand)


class Lfm2VlModelState(EncoderCacheModelState):
    """The model state of ``Lfm2VlForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vc = hf_config.vision_config
        self.image_token = int(hf_config.image_token_id)
        self.patch = int(vc.patch_size)
        self.width = int(getattr(vc, "num_channels", 3)) * self.patch ** 2
        self.factor = int(getattr(hf_config, "downsample_factor", 2))

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """``patches [sum h * w, 3 * patch_size**2]`` of frames ``shapes`` (``(h, w)``
        multiples of ``downsample_factor``) and ``token_ids`` of ``item.length`` ids holding
        their ``sum h * w / f**2`` image tokens."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        patches, shapes, ids = data.get("patches"), data.get("shapes"), data.get("token_ids")
        f = self.factor
        ok = (isinstance(patches, torch.Tensor) and patches.dim() == 2
              and patches.shape[1] == self.width and isinstance(shapes, list) and shapes
              and all(isinstance(s, tuple) and len(s) == 2 and s[0] > 0 and s[1] > 0
                      and s[0] % f == 0 and s[1] % f == 0 for s in shapes)
              and patches.shape[0] == sum(h * w for h, w in shapes)
              and isinstance(ids, list) and len(ids) == item.length
              and ids.count(self.image_token) == sum(h * w // f // f for h, w in shapes))
        if not ok:
            raise ValueError(f"request {request.req_id!r}: an LFM2-VL image item needs "
                             f"'patches' [N, {self.width}], 'shapes' [(h, w), ...] (multiples "
                             f"of {f}, N = sum h * w) and 'token_ids' of its {item.length} ids "
                             f"with sum h * w / {f * f} image tokens")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The image's ``item.length`` rows: one run of the encoder over its frames at the
        ``<image>`` rows, the tags' text embeddings at the others."""
        model = cast(Any, self.model)
        features = model.embed_image(self.upload(cast(torch.Tensor, item.data["patches"])),
                                     item.data["shapes"])
        return self.splice_features(item.data["token_ids"], features, self.image_token)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over the largest image (``max_tiles`` tiles of ``tile_size`` and a
        thumbnail of ``max_image_tokens``; fewer tiles where they would not fit in
        ``max_prompt_tokens``), random patches, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        try:
            s = ImageSettings.of(preprocessor_config(self.config.model.model))
        except ValueError:  # (images are refused by the input processor)
            return self.encoder_cache_bytes
        side = s.tile // s.patch
        thumb = (s.factor, s.factor * s.max_tokens)  # (max_image_tokens, in one row)
        tiles = s.max_tiles if s.splitting else 0
        while tiles and (tiles * (s.tokens(side, side) + 8) + s.max_tokens
                         > max_prompt_tokens):
            tiles -= 1
        shapes = [(side, side)] * tiles + [thumb]
        if s.max_tokens + 2 <= max_prompt_tokens:
            count = sum(h * w for h, w in shapes)
            patches = torch.randn(count, self.width, device=self.device)
            cast(Any, self.model).embed_image(patches, shapes)
        return self.encoder_cache_bytes
