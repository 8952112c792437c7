"""Qwen2-VL / Qwen2.5-VL videos: decoded frames into the vision tower's patch rows.

A video is a decoded clip (no file decoding here): a numpy ``[T, H, W, 3]`` uint8 array, a
torch ``[T, 3, H, W]`` uint8 tensor, or a list of frames (PIL images or ``[H, W, 3]`` uint8
arrays), optionally as ``(clip, {"fps": f})`` (the frame rate the clip was sampled at;
default :data:`DEFAULT_FPS`, 2.0: vLLM's and qwen-vl-utils' sampling rate; HF 5.17's processor
takes 24 for frames without metadata). ``multi_modal_data["video"]``
is one clip or a list of clips (a list whose first element is a frame is one clip).

Each frame is resized and normalized like an image of its size by the checkpoint's image
processor (``smart_resize`` within ``min_pixels``..``max_pixels``, rescale, normalize: the
same steps as HF's ``Qwen2VLVideoProcessor``, whose settings Qwen-VL checkpoints share with
the image processor's ``preprocessor_config.json``), then the frames are grouped by
``temporal_patch_size`` (a clip whose frame count is not a multiple repeats its last frame, as
HF's ``patchify``) into ``pixel_values_videos`` rows of grid ``(t, h, w)``, HF's video row
layout (``C x temporal x patch x patch`` per row, frame groups in order, each in merge-block
order). HF's video processor needs torchvision; this path does not (the image processor's PIL
backend serves where torchvision is absent, as for images).

In M-RoPE a frame group's temporal position advances by :func:`time_interval` (Qwen2.5-VL:
``tokens_per_second * temporal_patch_size / fps``; Qwen2-VL: 1). Qwen3-VL parses clips alike
but resizes and lays them out its own way (:mod:`mrv2_qwen_vl.video_qwen3`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["DEFAULT_FPS", "VideoClip", "parse_videos", "time_interval", "video_patches"]

#: The frame rate a clip is taken to be sampled at when it names none (vLLM's default).
DEFAULT_FPS = 2.0

_FIELD = "multi_modal_data.video"


@dataclass(frozen=True)
class VideoClip:
    """One video of a prompt: its ``frames`` (``[T, H, W, 3]`` uint8, ``T >= 1``) and the
    ``fps`` they were sampled at."""

    frames: np.ndarray
    fps: float


def _is_frame(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def parse_videos(value: Any) -> list[VideoClip]:
    """The clips of ``multi_modal_data["video"]`` (module doc): one clip, or a list of them;
    None or an empty list: none. ValueError naming ``multi_modal_data.video[i]`` for a clip of
    the wrong type, ndim, dtype or channel count, no frames, frames of different sizes or a
    bad ``fps``."""
    if value is None:
        return []
    one = (isinstance(value, (np.ndarray, torch.Tensor)) or _is_option_pair(value)
           or (isinstance(value, (list, tuple)) and len(value) > 0 and _is_frame(value[0])))
    clips = [value] if one else value
    if not isinstance(clips, (list, tuple)):
        raise ValueError(f"{_FIELD}: expected a clip (a [T, H, W, 3] uint8 numpy array, a "
                         f"[T, 3, H, W] uint8 torch tensor or a list of frames), optionally as "
                         f"(clip, {{'fps': f}}), or a list of clips; got {type(value).__name__}")
    return [_clip(clip, f"{_FIELD}[{i}]") for i, clip in enumerate(clips)]


def _is_option_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping)


def _clip(value: Any, where: str) -> VideoClip:
    fps = DEFAULT_FPS
    if _is_option_pair(value):
        value, options = value
        unknown = sorted(str(k) for k in options if k != "fps")
        if unknown:
            raise ValueError(f"{where}: unknown options {unknown}; allowed: 'fps'")
        raw = options.get("fps", DEFAULT_FPS)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < 1e6:
            raise ValueError(f"{where}: fps must be a positive number, got {raw!r}")
        fps = float(raw)
    return VideoClip(_frames(value, where), fps)


def _frames(value: Any, where: str) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 frames of one clip, or ValueError naming ``where``."""
    from PIL import Image

    if isinstance(value, torch.Tensor):
        if value.dim() != 4 or value.shape[1] != 3:
            raise ValueError(f"{where}: a torch clip must be [T, 3, H, W], got shape "
                             f"{list(value.shape)}")
        if value.dtype != torch.uint8:
            raise ValueError(f"{where}: frames must be uint8, got {value.dtype}")
        array = value.detach().cpu().permute(0, 2, 3, 1).numpy()
    elif isinstance(value, np.ndarray):
        if value.ndim != 4 or value.shape[3] != 3:
            raise ValueError(f"{where}: a numpy clip must be [T, H, W, 3], got shape "
                             f"{list(value.shape)}")
        array = value
    elif isinstance(value, (list, tuple)):
        frames: list[np.ndarray] = []
        for j, frame in enumerate(value):
            if isinstance(frame, Image.Image):
                frame = np.asarray(frame.convert("RGB"))
            if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] != 3:
                shape = list(frame.shape) if isinstance(frame, np.ndarray) else None
                raise ValueError(f"{where}[{j}]: a frame must be a PIL image or an [H, W, 3] "
                                 f"uint8 array, got {type(frame).__name__} {shape or ''}")
            if frame.dtype != np.uint8:
                raise ValueError(f"{where}[{j}]: frames must be uint8, got {frame.dtype}")
            if frames and frame.shape != frames[0].shape:
                raise ValueError(f"{where}[{j}]: frame of shape {list(frame.shape)}; the "
                                 f"clip's frames are {list(frames[0].shape)}")
            frames.append(frame)
        array = np.stack(frames) if frames else np.zeros((0, 1, 1, 3), np.uint8)
    else:
        raise ValueError(f"{where}: expected a [T, H, W, 3] uint8 numpy array, a [T, 3, H, W] "
                         f"uint8 torch tensor or a list of frames, got {type(value).__name__}")
    if array.dtype != np.uint8:
        raise ValueError(f"{where}: frames must be uint8, got {array.dtype}")
    if array.shape[0] == 0:
        raise ValueError(f"{where}: a clip needs at least one frame, got none")
    if array.shape[1] < 1 or array.shape[2] < 1:
        raise ValueError(f"{where}: empty frames of shape {list(array.shape[1:])}")
    return np.ascontiguousarray(array)


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
