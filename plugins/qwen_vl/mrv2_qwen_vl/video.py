"""Qwen2-VL / Qwen2.5-VL videos: decoded frames into the vision tower's patch rows.

A video is a decoded clip (:mod:`mrv2.contract.video_inputs` reads
``multi_modal_data["video"]``: arrays, tensors or lists of frames, optionally with an fps),
sampled at :data:`DEFAULT_FPS` where it names no rate (2.0: vLLM's and qwen-vl-utils'
sampling rate; HF 5.17's processor takes 24 for frames without metadata).

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

from typing import Any

import torch

from mrv2.contract.video_inputs import VideoClip

__all__ = ["DEFAULT_FPS", "time_interval", "video_patches"]

#: The frame rate a clip is taken to be sampled at when it names none (vLLM's default).
DEFAULT_FPS = 2.0

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
