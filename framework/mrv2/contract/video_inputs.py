"""Decoded video clips as a prompt carries them, for any family's input processor.

``multi_modal_data["video"]`` holds one clip or a list of clips (no file decoding here). A clip
is a numpy ``[T, H, W, 3]`` uint8 array, a torch ``[T, 3, H, W]`` uint8 tensor, or a list of
frames (PIL images or ``[H, W, 3]`` uint8 arrays), optionally as ``(clip, {"fps": f})``: the
rate its frames were sampled at (each family names its default: a timestamp or a temporal
position depends on it). A list whose first element is a frame is one clip.
:func:`parse_videos` turns the value into :class:`VideoClip` s or raises a ValueError naming
``multi_modal_data.video[i]`` before any work; :func:`video_processor_settings` reads the
checkpoint's video processor settings where HF transformers 5 finds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.contract.input_processor import processor_settings

__all__ = ["VIDEO_FIELD", "VideoClip", "parse_videos", "video_processor_settings"]

#: The request field videos come in (ValueErrors name it).
VIDEO_FIELD = "multi_modal_data.video"


@dataclass(frozen=True)
class VideoClip:
    """One video of a prompt: its ``frames`` (``[T, H, W, 3]`` uint8, ``T >= 1``) and the
    ``fps`` they were sampled at."""

    frames: np.ndarray
    fps: float


def parse_videos(value: Any, default_fps: float) -> list[VideoClip]:
    """The clips of ``multi_modal_data["video"]`` (module doc), at ``default_fps`` where a
    clip names none: one clip, or a list of them; None or an empty list: none. ValueError
    naming ``multi_modal_data.video[i]`` for a clip of the wrong type, ndim, dtype or channel
    count, no frames, frames of different sizes or a bad ``fps``."""
    if value is None:
        return []
    one = (isinstance(value, (np.ndarray, torch.Tensor)) or _is_option_pair(value)
           or (isinstance(value, (list, tuple)) and len(value) > 0 and _is_frame(value[0])))
    clips = [value] if one else value
    if not isinstance(clips, (list, tuple)):
        raise ValueError(f"{VIDEO_FIELD}: expected a clip (a [T, H, W, 3] uint8 numpy array, a "
                         f"[T, 3, H, W] uint8 torch tensor or a list of frames), optionally as "
                         f"(clip, {{'fps': f}}), or a list of clips; got {type(value).__name__}")
    return [_clip(clip, f"{VIDEO_FIELD}[{i}]", default_fps) for i, clip in enumerate(clips)]


def video_processor_settings(model_dir: str | Path | None) -> dict[str, Any]:
    """The checkpoint's video processor settings in HF transformers 5's order:
    ``processor_config.json``'s ``video_processor`` section, else
    ``video_preprocessor_config.json``, else ``preprocessor_config.json``; empty where none
    holds them (or without ``model_dir``)."""
    if not model_dir:
        return {}
    return processor_settings(model_dir, "video_processor", "video_preprocessor_config.json",
                              "preprocessor_config.json") or {}


def _is_frame(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def _is_option_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping)


def _clip(value: Any, where: str, default_fps: float) -> VideoClip:
    fps = default_fps
    if _is_option_pair(value):
        value, options = value
        unknown = sorted(str(k) for k in options if k != "fps")
        if unknown:
            raise ValueError(f"{where}: unknown options {unknown}; allowed: 'fps'")
        raw = options.get("fps", default_fps)
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
