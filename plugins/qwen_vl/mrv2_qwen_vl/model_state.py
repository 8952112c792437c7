"""The Qwen-VL model states: M-RoPE positions on the device, image (and video) embeddings for
each step.

- **When a request is added** its images and videos (items of kind ``"video"``: Qwen2-VL's
  and Qwen2.5-VL's with their ``time_interval``, Qwen3-VL's one per frame group) go into the
  device M-RoPE table
  (:class:`~mrv2_qwen_vl.mrope.MRopeTable`), one staged copy. A text-only request's row is
  reset to plain positions.
- **Each step**, :meth:`QwenVLModelState.prepare_inputs` maps every token to its request's row
  (``searchsorted`` over the step's ``query_start_loc``) and computes its ``[3, T]`` positions
  with device ops into a persistent buffer. Decode steps need no host work per token, and the
  positions are inside the CUDA graphs like everything else of the step.
- **The image embeddings** of each step, and the encoder cache that keeps them, are the
  core's :class:`~mrv2.contract.encoder_cache.EncoderCacheModelState`: this state's
  :meth:`QwenVLModelState.embed_item` runs the vision tower on one image or video (a
  video's grid has ``t > 1`` frame groups; the tower takes it as it is).
- **Qwen3-VL** (:class:`Qwen3VLModelState`) caches each image's (and each video frame
  group's) deepstack features with its embeddings and hands a step's share of them to the
  model's forward. Its videos come as one item per frame group (grid ``(1, h, w)``,
  :mod:`mrv2_qwen_vl.video_qwen3`), so its M-RoPE table has a slot per frame group.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import preprocessor_config
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2_qwen_vl.model_qwen3 import DeepstackRows
from mrv2_qwen_vl.mrope import ImageGrid, MRopeTable, mrope_positions
from mrv2_qwen_vl.video import Qwen2VideoSettings
from mrv2_qwen_vl.video_qwen3 import qwen3_table_slots

__all__ = ["Qwen3VLModelState", "QwenVLModelState", "largest_image_grid", "largest_video_grid"]


class QwenVLModelState(EncoderCacheModelState):
    """:class:`~mrv2.contract.model_state.ModelState` of Qwen2.5-VL (see the module doc)."""

    item_kinds: tuple[str, ...] = ("image", "video")

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        max_tokens = int(buffers.positions.shape[0])
        self.table = MRopeTable(int(buffers.idx_mapping.shape[0]), self.table_slots(), device)
        self._positions = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self._token_index = torch.arange(max_tokens, dtype=torch.int32, device=device)

    def table_slots(self) -> int:
        """Items one request may carry in the M-RoPE table: ``--limit-mm-per-prompt``."""
        return max(1, int(self.config.multimodal.limit_mm_per_prompt))

    # -- start-up ----------------------------------------------------------------------------

    #: Whether a video is one item (its ``t`` frame groups in one tower run: Qwen2-VL,
    #: Qwen2.5-VL) rather than one item per frame group (Qwen3-VL).
    video_is_one_item = True

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The vision tower over the largest item one prompt may carry, random pixels, output
        dropped: the largest image (a square grid of at most ``max_prompt_tokens`` merged
        tokens and at most the image processor's ``max_pixels``), then, where a video is one
        item, the largest video (:func:`largest_video_grid`: its frames at most the video
        processor's ``max_pixels``, as many frame groups as the prompt holds; a long video
        runs more patches through the tower at once than any image). Returns
        :attr:`encoder_cache_bytes` (released embeddings the cache may keep)."""
        patch = int(self.hf_config.vision_config.patch_size)
        grids = [largest_image_grid(max_prompt_tokens, self.merge, patch,
                                    self.image_max_pixels())]
        if self.video_is_one_item:
            frame_pixels = Qwen2VideoSettings.load(self.config.model.model).max_pixels
            grids.append(largest_video_grid(max_prompt_tokens, self.merge, patch, frame_pixels))
        visual = cast(Any, self.model).visual
        for grid in grids:
            if grid is not None:
                pixels = torch.randn(grid[0] * grid[1] * grid[2], int(visual.patch_dim),
                                     device=self.device)
                cast(Any, self.model).embed_images(pixels, [grid])
                del pixels
        return self.encoder_cache_bytes

    def image_max_pixels(self) -> int | None:
        """The most pixels the image processor leaves an image: its ``max_pixels``
        (``size.longest_edge``); None where the checkpoint has none to read."""
        return _max_pixels(self.config.model.model)

    # -- per request -------------------------------------------------------------------------

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image or video whose grid gives its placeholder count."""
        super().check_item(request, item)
        t, h, w = (int(v) for v in item.data["grid_thw"])
        if item.length * self.merge**2 != t * h * w:
            what = "an image" if item.kind == "image" else "a video"
            raise ValueError(f"request {request.req_id!r}: {what} of grid {(t, h, w)} has "
                             f"{t * h * w // self.merge**2} tokens, got length {item.length}")

    def add_request(self, request: NewRequest, row: int) -> None:
        """Check the images and videos and write them into the M-RoPE table (or reset the
        row), then hold their cache entries."""
        for item in request.mm_items:
            self.check_item(request, item)
        grids = []
        for item in request.mm_items:
            t, h, w = (int(v) for v in item.data["grid_thw"])
            grids.append(ImageGrid(item.offset, t, h // self.merge, w // self.merge,
                                   float(item.data.get("time_interval", 1.0))))
        self.table.set_row(row, grids)
        super().add_request(request, row)

    # -- per step ----------------------------------------------------------------------------

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the vision tower on the image's (or video's) patch rows."""
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"]))
        return cast(torch.Tensor, cast(Any, self.model).embed_images(
            pixels, [tuple(item.data["grid_thw"])]))

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """The default inputs (image rows spliced in), with ``[3, T]`` M-RoPE positions."""
        inputs = super().prepare_inputs(batch)
        num_tokens = int(batch.input_ids.shape[0])
        req = torch.searchsorted(batch.query_start_loc[1:], self._token_index[:num_tokens],
                                 right=True)
        rows = batch.idx_mapping[req.clamp_(max=batch.idx_mapping.shape[0] - 1)]
        inputs["positions"] = mrope_positions(batch.positions, rows, self.table,
                                              out=self._positions)
        return inputs


