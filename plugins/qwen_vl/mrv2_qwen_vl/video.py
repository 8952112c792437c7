"""Qwen2-VL / Qwen2.5-VL videos: decoded frames into the vision tower's patch rows.

A video is a decoded clip (:mod:`mrv2.contract.video_inputs` reads
``multi_modal_data["video"]``: arrays, tensors or lists of frames, optionally with an fps),
sampled at :data:`DEFAULT_FPS` where it names no rate (2.0: vLLM's and qwen-vl-utils'
sampling rate; HF 5.17's processor takes 24 for frames without metadata).

The settings are the checkpoint's video processor's (:class:`Qwen2VideoSettings`: HF 5.17's
file order, ``processor_config.json``'s ``video_processor`` section, else
``video_preprocessor_config.json``, else ``preprocessor_config.json``, with
``Qwen2VLVideoProcessor``'s defaults where a field is absent). Each frame is resized as HF's
``Qwen2VLVideoProcessor.resize`` does (``smart_resize`` of its height and width within
``min_pixels``..``max_pixels``, the per-frame cap of ``cap_pixels_per_frame`` where the config
sets it; bicubic with antialiasing on float frames, rounded back to uint8: torchvision's
tensor path), then rescaled and normalized with the video settings by the image processor
(without its resize), then the frames are grouped by ``temporal_patch_size`` (a clip whose
frame count is not a multiple repeats its last frame, as HF's ``patchify``) into
``pixel_values_videos`` rows of grid ``(t, h, w)``, HF's video row layout (``C x temporal x
patch x patch`` per row, frame groups in order, each in merge-block order). HF's video
processor needs torchvision; this path does not (the image processor's PIL backend serves
where torchvision is absent, as for images).

In M-RoPE a frame group's temporal position advances by :func:`time_interval` (Qwen2.5-VL:
``tokens_per_second * temporal_patch_size / fps``; Qwen2-VL: 1). Qwen3-VL parses clips alike
but resizes and lays them out its own way (:mod:`mrv2_qwen_vl.video_qwen3`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.contract.video_inputs import VideoClip, video_processor_settings

__all__ = ["DEFAULT_FPS", "Qwen2VideoSettings", "check_video_layout", "qwen2_video_patches",
           "resize_frames", "resized_uint8", "time_interval", "video_patches",
           "video_settings_fields"]

#: The frame rate a clip is taken to be sampled at when it names none (vLLM's default).
DEFAULT_FPS = 2.0


@dataclass(frozen=True)
class Qwen2VideoSettings:
    """The video processor settings Qwen2-VL / Qwen2.5-VL videos take (module doc), with
    ``Qwen2VLVideoProcessor``'s defaults."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def load(cls, model_dir: str | Path | None) -> Qwen2VideoSettings:
        """The checkpoint's settings, defaults where absent; a config's ``min_pixels`` /
        ``max_pixels`` take precedence over its ``size`` (``Qwen2VLVideoProcessor.__init__``)."""
        return cls(**video_settings_fields(model_dir, cls(), pixels_over_size=True)[0])


