"""LLaVA-NeXT's vision-language checkpoints (``LlavaNextForConditionalGeneration``: LLaVA-1.6 in
transformers' format) in the mrv2 model contract: LLaVA's decoder, tower and projector
(:mod:`mrv2_llava.model`, :mod:`mrv2_llava.clip`) with "anyres" images (numerically HF's
``get_image_features`` / ``pack_image_features``, transformers 5.17).

Layout of one image
-------------------
The image processor picks the best of ``image_grid_pinpoints`` for the image's real
``(h, w)`` (:func:`best_resolution`: the most of the image kept, then the least padding), cuts
the image resized and padded to it into ``rows x cols`` tiles of the tower's ``S x S`` and
puts a thumbnail (the whole image at ``S x S``) in front: ``rows * cols + 1`` tiles. Each tile
goes through the tower and the projector to ``g x g`` features (``g = S / patch_size``; the
CLS token dropped: ``vision_feature_select_strategy`` must leave ``g * g`` tokens a tile, as
HF's reshape needs). The image's tokens are the thumbnail's ``g * g`` features, then the
tiles' features laid out as one ``rows*g x cols*g`` grid, cropped to the image's aspect ratio
(:func:`unpadded_grid`: the padding rows or columns the resize left, centred) with the learned
``image_newline`` after each row of it, row-major: ``g*g + H * (W + 1)`` tokens in all
(:func:`image_token_count`), as HF's ``LlavaNextProcessor`` counts them.

Checkpoints load as LLaVA's do, plus ``model.image_newline`` / ``image_newline``
(``[text hidden_size]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from mrv2.layers import CausalLM
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_name
from mrv2_llava.clip import VISION_CHECKPOINT_PREFIXES, LlavaVisionEncoder
from mrv2_llava.model import build_decoder, text_config

__all__ = ["ARCHITECTURE", "NEXT_CHECKPOINT_PREFIXES", "LlavaNextForConditionalGeneration",
           "LlavaNextVisionEncoder", "best_resolution", "image_token_count", "patch_side",
           "tile_grid", "unpadded_grid"]

ARCHITECTURE = "LlavaNextForConditionalGeneration"

_NEWLINE = ("model.image_newline", "image_newline")
#: LLaVA's encoder prefixes and the ``image_newline`` tensor's names.
NEXT_CHECKPOINT_PREFIXES: tuple[str, ...] = (*VISION_CHECKPOINT_PREFIXES, *_NEWLINE)


def best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]
                    ) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` an image of real ``size = (h, w)`` is resized
    and padded to: the one that keeps the most of the image's pixels (after an aspect-keeping
    downscale to fit), ties to the one with the least padding, first listed on a full tie."""
    h, w = size
    best, kept_best, waste_best = (0, 0), 0, float("inf")
    for ph, pw in ((int(p[0]), int(p[1])) for p in pinpoints):
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - kept
        if kept > kept_best or (kept == kept_best and waste < waste_best):
            best, kept_best, waste_best = (ph, pw), kept, waste
    return best


def tile_grid(size: tuple[int, int], pinpoints: Sequence[Sequence[int]], tile: int
              ) -> tuple[int, int]:
    """``(rows, cols)`` of ``tile``-pixel tiles the image of real ``size`` is cut into."""
    ph, pw = best_resolution(size, pinpoints)
    return ph // tile, pw // tile