def largest_image_grid(max_tokens: int, merge: int, patch_size: int,
                       max_pixels: int | None) -> tuple[int, int, int] | None:
    """``(t, h, w)`` in patches of the largest square image of at most ``max_tokens`` merged
    tokens (``h * w / merge**2``) and ``max_pixels`` pixels; None if not even one token fits."""
    tokens = max_tokens
    if max_pixels is not None:
        tokens = min(tokens, max_pixels // (merge * patch_size) ** 2)
    side = math.isqrt(max(tokens, 0))  # in merged tokens
    if side < 1:
        return None
    return 1, side * merge, side * merge


def largest_video_grid(max_tokens: int, merge: int, patch_size: int,
                       frame_pixels: int) -> tuple[int, int, int] | None:
    """``(t, h, w)`` in patches of the largest video one item may be: square frames of at most
    ``frame_pixels`` pixels (and ``max_tokens`` merged tokens), as many frame groups ``t`` as
    ``max_tokens`` holds; None where that is no more than one frame group (the largest image
    covers it)."""
    frame = largest_image_grid(max_tokens, merge, patch_size, frame_pixels)
    if frame is None:
        return None
    groups = max_tokens // (frame[1] * frame[2] // merge**2)
    return (groups, frame[1], frame[2]) if groups > 1 else None


def _max_pixels(model_dir: str | None) -> int | None:
    """The checkpoint image processor's ``max_pixels`` (``size.longest_edge`` in newer
    configs, a pixel count too); None where there is none to read."""
    config = preprocessor_config(model_dir)
    size = config.get("size")
    value = config.get("max_pixels") or (size.get("longest_edge")
                                         if isinstance(size, dict) else None)
    return int(value) if value else None


class Qwen3VLModelState(QwenVLModelState):
    """Qwen3-VL's model state: Qwen2.5-VL's, plus the deepstack features of the step's image
    rows (:mod:`mrv2_qwen_vl.model_qwen3`).

    The encoder cache holds ``[N, 1 + L, hidden]`` per image (embedding and deepstack
    features together, one key), so chunked prefill and cache hits slice both alike.
    :meth:`get_mm_embeddings` returns column 0 and keeps the rest for the
    :meth:`prepare_inputs` that called it, which passes them as ``deepstack``; a step without
    image rows passes nothing (no vision work, the text forward the CUDA graphs captured).
    """

    item_kinds = ("image", "video")  # (a video: one item per frame group)

    video_is_one_item = False  # (a frame group an item: no larger than an image's run)

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self._deepstack: DeepstackRows | None = None

    def table_slots(self) -> int:
        """A slot per image, or per frame group of a video of at most ``max_frames`` frames
        (:func:`~mrv2_qwen_vl.video_qwen3.qwen3_table_slots`)."""
        return qwen3_table_slots(self.config.model.model,
                                 int(self.config.multimodal.limit_mm_per_prompt))

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """Column 0 of the step's image rows; the deepstack columns wait for
        :meth:`prepare_inputs`."""
        rows = self.step_rows(batch)
        if rows is None:
            self._deepstack = None
            return None
        # (a model without deepstack features, Qwen3.5's, caches column 0 alone)
        self._deepstack = (DeepstackRows(rows.token_indices, rows.embeddings[:, 1:])
                           if rows.embeddings.shape[1] > 1 else None)
        return MultiModalEmbeddings(rows.token_indices, rows.embeddings[:, 0])

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """Qwen2.5-VL's inputs, with ``deepstack`` when the step has image rows."""
        self._deepstack = None
        inputs = super().prepare_inputs(batch)
        deepstack, self._deepstack = self._deepstack, None
        if deepstack is not None:
            inputs["deepstack"] = deepstack
        return inputs
