"""Qwen3-VL vision encoder (the ``visual`` tower of ``Qwen3VLForConditionalGeneration``).

Plain PyTorch; numerically it follows the HF reference (transformers 5.17) to fp32 round-off.
Shares its attention, rope and segment helpers with the Qwen2.5-VL tower (:mod:`.vision`).

Data layout
-----------
Same as Qwen2.5-VL: ``pixel_values`` is ``[num_patches, C * T * P * P]`` (one ``(C, T, P, P)``
patch per row, C-major), rows of each frame in *merge-block order* (``m x m`` blocks row-major,
the ``m * m`` patches of a block row-major inside it), frames and images one after the other;
``grid_thw[i] = (t, h, w)`` in patches. Qwen3-VL's defaults: ``P = 16``, ``T = 2``, ``m = 2``.

Algorithm
---------
1. Patch embedding: the ``Conv3d`` (kernel == stride == the patch, *with* bias) is a linear
   map ``[N, C*T*P*P] -> [N, D]``; the ``[D, C, T, P, P]`` checkpoint weight is flattened.
2. Learned absolute position embedding: a ``side x side`` table (``side =
   sqrt(num_position_embeddings)``) resampled to each frame's ``h x w`` grid by bilinear
   interpolation with ``align_corners=True``: patch row ``r`` samples table row
   ``r * (side - 1) / max(h - 1, 1)`` (columns alike), i.e. four table rows with weights
   ``(1 - dy, dy) x (1 - dx, dx)`` (neighbours clamped to the table). Each patch gets the value
   of its own ``(row, col)``, so the result is already in merge-block order; every frame of a
   video gets the same embedding. It is added to the patch embedding.
3. Rotary embedding: the 2-D rope of Qwen2.5-VL (rows and columns each use the frequencies
   ``theta ** (-2k / (head_dim / 2))``; angles ``[row * f, col * f]`` duplicated to the head
   dim, rotate-half style, in fp32), ``theta`` from the vision config (10000).
4. Blocks: ``x += proj(attn(rope(qkv(ln1(x)))))``, ``x += fc2(act(fc1(ln2(x))))`` with
   LayerNorms (eps 1e-6, with bias), biased linears and ``hidden_act`` (``gelu_pytorch_tanh``).
   Attention is non-causal over each whole frame (no window attention in Qwen3-VL).
5. Deepstack: right after block ``i`` for each ``i`` in ``deepstack_visual_indexes``, a
   deepstack merger turns the block's output into LLM-sized tokens: each ``m * m`` group of
   consecutive patches is concatenated to ``m*m*D``, LayerNormed over those ``m*m*D``
   ("post-shuffle" norm), then ``Linear -> GELU(erf) -> Linear`` to ``out_hidden_size``.
6. Merger: the same after the last block but with the LayerNorm over ``D`` per patch, before
   the concatenation.

Outputs
-------
``forward`` returns ``(tokens, deepstack)``: ``tokens`` ``[num_patches / m**2,
out_hidden_size]`` replace the image placeholder tokens in the LLM input (HF's
``pooler_output``, concatenated over images); ``deepstack`` is a list of tensors of the same
shape, in *ascending block order* (HF appends them while running the blocks; for the released
checkpoints, ``[8, 16, 24]``, that is the config order). The text model adds ``deepstack[j]``
to the hidden states at the image-token positions right after decoder layer ``j`` (the whole
layer, residuals included), for ``j < len(deepstack)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2_qwen_vl.vision import (
    CHECKPOINT_PREFIXES,
    QwenVisionBase,
    _activation,
    _group_segments,
    _PatchEmbed,
    _to,
    _VisionBlock,
)

__all__ = ["Qwen3VisionTower", "Qwen3VisionPlan", "CHECKPOINT_PREFIXES",
           "plan_qwen3_vision_batch"]

# CHECKPOINT_PREFIXES (shared with Qwen2.5-VL): ``model.visual.`` is what 5.17's
# ``save_pretrained`` writes for Qwen3-VL and what the released checkpoints use; ``visual.``
# is accepted too.

_NORM_EPS = 1e-6  # HF hard-codes this for every vision LayerNorm


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(self.act(self.linear_fc1(x)))
        return out


class _Merger(nn.Module):
    """``m*m`` consecutive patches -> one ``out_dim`` token. The LayerNorm is over ``D`` per
    patch (main merger) or over the concatenated ``m*m*D`` (``postshuffle``, deepstack)."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = dim * merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else dim, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            h = self.norm(x.reshape(-1, self.merged_dim))
        else:
            h = self.norm(x).reshape(-1, self.merged_dim)
        out: torch.Tensor = self.linear_fc2(self.act(self.linear_fc1(h)))
        return out