def video_settings_fields(model_dir: str | Path | None, default: Any, pixels_over_size: bool
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the settings both Qwen video paths read, the config's raw fields)``: the fields of
    :func:`~mrv2.contract.video_inputs.video_processor_settings`, ``default`` 's (a
    :class:`Qwen2VideoSettings` or Qwen3-VL's) where absent; the pixel budget from ``size``
    (``shortest_edge`` / ``longest_edge``) or ``min_pixels`` / ``max_pixels``, the latter
    first where ``pixels_over_size``."""
    fields = video_processor_settings(model_dir)
    raw_size = fields.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}

    def budget(name: str, edge: str) -> int:
        pair = (fields.get(name), size.get(edge))
        first, second = pair if pixels_over_size else pair[::-1]
        return int(first or second or getattr(default, name))

    return dict(
        min_pixels=budget("min_pixels", "shortest_edge"),
        max_pixels=budget("max_pixels", "longest_edge"),
        patch_size=int(fields.get("patch_size") or default.patch_size),
        temporal_patch_size=int(fields.get("temporal_patch_size")
                                or default.temporal_patch_size),
        merge_size=int(fields.get("merge_size") or default.merge_size),
        image_mean=tuple(float(v) for v in fields.get("image_mean") or default.image_mean),
        image_std=tuple(float(v) for v in fields.get("image_std") or default.image_std),
        rescale_factor=float(fields.get("rescale_factor") or default.rescale_factor),
        cap_pixels_per_frame=bool(fields.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(fields.get("max_video_tokens") or default.max_video_tokens),
    ), fields


def check_video_layout(image_processor: Any, settings: Any, where: str) -> None:
    """ValueError naming ``where`` unless the video settings cut patches as the image
    processor does (``patch_size``, ``temporal_patch_size``, ``merge_size``): a video's rows
    are the image processor's."""
    layout = (settings.patch_size, settings.temporal_patch_size, settings.merge_size)
    image_layout = tuple(int(getattr(image_processor, name)) for name in (
        "patch_size", "temporal_patch_size", "merge_size"))
    if layout != image_layout:
        raise ValueError(f"{where}: the checkpoint's video processor cuts (patch, temporal, "
                         f"merge) = {layout}, its image processor {image_layout}; videos here "
                         "take the image processor's patches, so the two must agree")


def resized_uint8(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[T, height, width, 3]`` uint8: ``frames`` (``[T, H, W, 3]`` uint8) resized bicubic
    with antialiasing on float frames, rounded back (torchvision's tensor path, as HF's video
    processors resize; its native uint8 kernel on AVX2 CPUs may differ by a unit); the same
    array where the size is kept."""
    if tuple(frames.shape[1:3]) == (height, width):
        return frames
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(torch.float32)
    video = torch.nn.functional.interpolate(video, size=(height, width), mode="bicubic",
                                            align_corners=False, antialias=True)
    video = video.clamp_(0, 255).round_().to(torch.uint8)
    return np.ascontiguousarray(video.permute(0, 2, 3, 1).numpy())


def resize_frames(frames: np.ndarray, settings: Qwen2VideoSettings, where: str) -> np.ndarray:
    """The clip's frames resized as ``Qwen2VLVideoProcessor.resize`` does (module doc);
    ValueError naming ``where`` for an aspect ratio ``smart_resize`` refuses."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    num_frames, height, width = (int(v) for v in frames.shape[:3])
    factor = settings.patch_size * settings.merge_size
    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:  # an even share of the whole clip's pixel budget
        total = int(settings.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * settings.temporal_patch_size // num_frames),
                         int(settings.min_pixels * 1.05))
    try:
        new_h, new_w = smart_resize(height, width, factor=factor,
                                    min_pixels=settings.min_pixels, max_pixels=max_pixels)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    return resized_uint8(frames, new_h, new_w)


def qwen2_video_patches(image_processor: Any, clip: VideoClip, settings: Qwen2VideoSettings,
                        where: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A Qwen2-VL / Qwen2.5-VL clip's ``(pixel_values_videos rows, (t, h, w))`` (module doc):
    resized with the video settings, then :func:`video_patches` without the image
    processor's resize, with the video settings' rescale and normalization."""
    check_video_layout(image_processor, settings, where)
    frames = resize_frames(clip.frames, settings, where)
    return video_patches(image_processor, VideoClip(frames, clip.fps), where, do_resize=False,
                         image_mean=list(settings.image_mean), image_std=list(settings.image_std),
                         rescale_factor=settings.rescale_factor)

def video_patches(image_processor: Any, clip: VideoClip, where: str, **options: Any
                  ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(pixel_values_videos rows, (t, h, w))`` of one clip (module doc): its frames through
    the checkpoint's image processor (``options``: its keyword arguments, e.g.
    ``do_resize=False``), then grouped ``temporal_patch_size`` at a time. A ValueError naming
    ``where`` where the processor fails on them."""
    frames = list(clip.frames)
    try:
        out = image_processor(images=frames, return_tensors="pt",
                              input_data_format="channels_last", **options)
    except Exception as error:  # noqa: BLE001 (any resize / format failure of the frames)
        raise ValueError(f"{where}: could not process the frames: {type(error).__name__}: "
                         f"{error}") from error
    grids = {tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()}
    if len(grids) != 1:  # (frames of one size always resize alike)
        raise ValueError(f"{where}: frames resized to different grids {sorted(grids)}")
    _, h, w = grids.pop()
    temporal = int(image_processor.temporal_patch_size)
    rows = torch.as_tensor(out["pixel_values"])
    # each frame's rows repeat the frame `temporal` times: [T, h*w, C, temporal, p*p]
    per_frame = rows.reshape(len(frames), h * w, 3, temporal, -1)[:, :, :, 0]
    if pad := -len(frames) % temporal:  # HF's patchify: repeat the last frame
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, -1, -1, -1)])
    t = per_frame.shape[0] // temporal
    grouped = per_frame.reshape(t, temporal, h * w, 3, -1).permute(0, 2, 3, 1, 4)
    return grouped.reshape(t * h * w, -1).contiguous(), (t, h, w)


def time_interval(hf_config: Any, fps: float) -> float:
    """How far a video's temporal M-RoPE position advances per frame group: Qwen2.5-VL's
    ``tokens_per_second * temporal_patch_size / fps`` (``second_per_grid_t`` times
    ``vision_config.tokens_per_second``), 1.0 for Qwen2-VL."""
    vision = hf_config.vision_config
    if getattr(hf_config, "model_type", "") != "qwen2_5_vl":
        return 1.0
    second_per_grid_t = int(vision.temporal_patch_size) / fps
    return float(second_per_grid_t * float(vision.tokens_per_second))
