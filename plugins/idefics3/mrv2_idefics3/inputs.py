"""Idefics3's and SmolVLM's images: the input processor (prompt expansion, the checkpoint's
image processor) and the model state (the encoder cache, each step's image rows).

**Images.** The checkpoint's image processor (``preprocessor_config.json``: HF's
``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``, its PIL backend where torchvision is
absent) resizes each image so its longest edge is ``size.longest_edge``; with
``do_image_splitting`` it then rounds both sides up to multiples of the tile side ``M =
max_image_size.longest_edge`` and cuts ``rows x cols`` tiles of ``M x M`` (row-major) plus the
whole image resized to ``M x M`` (the global image) last, or, where the rounded image is one
tile, keeps just that (``rows = cols = 0``); without splitting each image is resized to
``M x M``. Every frame is a full ``M x M`` square, so HF's ``pixel_attention_mask`` is all
ones (a processor that pads a frame is refused, naming the field). Each image's ``[tiles, 3,
M, M]`` pixels and its ``(rows, cols)`` make the content hash. (HF's model also drops any
frame whose pixels are all exactly 0.0, taking it for batch padding; a normalized image's
tiles never are, and the engine keeps every tile.)

**Prompts.** A prompt carries one ``<image>`` (``config.image_token_id``) per image where the
chat template puts it, as HF's ``Idefics3Processor`` / ``SmolVLMProcessor`` take it. Each is
expanded as they expand it: for a split image, per tile row ``r`` and column ``c``
``<fake_token_around_image><row_r_col_c>`` then ``image_seq_len`` ``<image>`` tokens, a
``\\n`` after each row, then ``\\n<fake_token_around_image><global-img>``, ``image_seq_len``
``<image>`` tokens and ``<fake_token_around_image>``; an unsplit image is only the global
part, ``<fake_token_around_image><global-img>`` ``<image>`` x ``image_seq_len``
``<fake_token_around_image>``. The layout text is tokenized by the checkpoint's tokenizer
(the ``<row_r_col_c>`` tags, ``<global-img>`` and the newlines are whatever ids it gives them,
as in HF, where the whole prompt is tokenized after the expansion: the layout starts and ends
with the special ``<fake_token_around_image>``, so its ids do not depend on the text around
it). ``image_seq_len = (M // patch_size)**2 / scale_factor**2`` (64 for SmolVLM-256M's
512-pixel tiles, 169 for Idefics3-8B's 364-pixel ones); a ``processor_config.json`` that
says otherwise is refused naming it. The whole
expansion is the image's :class:`~mrv2.contract.requests.MultiModalItem`; attention stays
causal, so a step may split it.

**Video** (SmolVLM2's ``<video>``) is not supported: ``multi_modal_data.video`` and prompts
holding the tokenizer's ``<video>`` token beside images are refused naming the field (chat
video parts are refused by the core's chat media).

**Each step** (:class:`Idefics3ModelState`): an image's rows come from the core's encoder
cache (:class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`): one run of the encoder
over the image's tiles, its features at the ``<image>`` rows (tile by tile, in order, as HF
scatters them) and the text embeddings of the layout tokens at the others.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
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
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2_idefics3.vision import square, tokens_per_tile

__all__ = ["Idefics3InputProcessor", "Idefics3ModelState", "image_prompt", "layout_length"]

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TOKEN = "<global-img>"
VIDEO_TOKEN = "<video>"
_VIDEO_NOTE = " (video input is not supported for Idefics3 / SmolVLM: images only)"


def image_prompt(rows: int, cols: int, seq: int, fake: str = FAKE_TOKEN,
                 image: str = IMAGE_TOKEN, global_image: str = GLOBAL_TOKEN) -> str:
    """The text HF's processors put in place of an image's ``<image>`` (module doc): ``rows x
    cols`` tiles (``0 x 0``: unsplit) of ``seq`` image tokens each, and the global image."""
    whole = f"{fake}{global_image}{image * seq}{fake}"
    if rows == 0 and cols == 0:
        return whole
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{fake}<row_{r + 1}_col_{c + 1}>{image * seq}"
        text += "\n"
    return text + "\n" + whole


def layout_length(rows: int, cols: int, seq: int) -> int:
    """At most how many tokens :func:`image_prompt` ``(rows, cols, seq)`` takes (each tag and
    newline one token, ``\\n\\n`` two: a bound for sizing, not the count)."""
    whole = seq + 3
    return whole if rows == 0 and cols == 0 else whole + rows * (cols * (seq + 2) + 1) + 1


def _read_json(model_dir: str, name: str) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_dir) / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _longest(value: Any) -> int | None:
    """``{"longest_edge": N}`` -> ``N`` (None for anything else)."""
    try:
        edge = value["longest_edge"]
    except (KeyError, TypeError, IndexError):
        return None
    return edge if isinstance(edge, int) and not isinstance(edge, bool) and edge > 0 else None


class Idefics3InputProcessor(InputProcessor):
    """Idefics3's and SmolVLM's :class:`~mrv2.contract.input_processor.InputProcessor`
    (module doc). :attr:`tile` is the tile side ``M``, :attr:`image_seq_len` the image tokens
    of a tile (both 0 where images are refused)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.patch = square("vision_config.patch_size", hf_config.vision_config.patch_size)
        self.scale = int(getattr(hf_config, "scale_factor", 2))
        self.tile = self.image_seq_len = 0
        self.video_token: int | None = None
        self._layouts: dict[tuple[int, int], list[int]] = {}
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                                   f"(the {FAKE_TOKEN} / <row_r_col_c> / {GLOBAL_TOKEN} ids)")
            return
        hf = self.hf_tokenizer = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        # (SmolVLM's processor reads these names off the tokenizer where it has them)
        self.fake = str(getattr(hf, "fake_image_token", None) or FAKE_TOKEN)
        self.image = str(getattr(hf, "image_token", None) or IMAGE_TOKEN)
        self.global_image = str(getattr(hf, "global_image_token", None) or GLOBAL_TOKEN)
        unknown = getattr(hf, "unk_token_id", None)

        def token_id(token: str) -> int | None:
            found = hf.convert_tokens_to_ids(token)
            return found if isinstance(found, int) and found != unknown else None

        self.fake_id = token_id(self.fake)
        self.video_token = token_id(str(getattr(hf, "video_token", None) or VIDEO_TOKEN))
        if token_id(self.image) != self.image_token:
            self.images_refused = (f"the tokenizer's {self.image} is id {token_id(self.image)}, "
                                   f"but config.json image_token_id is {self.image_token}")
            return
        if self.fake_id is None:
            self.images_refused = f"the tokenizer has no {self.fake} token"
            return
        default = ("SmolVLMImageProcessor" if getattr(hf_config, "model_type", "") == "smolvlm"
                   else "Idefics3ImageProcessor")
        self.load_images(model_dir, default)
        if self.image_processor is not None:
            self._check_tiles(model_dir)

    def _check_tiles(self, model_dir: str) -> None:
        """Set :attr:`tile` and :attr:`image_seq_len` from the image processor, or refuse
        images (:attr:`images_refused`, naming the file and field) where they do not fit the
        model."""
        tile = _longest(getattr(self.image_processor, "max_image_size", None))
        seq = _read_json(model_dir, "processor_config.json").get("image_seq_len")
        try:
            if tile is None:
                raise ValueError("preprocessor_config.json max_image_size: expected "
                                 "{'longest_edge': N}, got "
                                 f"{getattr(self.image_processor, 'max_image_size', None)!r}")
            try:
                per_tile = tokens_per_tile(tile, self.patch, self.scale)
            except ValueError as error:
                raise ValueError("preprocessor_config.json max_image_size.longest_edge: "
                                 f"{error}") from None
            if seq is not None and seq != per_tile:
                raise ValueError(f"processor_config.json image_seq_len={seq!r}, but tiles of "
                                 f"{tile} pixels (max_image_size) give {per_tile} image tokens "
                                 f"(patch_size {self.patch}, scale_factor {self.scale})")
        except ValueError as why:  # (text prompts still run; images are refused)
            self.image_processor, self.images_refused = None, str(why)
            return
        self.tile, self.image_seq_len = tile, per_tile

    def layout(self, rows: int, cols: int) -> list[int]:
        """The token ids of an image of ``rows x cols`` tiles (``0 x 0``: unsplit) as HF's
        processor makes them (:func:`image_prompt` through the tokenizer); ValueError naming
        the field where the tokenizer does not keep the image tokens whole."""
        key = (rows, cols)
        if key not in self._layouts:
            text = image_prompt(rows, cols, 1, self.fake, self.image, self.global_image)
            ids = [int(t) for t in self.hf_tokenizer.encode(text, add_special_tokens=False)]
            tiles = rows * cols + 1 if rows or cols else 1
            if ids.count(self.image_token) != tiles or ids[0] != self.fake_id \
                    or ids[-1] != self.fake_id:
                raise ValueError(f"multi_modal_data.image: the tokenizer does not keep "
                                 f"{self.fake} and {self.image} as single tokens")
            out: list[int] = []
            for t in ids:
                out.extend([t] * self.image_seq_len if t == self.image_token else [t])
            self._layouts[key] = out
        return self._layouts[key]

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the ``<image>`` placeholders and make the images' items (module doc);
        ValueError naming the field for bad input."""
        images, places = self.images_and_places(prompt_token_ids, mm_data, self.image_token,
                                                IMAGE_TOKEN, note=_VIDEO_NOTE)
        if not images:
            return list(prompt_token_ids), []
        self.require_images()
        if self.video_token is not None and self.video_token in prompt_token_ids:
            raise ValueError(f"multi_modal_data: the prompt holds {VIDEO_TOKEN} (token "
                             f"{self.video_token}){_VIDEO_NOTE}")
        out = run_image_processor(self.image_processor, [images], return_row_col_info=True)
        pixels = cast(torch.Tensor, out["pixel_values"])[0]
        mask = out.get("pixel_attention_mask")
        if tuple(pixels.shape[-2:]) != (self.tile, self.tile) or (
                mask is not None and not bool(torch.as_tensor(mask).all())):
            raise ValueError(f"multi_modal_data.image: the image processor made padded or "
                             f"{tuple(pixels.shape[-2:])} frames; the model takes full "
                             f"{self.tile} x {self.tile} tiles (check preprocessor_config.json)")
        grids = [(int(out["rows"][0][n]), int(out["cols"][0][n])) for n in range(len(places))]
        frames = [rows * cols + 1 if rows or cols else 1 for rows, cols in grids]
        firsts = list(accumulate(frames, initial=0))  # image n's: firsts[n]..firsts[n + 1]

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            image = pixels[firsts[n]:firsts[n + 1]].contiguous()
            layout = self.layout(*grids[n])
            return layout, MultiModalItem(
                "image", {"pixel_values": image, "token_ids": layout},
                content_hash(image, grids[n]), offset, len(layout))

        return splice_placeholders(prompt_token_ids, places, expand)


class Idefics3ModelState(EncoderCacheModelState):
    """The model state of ``Idefics3ForConditionalGeneration`` and
    ``SmolVLMForConditionalGeneration`` (module doc)."""

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vc = hf_config.vision_config
        self.image_token = int(hf_config.image_token_id)
        self.patch = square("vision_config.patch_size", vc.patch_size)
        self.image_size = square("vision_config.image_size", vc.image_size)
        self.scale = int(getattr(hf_config, "scale_factor", 2))
        self.channels = int(getattr(vc, "num_channels", 3))

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image of ``[tiles, C, S, S]`` pixels (``S // patch_size`` a multiple of
        ``scale_factor``) and ``token_ids`` of ``item.length`` ids holding ``tiles *
        tokens_per_tile(S)`` image tokens."""
        super().check_item(request, item)
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, ids = data.get("pixel_values"), data.get("token_ids")
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and pixels.shape[0] >= 1
                and pixels.shape[1] == self.channels and pixels.shape[2] == pixels.shape[3]
                and pixels.shape[2] >= self.patch * self.scale
                and (pixels.shape[2] // self.patch) % self.scale == 0):
            raise ValueError(f"request {request.req_id!r}: an image needs pixel_values "
                             f"[tiles, {self.channels}, S, S] with S // {self.patch} a multiple "
                             f"of {self.scale}")
        want = pixels.shape[0] * tokens_per_tile(pixels.shape[2], self.patch, self.scale)
        if not (isinstance(ids, list) and len(ids) == item.length
                and ids.count(self.image_token) == want):
            raise ValueError(f"request {request.req_id!r}: an image of {pixels.shape[0]} tiles "
                             f"needs token_ids of its {item.length} tokens holding {want} "
                             f"image tokens")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The image's ``item.length`` rows: one run of the encoder over its tiles at the
        ``<image>`` rows, the layout tokens' text embeddings at the others."""
        model = cast(Any, self.model)
        features = model.embed_image(self.upload(cast(torch.Tensor,
                                                      item.data["pixel_values"])))
        return self.splice_features(item.data["token_ids"], features, self.image_token)

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoder over the most tiles one image may have (``ceil(size.longest_edge /
        max_image_size.longest_edge)`` per side, squared, plus the global image, from
        ``preprocessor_config.json``: 17 with HF's defaults; fewer where the layout would not
        fit in ``max_prompt_tokens``), random pixels, output dropped; returns
        :attr:`encoder_cache_bytes`."""
        settings = preprocessor_config(self.config.model.model)
        tile = _longest(settings.get("max_image_size")) or self.image_size
        try:
            seq = tokens_per_tile(tile, self.patch, self.scale)
        except ValueError:  # (images are refused by the input processor)
            return self.encoder_cache_bytes
        side = 1
        if settings.get("do_image_splitting", True):
            side = math.ceil((_longest(settings.get("size")) or 4 * tile) / tile)
        while side > 1 and layout_length(side, side, seq) > max_prompt_tokens:
            side -= 1
        tiles = side * side + 1 if side > 1 else 1
        if layout_length(0, 0, seq) <= max_prompt_tokens:
            pixels = torch.randn(tiles, self.channels, tile, tile, device=self.device)
            cast(Any, self.model).embed_image(pixels)
        return self.encoder_cache_bytes
