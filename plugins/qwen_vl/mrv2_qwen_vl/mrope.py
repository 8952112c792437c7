"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): 3-D rotary positions for images and videos, 1-D
for text.

Each token has three position components (temporal, height, width). A text token has all
three equal; an image's ``t' x h' x w'`` merged patches (``h' = h / spatial_merge``) start at
``s``, the position its first token would have had as text, and take ``(s + t_idx, s + h_idx,
s + w_idx)``; the text after the image resumes at ``s + max(h', w')`` (HF transformers 5.17's
``get_rope_index`` for images). A video's ``t'`` frame groups take temporal positions
``s + int(t_idx * interval)`` instead: ``interval`` is 1 but in Qwen2.5-VL, where it is
``second_per_grid_t * tokens_per_second`` (the seconds a frame group spans, times the
config's ``vision_config.tokens_per_second``), and the text after any image or video resumes
at one past its largest position, ``s + span`` (``span = max(int((t' - 1) * interval), h' - 1,
w' - 1) + 1``, ``max(h', w')`` for an image): the original Qwen code's and vLLM's rule. HF
5.17 differs for videos in two ways: it truncates ``second_per_grid_t`` before the product
(fixed upstream later; the two agree for whole seconds, as at the default 2 fps), and resumes
the text after a video at ``s + max(h', w')`` while its decode positions continue from the
largest one (they agree where the frame groups' positions stay below ``max(h', w')``). So past
its images a request's positions are its 1-D positions plus a constant ``shift`` (``<= 0`` for
images: an image of ``h' * w'`` tokens advances the positions by only ``max(h', w')``), and
every decode step keeps the shift of the request's last image or video.

Per request the model state keeps a small table on the device (:class:`MRopeTable`): for each
of its images and videos (at most ``max_items``) the 1-D offset of its first token, its token
count, its ``w'`` and ``h' * w'``, its start ``s``, its time ``interval`` and the shift after
it. :func:`mrope_positions` turns a step's 1-D positions into ``[3, T]`` with device ops over
those rows (no host sync, no work per token on the host), and :class:`MRotaryEmbedding`
rotates by them: for each frequency it picks the component of its ``mrope_section`` (the first
``s_t`` frequencies by the temporal component, the next ``s_h`` by the height, the last
``s_w`` by the width), gathers the step's cos/sin rows from the 1-D table and runs the shared
rotary kernel over them.
:func:`mrope_positions_ref` is the plain-Python specification.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mrv2.contract.staging import to_device
from mrv2.layers.rotary import RotaryEmbedding, context_limit, rope_parameters_of
from mrv2_kernels.rotary import rotary_embedding

__all__ = ["ImageGrid", "MRopeTable", "MRotaryEmbedding", "frequency_components", "get_mrope",
           "mrope_extent", "mrope_positions", "mrope_positions_ref"]

_FAR = 2**30  # offset of an unused image slot: past every position
_ROW_STRIDE = 2**31  # a row's search keys: row * _ROW_STRIDE + offset (sorted over the table)


@dataclass(frozen=True)
class ImageGrid:
    """An image's (or a video's) placeholder tokens in the prompt: 1-D ``offset`` of the first
    one and the merged grid ``(t, h, w)`` (``t * h * w`` tokens; ``h``, ``w`` after the spatial
    merge); frame group ``t_idx`` is at temporal position ``start + int(t_idx * interval)``
    (1.0 for images and Qwen2-VL's videos; module doc)."""

    offset: int
    t: int
    h: int
    w: int
    interval: float = 1.0

    @property
    def length(self) -> int:
        """Number of placeholder tokens."""
        return self.t * self.h * self.w

    @property
    def span(self) -> int:
        """One past its largest position component, from its start ``s``: the text after it
        resumes at ``s + span`` (``max(h, w)`` for an image; module doc)."""
        return 1 + max(int((self.t - 1) * self.interval), self.h - 1, self.w - 1)


def mrope_extent(images: Sequence[ImageGrid], num_tokens: int) -> int:
    """One past the largest position of a sequence of ``num_tokens`` tokens with ``images``
    (videos' temporal positions may pass the 1-D ones, and must stay inside the rotary
    table)."""
    shift = 0
    extent = 0
    for image in sorted(images, key=lambda g: g.offset):
        start = image.offset + shift
        extent = max(extent, start + image.span)
        shift = start + image.span - (image.offset + image.length)
    return max(extent, num_tokens + shift)


def mrope_positions_ref(num_tokens: int, images: Sequence[ImageGrid]) -> tuple[list[list[int]],
                                                                                int]:
    """``([t, h, w] position lists of the first num_tokens tokens, shift after the last
    image)``, in plain Python (the specification; images sorted by offset, not overlapping)."""
    pos: list[list[int]] = [[], [], []]
    shift = 0
    p = 0
    for image in sorted(images, key=lambda g: g.offset):
        while p < min(image.offset, num_tokens):
            for c in range(3):
                pos[c].append(p + shift)
            p += 1
        start = image.offset + shift
        for j in range(image.length):
            if p >= num_tokens:
                break
            t_idx, rem = divmod(j, image.h * image.w)
            pos[0].append(start + int(t_idx * image.interval))
            pos[1].append(start + rem // image.w)
            pos[2].append(start + rem % image.w)
            p += 1
        shift = start + image.span - (image.offset + image.length)
    while p < num_tokens:
        for c in range(3):
            pos[c].append(p + shift)
        p += 1
    return pos, shift


class MRopeTable:
    """Per-row image / video tables on ``device``: ``max_rows`` requests x ``max_items`` items
    (int64 ``[max_rows, max_items]`` each, the time intervals float64; unused slots far past
    every position). ``key`` (``row * 2**31 + offset``) is sorted over the flattened table, so
    a token finds its item by one binary search however many items a row may hold (Qwen3-VL:
    one per video frame group)."""

    def __init__(self, max_rows: int, max_items: int, device: torch.device) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.max_items = max_items
        self.device = device

        def table(fill: int) -> torch.Tensor:
            return torch.full((max_rows, max_items), fill, dtype=torch.int64, device=device)

        self.offset = table(_FAR)
        self.key = (torch.arange(max_rows, dtype=torch.int64, device=device)[:, None]
                    * _ROW_STRIDE + self.offset)
        self.length = table(0)
        self.width = table(1)
        self.area = table(1)
        self.start = table(0)
        self.interval = torch.ones((max_rows, max_items), dtype=torch.float64, device=device)
        #: ``[max_rows, max_items + 1]``: column ``k`` is the shift after ``k`` images.
        self.shift = torch.zeros((max_rows, max_items + 1), dtype=torch.int64, device=device)

    def set_row(self, row: int, images: Sequence[ImageGrid]) -> None:
        """Write ``row``'s images (at most ``max_items``; sorted by offset here; none for a
        text-only request, whose row must still be reset). Three small staged host-to-device
        copies; called when the request is added, never per step."""
        images = sorted(images, key=lambda g: g.offset)
        if len(images) > self.max_items:
            raise ValueError(f"a request has {len(images)} images; at most {self.max_items}")
        cols: dict[str, list[int]] = {k: [] for k in ("offset", "length", "width", "area",
                                                       "start")}
        shifts = [0]
        for image in images:
            start = image.offset + shifts[-1]
            cols["offset"].append(image.offset)
            cols["length"].append(image.length)
            cols["width"].append(image.w)
            cols["area"].append(image.h * image.w)
            cols["start"].append(start)
            shifts.append(start + image.span - (image.offset + image.length))
        pad = self.max_items - len(images)
        fills = {"offset": _FAR, "length": 0, "width": 1, "area": 1, "start": 0}
        staged = to_device([values + [fills[name]] * pad for name, values in cols.items()],
                           torch.int64, self.device)  # pinned, non-blocking: no host sync
        for i, name in enumerate(cols):
            getattr(self, name)[row].copy_(staged[i])
        self.key[row].copy_(staged[0] + row * _ROW_STRIDE)
        self.shift[row].copy_(to_device(shifts + [shifts[-1]] * pad, torch.int64, self.device))
        self.interval[row].copy_(to_device([float(g.interval) for g in images] + [1.0] * pad,
                                           torch.float64, self.device))


def mrope_positions(positions: torch.Tensor, rows: torch.Tensor, table: MRopeTable,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``[3, T]`` M-RoPE positions of a step's tokens: 1-D ``positions`` ``[T]`` of tokens of
    the requests in ``rows`` ``[T]`` (state-table rows), through ``table``. Device ops only;
    written into ``out`` (``[3, >= T]`` int64) when given."""
    p = positions.to(torch.int64)
    rows = rows.to(torch.int64)
    # the last item of the row starting at or before p (binary search over the sorted keys)
    found = torch.searchsorted(table.key.view(-1), rows * _ROW_STRIDE + p, right=True) - 1
    first = rows * table.max_items
    has = found >= first
    k = (found - first).clamp(min=0)  # (0 where none: then masked out below)
    offset, length = table.offset[rows, k], table.length[rows, k]
    inside = has & (p < offset + length)
    before = torch.where(has, k + 1 - inside.to(torch.int64), 0)  # items passed
    text = p + table.shift[rows, before]  # [T]
    j = p - offset
    area, width = table.area[rows, k], table.width[rows, k]
    start, interval = table.start[rows, k], table.interval[rows, k]
    rem = j % area
    time = ((j // area).to(torch.float64) * interval).to(torch.int64)  # (j >= 0 inside: floor)
    image = torch.stack([start + time, start + rem // width, start + rem % width])
    result = torch.where(inside, image, text.expand(3, -1))
    if out is None:
        return result.contiguous()
    out[:, : result.shape[1]].copy_(result)
    return out[:, : result.shape[1]]


def frequency_components(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """``[sum(section)]`` int64: the position component (0 = t, 1 = h, 2 = w) each rotary
    frequency takes, in the chunked or the interleaved layout (module doc)."""
    s_t, s_h, s_w = (int(s) for s in section)
    if interleaved:
        layout = [1 if k % 3 == 1 and k < 3 * s_h else 2 if k % 3 == 2 and k < 3 * s_w else 0
                  for k in range(s_t + s_h + s_w)]
    else:
        layout = [0] * s_t + [1] * s_h + [2] * s_w
    return torch.tensor(layout, dtype=torch.int64, device="cpu")  # moved where it is used


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over ``[3, T]`` M-RoPE positions (``mrope_section``: frequencies per component,
    summing to ``rotary_dim / 2``; chunked or ``interleaved`` layout, see the module doc);
    ``[T]`` positions rotate as plain RoPE. ``rotary_dim`` (default the whole head): a partial
    rotation of each head's first dims, the rest passed through (GLM-4.1V / GLM-4.5V)."""

    def __init__(self, head_dim: int, max_position: int, mrope_section: Sequence[int],
                 base: float = 10000.0, scaling: Mapping[str, Any] | None = None,
                 interleaved: bool = False, positions: int | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__(head_dim, max_position, base, scaling, rotary_dim=rotary_dim,
                         positions=positions)
        section = [int(s) for s in mrope_section]
        if len(section) != 3 or sum(section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section must be 3 sizes summing to rotary_dim / 2 = "
                             f"{self.rotary_dim // 2}, got {list(mrope_section)}")
        self.mrope_section = section
        self.interleaved = interleaved
        self._component = frequency_components(section, interleaved)
        self._arange: torch.Tensor | None = None
        # The step's cos/sin rows, computed by the first layer of a forward and reused by the
        # others (every layer gets the same positions tensor object).
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None

    def step_cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, rotary_dim]`` cos | sin rows of ``[3, T]`` positions."""
        table = self._table(positions.device)
        half = self.rotary_dim // 2
        if self._component.device != positions.device:  # once, on the warm-up before any
            self._component = self._component.to(positions.device)  # graph capture
        component = self._component
        cols = torch.arange(half, device=positions.device)
        rows = positions.to(torch.int64)[component].T  # [T, half]: each frequency's position
        return torch.cat([table[rows, cols], table[rows, cols + half]], dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                qk_norm: Any = None, kv_write: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RotaryEmbedding.forward`, ``positions`` ``[3, T]`` (or ``[T]``)."""
        if positions.dim() == 1:
            return super().forward(positions, query, key, qk_norm, kv_write)
        num_tokens = positions.shape[1]
        if self._arange is None or self._arange.device != positions.device or (
                self._arange.numel() < num_tokens):
            self._arange = torch.arange(max(num_tokens, 1024), device=positions.device)
        if self._step is None or self._step[0] is not positions:
            self._step = (positions, self.step_cos_sin(positions))
        return rotary_embedding(self._arange[:num_tokens], query, key, self._step[1],
                                self.head_dim, self.rotary_dim, qk_norm, kv_write)


def get_mrope(config: Any, head_dim: int, *, interleaved: bool = False,
              default_section: Sequence[int] = (16, 24, 24),
              rotary_dim: int | None = None) -> MRotaryEmbedding:
    """The M-RoPE of a Qwen-VL text config (``mrope_section`` from ``rope_parameters`` or
    ``rope_scaling``; ``default_section`` when absent: HF's ``[16, 24, 24]`` for Qwen2.5-VL,
    ``[24, 20, 20]`` for Qwen3-VL). ``interleaved`` picks the layout (the family decides:
    HF's Qwen3-VL interleaves whatever the config's ``mrope_interleaved`` says).
    ``rotary_dim``: the rotated dims of each head where fewer than ``head_dim`` (GLM-4.1V's
    ``partial_rotary_factor``)."""
    base, scaling = rope_parameters_of(config)
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    section = params.get("mrope_section", list(default_section))
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            "mrope", "default"):
        scaling = None
    return MRotaryEmbedding(head_dim, int(config.max_position_embeddings), section, base,
                            scaling, interleaved, positions=context_limit(config)[0],
                            rotary_dim=rotary_dim)
