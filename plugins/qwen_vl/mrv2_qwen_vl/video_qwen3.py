"""Qwen3-VL (and Qwen3-VL-MoE) videos: frame groups separated by timestamp text, as HF
transformers 5.17's ``Qwen3VLProcessor`` and ``Qwen3VLVideoProcessor`` build them.

A clip (decoded frames, :mod:`mrv2_qwen_vl.video`) is taken as the sampled frames themselves:
frame ``i`` sits at index ``i`` of a clip sampled at its ``fps`` (default 2.0, as for
Qwen2.5-VL; HF's processor takes 24 for frames without metadata). Its settings come from the
checkpoint's video processor config (``processor_config.json``'s ``video_processor`` section,
else ``video_preprocessor_config.json``, else ``preprocessor_config.json``: HF's order), with
``Qwen3VLVideoProcessor``'s defaults:

- **Resize**: the whole clip at once, ``smart_resize(T, H, W)`` of HF's video processor (a
  pixel budget ``size.shortest_edge .. size.longest_edge`` over ``T x H x W``, sides multiples
  of ``patch_size * merge_size``; ``cap_pixels_per_frame`` when the config sets it), bicubic
  with antialiasing on float frames, rounded back to uint8 (torchvision's tensor path; its
  native uint8 kernel on AVX2 CPUs may differ by a unit). A clip needs at least
  ``temporal_patch_size`` frames (HF's ``smart_resize`` refuses fewer) and at most
  ``max_frames`` (HF samples down to it; frames given here are never dropped).
- **Rows**: the image processor without its resize, with the video config's rescale and
  normalization, grouped ``temporal_patch_size`` frames at a time (the last frame repeated).
- **Prompt**: the ``<|video_pad|>`` placeholder becomes, per frame group ``k``, the tokens of
  ``f"<{t_k:.1f} seconds>"`` (the checkpoint's tokenizer, no special tokens), then
  ``<|vision_start|>``, the group's ``h' * w'`` video tokens and ``<|vision_end|>``
  (``Qwen3VLProcessor.replace_video_token``: the prompt's own vision start / end around the
  placeholder stay). ``t_k`` is the mean of the group's first and last frame times
  ``index / fps`` (``_calculate_timestamps``).
- **Items**: each frame group is its own item (kind ``"video"``, grid ``(1, h, w)``): HF's
  ``get_rope_index`` splits a video's grid into frame groups of ``t = 1``, each placed like an
  image, with the timestamp text between them as text; the tower attends within a frame group
  only, so a group's embedding (and deepstack features) alone equal those of the whole clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.contract.video_inputs import VideoClip
from mrv2_qwen_vl.video import (
    check_video_layout,
    resized_uint8,
    video_patches,
    video_settings_fields,
)

__all__ = ["QWEN3_VIDEO_FAMILIES", "Qwen3VideoSettings", "frame_group_times",
           "qwen3_table_slots", "qwen3_video_groups", "resize_clip"]

#: The ``model_type`` s whose videos take timestamp text.
QWEN3_VIDEO_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class Qwen3VideoSettings:
    """The video processor settings this path reads (``Qwen3VLVideoProcessor`` defaults)."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def load(cls, model_dir: str | Path | None) -> Qwen3VideoSettings:
        """The checkpoint's settings (module doc: HF's file order), defaults where absent."""
        default = cls()
        common, fields = video_settings_fields(model_dir, default, pixels_over_size=False)
        return cls(**common, max_frames=int(fields.get("max_frames") or default.max_frames))


def resize_clip(frames: np.ndarray, settings: Qwen3VideoSettings, where: str) -> np.ndarray:
    """``[T, H', W', 3]`` uint8: the clip resized as a whole (module doc); the same array
    where ``smart_resize`` keeps its size. ValueError naming ``where`` for too few or too
    many frames or an aspect ratio ``smart_resize`` refuses."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    num_frames, height, width = (int(v) for v in frames.shape[:3])
    temporal = settings.temporal_patch_size
    if not temporal <= num_frames <= settings.max_frames:
        raise ValueError(f"{where}: a Qwen3-VL clip needs {temporal} to {settings.max_frames} "
                         f"frames (temporal_patch_size .. max_frames), got {num_frames}")
    factor = settings.patch_size * settings.merge_size
    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:  # (HF's Qwen3VLVideoProcessor.resize)
        per_frame = max(min(settings.max_video_tokens * factor * factor,
                            settings.max_pixels // num_frames), int(settings.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    try:
        new_h, new_w = smart_resize(num_frames, height, width, temporal_factor=temporal,
                                    factor=factor, min_pixels=settings.min_pixels,
                                    max_pixels=max_pixels)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    return resized_uint8(frames, new_h, new_w)


def frame_group_times(num_frames: int, fps: float, temporal: int) -> list[float]:
    """Seconds of each frame group: frame indices ``0 .. num_frames - 1`` (the last repeated
    to a multiple of ``temporal``) over ``fps``, the mean of each group's first and last
    (HF's ``Qwen3VLProcessor._calculate_timestamps``)."""
    indices = list(range(num_frames))
    indices += [indices[-1]] * (-num_frames % temporal)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


@dataclass(frozen=True)
class VideoGroup:
    """One frame group of a Qwen3-VL video: its patch ``rows``, merged-before grid ``(1, h,
    w)`` and the tokens of its timestamp text."""

    rows: torch.Tensor
    grid: tuple[int, int, int]
    timestamp_ids: list[int]


def qwen3_video_groups(image_processor: Any, tokenizer: Any, clip: VideoClip,
                       settings: Qwen3VideoSettings, where: str) -> list[VideoGroup]:
    """The frame groups of one clip (module doc): resized, through the image processor
    (without its resize; the video config's normalization), cut per group, each with its
    timestamp's tokens."""
    check_video_layout(image_processor, settings, where)
    frames = resize_clip(clip.frames, settings, where)
    rows, (t, h, w) = video_patches(
        image_processor, VideoClip(frames, clip.fps), where, do_resize=False,
        image_mean=list(settings.image_mean), image_std=list(settings.image_std),
        rescale_factor=settings.rescale_factor)
    times = frame_group_times(len(frames), clip.fps, settings.temporal_patch_size)
    per_group = h * w
    return [VideoGroup(rows[k * per_group: (k + 1) * per_group].contiguous(), (1, h, w),
                       list(tokenizer.encode(f"<{times[k]:.1f} seconds>",
                                             add_special_tokens=False)))
            for k in range(t)]


def qwen3_table_slots(model_dir: str | None, limit_per_prompt: int) -> int:
    """M-RoPE table slots a Qwen3-VL request may need: every image or video of the prompt
    (``limit_per_prompt``) a video of ``max_frames`` frames, one slot per frame group."""
    settings = Qwen3VideoSettings.load(model_dir)
    groups = math.ceil(settings.max_frames / settings.temporal_patch_size)
    return max(1, limit_per_prompt) * max(1, groups)
