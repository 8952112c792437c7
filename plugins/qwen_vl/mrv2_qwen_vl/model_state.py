"""The Qwen-VL model states: M-RoPE positions on the device, image embeddings for each step.

- **When a request is added** its images go into the device M-RoPE table
  (:class:`~mrv2_qwen_vl.mrope.MRopeTable`), one staged copy. A text-only request's row is
  reset to plain positions.
- **Each step**, :meth:`QwenVLModelState.prepare_inputs` maps every token to its request's row
  (``searchsorted`` over the step's ``query_start_loc``) and computes its ``[3, T]`` positions
  with device ops into a persistent buffer. Decode steps need no host work per token, and the
  positions are inside the CUDA graphs like everything else of the step.
- **A prefill chunk that reaches an image's placeholders** gets that image's embedding rows
  (:meth:`QwenVLModelState.get_mm_embeddings`). They come from the encoder cache, keyed by the
  image's content hash, or from one run of the vision tower.
- **The encoder cache** keeps an image's embeddings while a request still has to compute the
  image's placeholder rows (reused across chunked-prefill steps and by other requests with
  the same image). A request lets go of an image in the step that computes the image's last
  row (at once, when the prefix cache already holds the rows), as vLLM frees encoder outputs
  after their prefill: decoding requests hold no embeddings, so the device memory they take is
  bounded by the prompts in prefill, not by every request in flight. Released embeddings stay
  in a least-recently-used pool of at most :attr:`QwenVLModelState.encoder_cache_bytes`, and
  are freed from it. (A preempted request is added again with its images and holds them
  anew; a miss runs the vision tower again.)
- **Qwen3-VL** (:class:`Qwen3VLModelState`) caches each image's deepstack features with its
  embeddings and hands a step's share of them to the model's forward.
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.model_state import ModelState, placeholder_rows
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2.contract.staging import to_device
from mrv2_qwen_vl.model_qwen3 import DeepstackRows
from mrv2_qwen_vl.mrope import ImageGrid, MRopeTable, mrope_positions

__all__ = ["Qwen3VLModelState", "QwenVLModelState", "largest_image_grid"]


class QwenVLModelState(ModelState):
    """:class:`~mrv2.contract.model_state.ModelState` of Qwen2.5-VL (see the module doc)."""

    #: Bytes of image embeddings kept after their last request left (least recently used
    #: first out); embeddings of images that live requests hold are never evicted.
    encoder_cache_bytes = 256 << 20

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        max_tokens = int(buffers.positions.shape[0])
        self.table = MRopeTable(int(buffers.idx_mapping.shape[0]),
                                max(1, config.multimodal.limit_mm_per_prompt), device)
        self._positions = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self._token_index = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self._images: dict[int, list[MultiModalItem]] = {}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._refs: Counter[str] = Counter()
        self.encoder_runs = 0  # vision-tower calls (the tests count cache hits with it)
        #: The last step's key and rows: a second call for the same step gives the same rows
        #: (the first one let go of the images it finished).
        self._last_step: tuple[tuple[bytes, bytes, bytes], MultiModalEmbeddings | None] | None
        self._last_step = None

    # -- start-up ----------------------------------------------------------------------------

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The vision tower over the largest image one prompt may carry (a square grid of at
        most ``max_prompt_tokens`` merged tokens and at most the image processor's
        ``max_pixels``), random pixels, output dropped; returns
        :attr:`encoder_cache_bytes` (released embeddings the cache may keep)."""
        grid = largest_image_grid(max_prompt_tokens, self.merge,
                                  int(self.hf_config.vision_config.patch_size),
                                  _max_pixels(self.config.model.model))
        if grid is not None:
            visual = cast(Any, self.model).visual
            pixels = torch.randn(grid[0] * grid[1] * grid[2], int(visual.patch_dim),
                                 device=self.device)
            cast(Any, self.model).embed_images(pixels, [grid])
        return self.encoder_cache_bytes

    # -- per request -------------------------------------------------------------------------

    def add_request(self, request: NewRequest, row: int) -> None:
        """Write the request's images into the M-RoPE table (or reset the row) and hold their
        cache entries."""
        grids = []
        for item in request.mm_items:
            if item.kind != "image":
                raise ValueError(f"request {request.req_id!r}: unsupported multimodal kind "
                                 f"{item.kind!r}; allowed: 'image'")
            t, h, w = (int(v) for v in item.data["grid_thw"])
            if item.length * self.merge**2 != t * h * w:
                raise ValueError(f"request {request.req_id!r}: an image of grid {(t, h, w)} has "
                                 f"{t * h * w // self.merge**2} tokens, got length "
                                 f"{item.length}")
            grids.append(ImageGrid(item.offset, t, h // self.merge, w // self.merge))
        self.table.set_row(row, grids)
        self._release(row)
        pending = [item for item in request.mm_items  # (rows the prefix cache had: done)
                   if item.offset + item.length > request.num_computed_tokens]
        if pending:
            self._images[row] = pending
            self._refs.update(item.content_hash for item in pending)

    def remove_request(self, req_id: str, row: int) -> None:
        """Drop the row's hold on its images' cache entries."""
        self._release(row)

    def _release(self, row: int, done: list[MultiModalItem] | None = None) -> None:
        """Drop the row's hold on ``done`` (default: all of its images); evict after."""
        items = self._images.get(row, [])
        finished = {id(item) for item in (items if done is None else done)}
        released = [item for item in items if id(item) in finished]
        kept = [item for item in items if id(item) not in finished]
        if kept:
            self._images[row] = kept
        else:
            self._images.pop(row, None)
        for item in released:
            self._refs[item.content_hash] -= 1
            if self._refs[item.content_hash] <= 0:
                del self._refs[item.content_hash]
        self._evict()

    def _evict(self) -> None:
        """Free unheld entries, least recently used first, beyond the byte budget."""
        unheld = [h for h in self._cache if h not in self._refs]
        size = sum(self._cache[h].numel() * self._cache[h].element_size() for h in unheld)
        for content_hash in unheld:
            if size <= self.encoder_cache_bytes:
                break
            entry = self._cache.pop(content_hash)
            size -= entry.numel() * entry.element_size()

    # -- per step ----------------------------------------------------------------------------

    def _embeddings(self, item: MultiModalItem) -> torch.Tensor:
        cached = self._cache.get(item.content_hash)
        if cached is None:
            pixels = cast(torch.Tensor, item.data["pixel_values"])
            if self.device.type == "cuda":  # pinned, non-blocking: no host sync
                pixels = pixels.pin_memory()
            pixels = pixels.to(self.device, non_blocking=True)
            cached = cast(Any, self.model).embed_images(pixels, [tuple(item.data["grid_thw"])])
            self.encoder_runs += 1
            self._cache[item.content_hash] = cached
            self._evict()
        self._cache.move_to_end(item.content_hash)
        return cached

    def _step_rows(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """The encoder-cache rows (whatever the model's ``embed_images`` gives per image
        token) of the image placeholders this step computes, with their token rows in the
        flat step batch (host-side bookkeeping over the step's CPU arrays; None for a step
        without any)."""
        n = batch.num_reqs
        key = (batch.idx_mapping_cpu[:n].tobytes(), batch.num_computed_cpu[:n].tobytes(),
               batch.query_start_loc_cpu[: n + 1].tobytes())
        if self._last_step is not None and self._last_step[0] == key:
            return self._last_step[1]  # the same step asked again: the same rows
        result = self._compute_step_rows(batch) if self._images else None
        self._last_step = (key, result)
        return result

    def _compute_step_rows(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        indices: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        for i in range(batch.num_reqs):
            row = int(batch.idx_mapping_cpu[i])
            done: list[MultiModalItem] = []
            for item in self._images.get(row, ()):
                rows, within = placeholder_rows(batch, i, item.offset, item.length)
                if len(rows):  # a contiguous run of the image's rows
                    parts.append(self._embeddings(item)[int(within[0]): int(within[-1]) + 1])
                    indices.append(rows)
                    if int(within[-1]) == item.length - 1:
                        done.append(item)  # its last row: this request lets go (module doc)
            if done:  # (the slices above keep their rows alive for this step)
                self._release(row, done)
        if not parts:
            return None
        return MultiModalEmbeddings(to_device(np.concatenate(indices), torch.int64, self.device),
                                    parts[0] if len(parts) == 1 else torch.cat(parts))

    def mixed_graph_allowed(self, rows: list[int], num_computed: list[int],
                            query_lens: list[int]) -> bool:
        """Steps that compute no image placeholder replay the mixed graphs (their M-RoPE
        positions are device work); the others run eager: their image rows are spliced in on
        the host's say-so (:meth:`get_mm_embeddings`)."""
        for row, first, count in zip(rows, num_computed, query_lens, strict=True):
            for item in self._images.get(row, ()):
                if first < item.offset + item.length and item.offset < first + count:
                    return False
        return True

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """The embedding rows of the image placeholders this step computes (None for a step
        without any)."""
        return self._step_rows(batch)

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


def _max_pixels(model_dir: str | None) -> int | None:
    """The checkpoint image processor's ``max_pixels`` (``size.longest_edge`` in newer
    configs, a pixel count too); None where there is none to read."""
    if not model_dir:
        return None
    path = Path(model_dir) / "preprocessor_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    value = config.get("max_pixels") or size.get("longest_edge")
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

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self._deepstack: DeepstackRows | None = None

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """Column 0 of the step's image rows; the deepstack columns wait for
        :meth:`prepare_inputs`."""
        rows = self._step_rows(batch)
        if rows is None:
            self._deepstack = None
            return None
        self._deepstack = DeepstackRows(rows.token_indices, rows.embeddings[:, 1:])
        return MultiModalEmbeddings(rows.token_indices, rows.embeddings[:, 0])

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """Qwen2.5-VL's inputs, with ``deepstack`` when the step has image rows."""
        self._deepstack = None
        inputs = super().prepare_inputs(batch)
        deepstack, self._deepstack = self._deepstack, None
        if deepstack is not None:
            inputs["deepstack"] = deepstack
        return inputs
