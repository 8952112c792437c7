"""Qwen-VL prompts with images and videos: the checkpoint's own HF image processor, placeholder
expansion.

A prompt carries one ``<|image_pad|>`` (``config.image_token_id``) per image where the chat
template puts it (``<|vision_start|><|image_pad|><|vision_end|>``), as vLLM expects. The
image processor of the checkpoint (``preprocessor_config.json``: resize within
``min_pixels``..``max_pixels``, normalize, cut into patches, ``image_grid_thw``) turns each
image into patch rows. Each placeholder is expanded to ``t * h * w / merge**2`` tokens. The
image's :class:`~mrv2.contract.requests.MultiModalItem` carries its patch rows and grid, and
names its content by a hash of the processed pixels.

Qwen2-VL and Qwen2.5-VL also take videos (``multi_modal_data["video"]``: decoded clips, see
:mod:`mrv2_qwen_vl.video`), one ``<|video_pad|>`` (``config.video_token_id``) per video,
expanded alike; a video's item (kind ``"video"``) also carries its M-RoPE ``time_interval``,
and its content hash covers that too (the positions differ with it). Qwen3-VL (and its MoE)
expands a video's placeholder into timestamp text and one ``<|vision_start|>`` video tokens
``<|vision_end|>`` run per frame group, one item per group (:mod:`mrv2_qwen_vl.video_qwen3`);
it needs the checkpoint's tokenizer for the timestamps.

transformers' ``AutoImageProcessor`` needs torchvision for Qwen2-VL's processor. Where
torchvision is absent (the CPU CI has none), the same processor's PIL backend
(``Qwen2VLImageProcessorPil``) is loaded from the same config file.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from pathlib import Path
from typing import Any, cast

import torch

from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    run_image_processor,
    splice_placeholders,
)
from mrv2.contract.input_processor import load_image_processor as load_core_image_processor
from mrv2.contract.requests import MultiModalItem
from mrv2.contract.video_inputs import VIDEO_FIELD, VideoClip, parse_videos
from mrv2.layers.rotary import context_limit
from mrv2.model_loader.build import vl_text_config
from mrv2_qwen_vl.mrope import ImageGrid, mrope_extent
from mrv2_qwen_vl.video import (
    DEFAULT_FPS,
    Qwen2VideoSettings,
    qwen2_video_patches,
    time_interval,
)
from mrv2_qwen_vl.video_qwen3 import (
    QWEN3_VIDEO_FAMILIES,
    Qwen3VideoSettings,
    VideoGroup,
    qwen3_video_groups,
)

__all__ = ["VIDEO_FAMILIES", "QwenVLInputProcessor", "load_image_processor"]

#: The ``model_type`` s whose prompts take videos.
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", *QWEN3_VIDEO_FAMILIES)


def load_image_processor(model_dir: str | Path) -> Any:
    """The checkpoint's HF image processor (``preprocessor_config.json``); its PIL backend
    where torchvision is not installed (:func:`mrv2.contract.input_processor.
    load_image_processor`)."""
    return load_core_image_processor(model_dir, "Qwen2VLImageProcessor")


class QwenVLInputProcessor(InputProcessor):
    """Qwen2.5-VL's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_processor = load_image_processor(model_dir)
        self.image_token_id = int(hf_config.image_token_id)
        self.video_token_id = int(getattr(hf_config, "video_token_id", None) or -1)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        #: Qwen3-VL's video settings (None for the other families).
        self.qwen3_video = (Qwen3VideoSettings.load(model_dir) if getattr(
            hf_config, "model_type", "") in QWEN3_VIDEO_FAMILIES else None)
        #: Qwen2-VL's and Qwen2.5-VL's (their checkpoint's video processor config).
        self.qwen2_video = (Qwen2VideoSettings.load(model_dir)
                            if self.takes_videos and self.qwen3_video is None else None)

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the image and video placeholders and make their items (module doc)."""
        clips = self._videos(mm_data)
        rest = {key: value for key, value in mm_data.items() if key != "video"}
        images, image_places = self.images_and_places(
            prompt_token_ids, rest, self.image_token_id, "<|image_pad|>",
            note=", 'video'" if self.takes_videos else "")
        if len(images) + len(clips) > self.limit_per_prompt:
            raise ValueError(f"multi_modal_data: {len(images)} images and {len(clips)} videos; "
                             f"at most {self.limit_per_prompt} per prompt "
                             "(--limit-mm-per-prompt)")
        video_places = [i for i, t in enumerate(prompt_token_ids) if t == self.video_token_id]
        if len(video_places) != len(clips) and (clips or self.takes_videos):
            raise ValueError(f"{VIDEO_FIELD}: {len(clips)} videos but the prompt has "
                             f"{len(video_places)} video placeholders (token "
                             f"{self.video_token_id}, <|video_pad|>); put one per video")
        if not images and not clips:
            return list(prompt_token_ids), []
        # (rows, grid, kind, time interval) of each item, in prompt order
        sources: list[tuple[torch.Tensor, tuple[int, int, int], str, float]] = []
        if images:
            out = run_image_processor(self.image_processor, images)
            pixels = out["pixel_values"]
            grids = [(int(g[0]), int(g[1]), int(g[2])) for g in out["image_grid_thw"].tolist()]
            firsts = list(accumulate((t * h * w for t, h, w in grids), initial=0))
            sources += [(pixels[firsts[n]: firsts[n + 1]].contiguous(), grid, "image", 1.0)
                        for n, grid in enumerate(grids)]
        if self.qwen3_video is not None and clips:
            groups = [qwen3_video_groups(self.image_processor, self.tokenizer, clip,
                                         self.qwen3_video, f"{VIDEO_FIELD}[{n}]")
                      for n, clip in enumerate(clips)]
            ids, items = self._splice_qwen3(prompt_token_ids, sources, image_places, groups,
                                            video_places)
            self._check_positions(items, len(ids))
            return ids, items
        for n, clip in enumerate(clips):
            assert self.qwen2_video is not None  # (a family that takes videos: _videos)
            rows, grid = qwen2_video_patches(self.image_processor, clip, self.qwen2_video,
                                             f"{VIDEO_FIELD}[{n}]")
            sources.append((rows, grid, "video", time_interval(self.hf_config, clip.fps)))
        order = sorted(range(len(sources)), key=[*image_places, *video_places].__getitem__)
        places = sorted([*image_places, *video_places])

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            rows, (t, h, w), kind, interval = sources[order[n]]
            length = t * h * w // self.merge**2
            token = self.image_token_id if kind == "image" else self.video_token_id
            data: dict[str, Any] = {"pixel_values": rows, "grid_thw": (t, h, w)}
            digest = content_hash((t, h, w), rows)
            if kind == "video":
                data["time_interval"] = interval
                digest = "video:" + content_hash((t, h, w), interval, rows).split(":", 1)[1]
            return [token] * length, MultiModalItem(kind, data, digest, offset, length)

        ids, items = splice_placeholders(prompt_token_ids, places, expand)
        if clips:
            self._check_positions(items, len(ids))
        return ids, items

    @property
    def takes_videos(self) -> bool:
        """Whether the family takes videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; module doc)."""
        return getattr(self.hf_config, "model_type", "") in VIDEO_FAMILIES

    def _videos(self, mm_data: Mapping[str, Any]) -> list[VideoClip]:
        """The prompt's clips; ValueError naming ``multi_modal_data.video`` where the family
        refuses videos or a clip is malformed."""
        if "video" not in mm_data:
            return []
        if not self.takes_videos:
            raise ValueError(f"{VIDEO_FIELD}: videos are not supported for "
                             f"{getattr(self.hf_config, 'model_type', 'this model')!r}; the "
                             f"families that take them: {', '.join(VIDEO_FAMILIES)}")
        if self.qwen3_video is not None and self.tokenizer is None:
            raise ValueError(f"{VIDEO_FIELD}: Qwen3-VL writes each frame group's timestamp "
                             "as text, which needs the checkpoint's tokenizer; this engine has "
                             "none (pass --tokenizer or use a checkpoint with one)")
        return parse_videos(mm_data["video"], DEFAULT_FPS)

    def _splice_qwen3(self, prompt_token_ids: list[int],
                      images: list[tuple[torch.Tensor, tuple[int, int, int], str, float]],
                      image_places: list[int], videos: list[list[VideoGroup]],
                      video_places: list[int]) -> tuple[list[int], list[MultiModalItem]]:
        """Qwen3-VL's expansion (:mod:`mrv2_qwen_vl.video_qwen3`): each image placeholder as
        the other families', each video placeholder as its frame groups (timestamp tokens,
        vision start, the group's video tokens, vision end), one item per group."""
        start_id = int(self.hf_config.vision_start_token_id)
        end_id = int(self.hf_config.vision_end_token_id)
        places = sorted([(p, "image", n) for n, p in enumerate(image_places)]
                        + [(p, "video", n) for n, p in enumerate(video_places)])
        ids: list[int] = []
        items: list[MultiModalItem] = []
        copied = 0
        for place, kind, n in places:
            ids.extend(prompt_token_ids[copied:place])
            copied = place + 1
            if kind == "image":
                rows, (t, h, w), _, _ = images[n]
                length = t * h * w // self.merge**2
                items.append(MultiModalItem("image", {"pixel_values": rows, "grid_thw": (t, h, w)},
                                            content_hash((t, h, w), rows), len(ids), length))
                ids.extend([self.image_token_id] * length)
                continue
            for group in videos[n]:
                ids.extend([*group.timestamp_ids, start_id])
                length = group.grid[1] * group.grid[2] // self.merge**2
                digest = content_hash(group.grid, group.rows).split(":", 1)[1]
                items.append(MultiModalItem("video", {"pixel_values": group.rows,
                                                      "grid_thw": group.grid},
                                            "video:" + digest, len(ids), length))
                ids.extend([*[self.video_token_id] * length, end_id])
        ids.extend(prompt_token_ids[copied:])
        return ids, items

    def _check_positions(self, items: list[MultiModalItem], num_tokens: int) -> None:
        """ValueError where the M-RoPE positions of the prompt, or of a sequence as long as
        ``max_model_len``, would pass the rotary table (:func:`context_limit`:
        ``max_position_embeddings``, or longer by RoPE scaling): a video's temporal positions
        may run ahead of the 1-D ones."""
        grids = [ImageGrid(item.offset, int(item.data["grid_thw"][0]),
                           int(item.data["grid_thw"][1]) // self.merge,
                           int(item.data["grid_thw"][2]) // self.merge,
                           float(item.data.get("time_interval", 1.0))) for item in items]
        limit = cast(int, context_limit(vl_text_config(self.hf_config))[0])
        longest = max(num_tokens, self.config.model.fixed_max_model_len or limit)
        extent = mrope_extent(grids, longest)
        if extent > limit:
            raise ValueError(f"{VIDEO_FIELD}: with these videos M-RoPE positions reach "
                             f"{extent - 1}, past the rotary table's {limit} positions (fewer "
                             "frames, a higher fps or a smaller max_model_len)")