def unpadded_grid(size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(top, height, left, width)`` of the part of a ``grid = (H, W)`` feature grid that the
    image of real ``size = (h, w)`` covers: the resize fitted one side, the other was padded
    evenly; HF's ``unpad_image`` arithmetic (the scaled side rounded to 7 decimals, then
    truncated; the padding halved down on each end)."""
    h, w = size
    rows, cols = grid
    if w / h > cols / rows:  # (wider than the grid: padded above and below)
        kept = int(round(h * (cols / w), 7))
        pad = (rows - kept) // 2
        return pad, rows - 2 * pad, 0, cols
    kept = int(round(w * (rows / h), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - 2 * pad


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def patch_side(config: Any) -> int:
    """``g``: patches a side of one tile (``image_size / patch_size``)."""
    return _side(config.vision_config.image_size) // _side(config.vision_config.patch_size)


def image_token_count(config: Any, size: tuple[int, int]) -> int:
    """Tokens of an image of real ``size = (h, w)`` (module doc): ``g*g + H * (W + 1)``."""
    g = patch_side(config)
    tile = _side(config.vision_config.image_size)
    rows, cols = tile_grid(size, config.image_grid_pinpoints, tile)
    _, height, _, width = unpadded_grid(size, (rows * g, cols * g))
    return g * g + height * (width + 1)


class LlavaNextVisionEncoder(LlavaVisionEncoder):
    """LLaVA's encoder (:class:`~mrv2_llava.clip.LlavaVisionEncoder`) and ``image_newline``:
    one image's tiles -> its tokens (module doc). ValueError naming the field for a config
    whose tiles do not give ``g * g`` tokens, or without ``image_grid_pinpoints``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.grid = patch_side(config)
        if self.tokens_per_image != self.grid ** 2:
            raise ValueError(f"vision_feature_select_strategy="
                             f"{config.vision_feature_select_strategy!r} leaves "
                             f"{self.tokens_per_image} tokens a tile; LLaVA-NeXT lays out "
                             f"{self.grid}x{self.grid} (CLIP: 'default', SigLIP: 'full')")
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        if not pinpoints or any(len(p) != 2 or int(p[0]) % self.image_size
                                or int(p[1]) % self.image_size for p in pinpoints):
            raise ValueError(f"image_grid_pinpoints={pinpoints!r}: must list (height, width) "
                             f"pairs, multiples of vision_config.image_size {self.image_size}")
        self.pinpoints = [(int(p[0]), int(p[1])) for p in pinpoints]
        self.image_newline = nn.Parameter(torch.zeros(int(config.text_config.hidden_size)))

    def embed(self, pixel_values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tiles ``[rows * cols + 1, C, S, S]`` (thumbnail first) and its real
        ``(h, w)`` -> its ``image_token_count`` tokens ``[tokens, text_hidden]``."""
        rows, cols = tile_grid(size, self.pinpoints, self.image_size)
        if pixel_values.dim() != 4 or pixel_values.shape[0] != rows * cols + 1:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: an image of {size} "
                             f"has {rows * cols + 1} tiles")
        features = self(pixel_values)  # [tiles, g*g, D]
        g, dim = self.grid, features.shape[-1]
        grid = features[1:].view(rows, cols, g, g, dim).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * g, cols * g, dim)
        top, height, left, width = unpadded_grid(size, (rows * g, cols * g))
        grid = grid[top:top + height, left:left + width]
        newline = self.image_newline.to(grid.dtype).expand(height, 1, dim)
        rows_out = torch.cat([grid, newline], dim=1).reshape(height * (width + 1), dim)
        return torch.cat([features[0], rows_out], dim=0)

    def _parameter_name(self, ckpt_name: str) -> str | None:
        if ckpt_name in _NEWLINE:
            return "image_newline"
        return super()._parameter_name(ckpt_name)


class LlavaNextForConditionalGeneration(CausalLM):
    """LLaVA-NeXT: LLaVA's text decoder and the anyres image encoder (``vision``; module
    doc). ``config`` is the composite ``LlavaNextConfig``; ``self.config`` its
    ``text_config``."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        super().__init__(*build_decoder(text_config(config, ARCHITECTURE)))
        self.hf_config = config
        self.vision = LlavaNextVisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tiles and real ``(h, w)`` -> its tokens ``[tokens, hidden_size]`` in the
        model dtype."""
        return self.vision.embed(pixel_values, size).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: an image-encoder tensor)."""
        if name.startswith(NEXT_CHECKPOINT_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through its loader, the encoder's (tower, projector,
        ``image_newline``) through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision,
                                     NEXT_CHECKPOINT_PREFIXES, weights, "vision")