@dataclass
class Qwen3VisionPlan:
    """Everything about a batch that depends only on ``grid_thw``.

    ``pos_index`` / ``pos_weight``: ``[num_patches, 4]`` rows of the learned position table and
    their (fp32) bilinear weights, per input row; ``groups``: per-frame attention segments (see
    ``mrv2_qwen_vl.vision._segment_attention``); ``cos`` / ``sin``: fp32
    ``[num_patches, head_dim]`` rope tables. Everything is in input (merge-block) order.
    """

    num_patches: int
    pos_index: torch.Tensor
    pos_weight: torch.Tensor
    groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor


def _axis_taps(coord: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (``align_corners=True``) taps into a ``side``-long table axis for positions
    ``coord`` on an axis of ``size`` patches: ``([n, 2]`` indices, ``[n, 2]`` fp32 weights)."""
    src = coord.float() * (side - 1) / max(size - 1, 1)
    lo = torch.floor(src)
    frac = src - lo
    taps = (lo.long()[:, None] + torch.arange(2)[None, :]).clamp(0, side - 1)
    # Weight of tap k is the hat kernel 1 - |src - (lo + k)|, as F.interpolate computes it.
    weights = torch.stack([1 - frac, 1 - (1 - frac).abs()], dim=-1).clamp(min=0)
    return taps, weights


def plan_qwen3_vision_batch(
    grid_thw: torch.Tensor | Sequence[Sequence[int]], *, merge: int, pos_side: int,
    head_dim: int, rope_theta: float, device: torch.device,
) -> Qwen3VisionPlan:
    """Build the :class:`Qwen3VisionPlan` for a batch of images / videos (index math on the
    CPU). ``merge``: spatial_merge_size; ``pos_side``: side of the learned position grid."""
    grids = [tuple(int(v) for v in g) for g in (
        grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    pos_index: list[torch.Tensor] = []
    pos_weight: list[torch.Tensor] = []
    frame_lens: list[int] = []
    for t, h, w in grids:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid (t, h, w)={(t, h, w)} must be positive with h, w "
                             f"divisible by spatial_merge_size={merge}")
        bh, bw = h // merge, w // merge
        # Patch coordinates in merge-block order: (block row, block col, in-row, in-col).
        r = (torch.arange(bh)[:, None, None, None] * merge
             + torch.arange(merge)[None, None, :, None]).expand(bh, bw, merge, merge).flatten()
        c = (torch.arange(bw)[None, :, None, None] * merge
             + torch.arange(merge)[None, None, None, :]).expand(bh, bw, merge, merge).flatten()
        r_taps, r_w = _axis_taps(r, h, pos_side)
        c_taps, c_w = _axis_taps(c, w, pos_side)
        # Taps ordered (r0, c0), (r0, c1), (r1, c0), (r1, c1).
        idx = (r_taps[:, :, None] * pos_side + c_taps[:, None, :]).reshape(-1, 4)
        wgt = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4)
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        pos_index.append(idx.repeat(t, 1))
        pos_weight.append(wgt.repeat(t, 1))
        frame_lens += [h * w] * t

    half = head_dim // 2
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    pos = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1).float()
    angles = (pos[:, :, None] * inv_freq).flatten(1)  # [N, head_dim/2]: rows | cols
    angles = torch.cat([angles, angles], dim=-1)
    return Qwen3VisionPlan(
        num_patches=int(pos.shape[0]),
        pos_index=_to(torch.cat(pos_index), device),
        pos_weight=_to(torch.cat(pos_weight), device),
        groups=_group_segments(frame_lens, device),
        cos=_to(angles.cos(), device),
        sin=_to(angles.sin(), device),
    )


class Qwen3VisionTower(QwenVisionBase):
    """The Qwen3-VL vision transformer: pixels of patches -> LLM-ready image tokens plus the
    deepstack features.

    Built from ``hf_config.vision_config`` (a ``Qwen3VLVisionConfig`` or any object with the
    same attributes). Parameter names mirror the checkpoint's (``patch_embed.proj``,
    ``pos_embed``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc{1,2}}``,
    ``merger.{norm,linear_fc1,linear_fc2}``, ``deepstack_merger_list.{j}.*``);
    ``patch_embed.proj.weight`` is kept 2-D ``[D, C*T*P*P]``. ``deepstack=False``: no
    deepstack mergers whatever the config lists (Qwen3.5's tower, whose config keeps
    Qwen3-VL's default ``deepstack_visual_indexes`` while its model has none).
    """

    def __init__(self, vision_config: Any, deepstack: bool = True) -> None:
        super().__init__(vision_config)
        cfg = vision_config
        self.num_position_embeddings = int(cfg.num_position_embeddings)
        self.pos_side = int(self.num_position_embeddings**0.5)  # as HF: the square's side
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D rope)")
        # deepstack_visual_indexes[j] is the block after which deepstack merger j runs. HF
        # emits the features in block order (first occurrence of a repeated index wins;
        # indexes outside [0, depth) never fire).
        self.deepstack_visual_indexes = ([int(i) for i in cfg.deepstack_visual_indexes]
                                         if deepstack else [])
        self._deepstack_after: dict[int, int] = {}
        for j, layer in enumerate(self.deepstack_visual_indexes):
            if 0 <= layer < self.depth:
                self._deepstack_after.setdefault(layer, j)

        self.patch_dim = (self.in_channels * self.temporal_patch_size
                          * self.patch_size * self.patch_size)
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(self.num_position_embeddings, self.hidden_size)
        act = str(getattr(cfg, "hidden_act", "gelu_pytorch_tanh"))
        self.blocks = nn.ModuleList(
            _VisionBlock(self.hidden_size, self.num_heads,
                         _MLP(self.hidden_size, int(cfg.intermediate_size), act),
                         lambda d: nn.LayerNorm(d, eps=_NORM_EPS))
            for _ in range(self.depth)
        )
        unit = self.spatial_merge_size**2
        self.merger = _Merger(self.hidden_size, self.out_hidden_size, unit, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(self.hidden_size, self.out_hidden_size, unit, postshuffle=True)
            for _ in self.deepstack_visual_indexes
        )

    @property
    def deepstack_layers(self) -> list[int]:
        """The vision blocks whose outputs become ``forward``'s deepstack features, in the
        order they are returned (one feature per LLM decoder layer ``0, 1, ...``)."""
        return sorted(self._deepstack_after)

    # ------------------------------------------------------------------ forward
    def plan(self, grid_thw: torch.Tensor | Sequence[Sequence[int]],
             device: torch.device | None = None) -> Qwen3VisionPlan:
        """Index math, interpolation weights and rope tables for ``grid_thw``."""
        dev = device if device is not None else self.patch_embed.proj.weight.device
        return plan_qwen3_vision_batch(
            grid_thw, merge=self.spatial_merge_size, pos_side=self.pos_side,
            head_dim=self.head_dim, rope_theta=self.rope_theta, device=dev)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
        plan: Qwen3VisionPlan | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode a batch of images / videos.

        ``pixel_values``: ``[num_patches, C*T*P*P]`` (see the module docstring for the row
        order); cast to the weights' dtype. ``grid_thw``: ``[num_images, 3]`` ints.
        ``plan``: optional precomputed :meth:`plan` for this ``grid_thw``.
        Returns ``(tokens, deepstack)``: ``tokens`` ``[num_patches / spatial_merge_size**2,
        out_hidden_size]`` (image after image, each in its row-major merge-block order) and
        one tensor of the same shape per entry of :attr:`deepstack_layers`, in that order.
        """
        if plan is None:
            plan = self.plan(grid_thw, pixel_values.device)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[num_patches, {self.patch_dim}]")
        if pixel_values.shape[0] != plan.num_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thw "
                             f"describes {plan.num_patches}")
        x = self.patch_embed(pixel_values)
        table = F.embedding(plan.pos_index, self.pos_embed.weight)  # [N, 4, D]
        x = x + (table * plan.pos_weight[:, :, None]).sum(1).to(x.dtype)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.groups)
            j = self._deepstack_after.get(i)
            if j is not None:
                deepstack.append(self.deepstack_merger_list[j](x))
        tokens: torch.Tensor = self.merger(x)
        return tokens, deepstack

    # ------------------------------------------------------------------ weights
