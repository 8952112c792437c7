"""Gemma 4's videos: decoded frames into the vision tower's patch rows, one item per frame, as
transformers 5.17's ``Gemma4Processor`` / ``Gemma4VideoProcessor`` build them.

**Clips** (``multi_modal_data["video"]``, read by :mod:`mrv2.contract.video_inputs`; no file
decoding here): sampled at :data:`DEFAULT_FPS` where a clip names no rate (24, HF's default
for frames without metadata). Every frame given is used (HF's processor with
``do_sample_frames=False``).

**Frames.** The clip is resized as a whole to HF's ``get_aspect_ratio_preserving_size`` of the
video settings (the largest size of at most ``max_soft_tokens * pooling_kernel_size**2``
patches, sides multiples of ``pooling_kernel_size * patch_size``; bicubic with antialias in
plain torch, as torchvision's tensor resize; kept as it is where the size already fits), then
rescaled and normalized (fused as HF fuses them) and cut into ``patch_size`` patches (rows of
``P * P * C``, row-major over the patch grid) with ``(x, y)`` positions: HF's
``pixel_values_videos`` / ``video_position_ids`` per frame without the padding. HF runs each
frame through the vision tower alone, as an image, so each frame is an item of kind
``"video"`` that the image encoder embeds.

**Settings** (:class:`Gemma4VideoSettings`): where
:func:`~mrv2.contract.video_inputs.video_processor_settings` finds them (HF's order), over
``Gemma4VideoProcessor``'s defaults (patches of 16, 70 soft tokens, pooling 3, rescale 1/255,
identity normalization).

**Prompt text** (:func:`frame_prefixes`): HF's ``replace_video_token`` writes frame ``i`` as
its timestamp ``i / fps`` seconds in ``mm:ss``, a space, ``<boi>``, its video tokens,
``<eoi>``, the frames joined by spaces. The timestamps are text, tokenized here by the
checkpoint's tokenizer one stretch at a time (``"00:00 "``, then ``" 00:01 "``, ...: the
stretches between special tokens, as HF's tokenizer sees them; the first as if the placeholder
followed a token boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrv2.contract.video_inputs import VideoClip, video_processor_settings

__all__ = ["DEFAULT_FPS", "Gemma4VideoSettings", "frame_patches", "frame_prefixes",
           "soft_tokens", "target_size", "timestamp"]

#: The ``max_soft_tokens`` HF 5.17's Gemma 4 processors take (pooled patches a frame).
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)

#: The frame rate a clip is taken to be sampled at when it names none (HF 5.17's
#: ``Gemma4Processor.replace_video_token`` default).
DEFAULT_FPS = 24.0


@dataclass(frozen=True)
class Gemma4VideoSettings:
    """The checkpoint's video processor settings (module doc), ``Gemma4VideoProcessor``'s
    defaults where a field is missing."""

    patch_size: int = 16
    max_soft_tokens: int = 70
    pooling_kernel_size: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @classmethod
    def load(cls, model_dir: str | Path | None) -> Gemma4VideoSettings:
        """The settings of ``model_dir`` (module doc); the defaults for None."""
        found = video_processor_settings(model_dir)
        base = cls()
        soft = int(found.get("max_soft_tokens") or base.max_soft_tokens)
        if soft not in SUPPORTED_SOFT_TOKENS:  # (HF's video processor refuses it alike)
            raise ValueError(f"the video processor config's max_soft_tokens must be one of "
                             f"{SUPPORTED_SOFT_TOKENS}, got {soft}")
        return cls(
            patch_size=int(found.get("patch_size") or base.patch_size),
            max_soft_tokens=soft,
            pooling_kernel_size=int(found.get("pooling_kernel_size")
                                    or base.pooling_kernel_size),
            do_resize=bool(found.get("do_resize", base.do_resize)),
            do_rescale=bool(found.get("do_rescale", base.do_rescale)),
            rescale_factor=float(found.get("rescale_factor", base.rescale_factor)),
            do_normalize=bool(found.get("do_normalize", base.do_normalize)),
            image_mean=_triple(found.get("image_mean", base.image_mean)),
            image_std=_triple(found.get("image_std", base.image_std)))


def _triple(value: Any) -> tuple[float, ...]:
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
    return tuple(values * 3) if len(values) == 1 else tuple(values)


# -- frames -> patch rows ---------------------------------------------------------------------

def target_size(height: int, width: int, settings: Gemma4VideoSettings, where: str
                ) -> tuple[int, int]:
    """HF's ``get_aspect_ratio_preserving_size`` for the video settings; ValueError naming
    ``where`` where HF's raises (a frame too thin to keep one patch block)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        get_aspect_ratio_preserving_size,
    )

    pool = settings.pooling_kernel_size
    try:
        return get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=settings.patch_size,
            max_patches=settings.max_soft_tokens * pool * pool, pooling_kernel_size=pool)
    except ValueError as error:
        raise ValueError(f"{where}: frames of {height} x {width} can't be resized: "
                         f"{error}") from error


def frame_patches(clip: VideoClip, settings: Gemma4VideoSettings, where: str
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each frame's ``(pixel rows [patches, P * P * 3] float32, positions [patches, 2])``
    (module doc; no padding rows)."""
    frames = torch.from_numpy(clip.frames).permute(0, 3, 1, 2)  # [T, 3, H, W] uint8
    height, width = int(frames.shape[2]), int(frames.shape[3])
    if settings.do_resize:
        new_h, new_w = target_size(height, width, settings, where)
        if (new_h, new_w) != (height, width):
            video = torch.nn.functional.interpolate(
                frames.to(torch.float32), size=(new_h, new_w), mode="bicubic",
                align_corners=False, antialias=True)
            frames = video.clamp_(0, 255).round_().to(torch.uint8)
            height, width = new_h, new_w
    p = settings.patch_size
    side = p * settings.pooling_kernel_size
    if height % side or width % side:
        raise ValueError(f"{where}: frames of {height} x {width} are not a multiple of "
                         f"pooling_kernel_size * patch_size = {side} (do_resize is off)")
    video = frames.to(torch.float32)
    if settings.do_normalize:  # (HF's fused rescale and normalize: mean and std over the factor)
        mean, std = torch.tensor(settings.image_mean), torch.tensor(settings.image_std)
        if settings.do_rescale:
            inverse = 1.0 / settings.rescale_factor
            mean, std = mean * inverse, std * inverse
        video = (video - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    elif settings.do_rescale:
        video = video * settings.rescale_factor
    t, c = int(video.shape[0]), int(video.shape[1])
    ph, pw = height // p, width // p
    rows = video.reshape(t, c, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1).reshape(t, ph * pw, -1)
    grid = torch.stack(torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy"),
                       dim=-1).reshape(ph * pw, 2)
    return [(rows[i].contiguous(), grid.clone()) for i in range(t)]


def timestamp(seconds: float) -> str:
    """HF's ``mm:ss`` of a frame's time."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def frame_prefixes(num_frames: int, fps: float) -> list[str]:
    """The text before each frame's ``<boi>`` (module doc): ``"mm:ss "`` for the first frame,
    ``" mm:ss "`` after a frame's ``<eoi>``; frame ``i`` at ``i / fps`` seconds."""
    return [("" if i == 0 else " ") + timestamp(i / fps) + " " for i in range(num_frames)]


def soft_tokens(patches: int, settings: Gemma4VideoSettings) -> int:
    """A frame's soft tokens: its patches pooled ``pooling_kernel_size**2`` to one."""
    return patches // settings.pooling_kernel_size ** 2
