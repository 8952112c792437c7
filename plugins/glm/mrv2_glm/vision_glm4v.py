"""The vision tower of GLM-4.1V (``Glm4vForConditionalGeneration``) and GLM-4.5V / 4.6V
(``Glm4vMoeForConditionalGeneration``, the same tower), as transformers 5.17 models it.

Plain PyTorch. Input rows are the image processor's patches in merge-block order (as
Qwen2-VL's: ``[num_patches, C * T * P * P]``, every ``m * m`` consecutive rows one merge
block, ``m = spatial_merge_size``), ``grid_thw`` each item's grid in patches.

1. Patch embedding: the ``Conv3d`` whose kernel is the whole patch, a biased linear map over
   the flattened patch (the ``[D, C, T, P, P]`` checkpoint weight flattened on load), then an
   RMSNorm (``post_conv_layernorm``).
2. Learned position embedding: the ``image_size / patch_size`` square table of
   ``embeddings.position_embedding`` resampled at each patch's centre by ``grid_sample``
   (bicubic, ``align_corners=False``, border padding; in fp32), the image's ``h x w`` patch
   grid mapped onto the table's ``[-1, 1]`` square, and added.
3. Blocks: ``x += proj(attn(rope(qkv(rms1(x)))))``, ``x += down(act(gate(h)) * up(h))``
   (``h = rms2(x)``; the MLP ``out_hidden_size`` wide, no biases; ``qkv`` biased per
   ``attention_bias``); attention is non-causal within each frame, rotated by the 2-D RoPE of
   Qwen's towers (a quarter of the head's frequencies by the patch row, the same by its
   column, halves layout, fp32).
4. ``post_layernorm``, the downsample ``Conv2d`` (kernel = stride = ``m``: one merge block
   into one ``out_hidden_size`` token; a linear map over the block here, its weight flattened
   on load), then the merger: ``proj``, LayerNorm, GELU, and a
   gated MLP of ``intermediate_size``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2_qwen_vl.vision import (
    GatedVisionMLP,
    _apply_rope,
    _as_int,
    _group_segments,
    _PatchEmbed,
    _RMSNorm,
    _rope_theta,
    _segment_attention,
    _to,
    load_tower_weights,
)

__all__ = ["Glm4vVisionTower", "patch_coordinates"]


def patch_coordinates(grids: Sequence[tuple[int, int, int]], merge: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` int64 ``[num_patches]``: each patch's row and column in its frame, in
    merge-block order (frames of an item repeat the same coordinates)."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        c = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        rows.append(r.flatten().repeat(t))
        cols.append(c.flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: Sequence[torch.Tensor]) -> torch.Tensor:
        seq = x.shape[0]
        q, k, v = self.qkv(x).view(seq, 3, self.num_heads, self.head_dim).unbind(1)
        out = _segment_attention(_apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v, groups,
                                 self.head_dim**-0.5)
        projected: torch.Tensor = self.proj(out.reshape(seq, -1))
        return projected


class _Block(nn.Module):
    def __init__(self, cfg: Any, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(dim, eps)
        self.norm2 = _RMSNorm(dim, eps)
        self.attn = _Attention(dim, num_heads, bool(getattr(cfg, "attention_bias", False)))
        self.mlp = GatedVisionMLP(dim, int(cfg.out_hidden_size), str(cfg.hidden_act), bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: Sequence[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _Merger(GatedVisionMLP):
    """``proj``, LayerNorm, GELU (erf), then a gated MLP of ``hidden`` without biases
    (checkpoint names)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__(dim, hidden, act, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class _PositionEmbedding(nn.Module):
    """The learned square position table (``position_embedding``), resampled per image
    (module doc, step 2)."""

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__()
        self.side = math.isqrt(num_positions)
        if self.side * self.side != num_positions:
            raise ValueError(f"vision image_size / patch_size gives {num_positions} positions, "
                             "not a square")
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor,
                widths: torch.Tensor) -> torch.Tensor:
        """``[N, dim]``: the table at each patch (``rows`` / ``cols`` its coordinates,
        ``heights`` / ``widths`` its image's grid, all ``[N]``), in the table's dtype."""
        weight = self.position_embedding.weight
        table = weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        x = (cols + 0.5) / widths * 2 - 1
        y = (rows + 0.5) / heights * 2 - 1
        grid = torch.stack((x, y), dim=-1)[None, :, None, :]  # [1, N, 1, 2]
        out = F.grid_sample(table, grid, mode="bicubic", align_corners=False,
                            padding_mode="border")  # [1, dim, N, 1]
        return out[0, :, :, 0].T.to(weight.dtype)


class Glm4vVisionTower(nn.Module):
    """GLM-4.1V's vision transformer (module doc): patches -> LLM-ready image tokens. Built
    from ``hf_config.vision_config``; parameter names follow the checkpoint's (``patch_embed``,
    ``post_conv_layernorm``, ``embeddings.position_embedding``, ``blocks.{i}``,
    ``post_layernorm``, ``downsample``, ``merger``)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(getattr(cfg, "num_heads", None) or cfg.num_attention_heads)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads "
                             f"{self.num_heads} must be a head dim divisible by 4 (2-D rope)")
        self.head_dim = self.hidden_size // self.num_heads
        self.in_channels = int(getattr(cfg, "in_channels", 3))
        self.patch_size = _as_int(cfg.patch_size, "patch_size")
        self.temporal_patch_size = _as_int(getattr(cfg, "temporal_patch_size", 2),
                                           "temporal_patch_size")
        self.spatial_merge_size = int(getattr(cfg, "spatial_merge_size", 2))
        self.out_hidden_size = int(cfg.out_hidden_size)
        self.rope_theta = _rope_theta(cfg)
        eps = float(getattr(cfg, "rms_norm_eps", 1e-5))
        image_size = _as_int(getattr(cfg, "image_size", 336), "image_size")

        self.patch_dim = (self.in_channels * self.temporal_patch_size
                          * self.patch_size * self.patch_size)
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden_size, bias=True)
        self.post_conv_layernorm = _RMSNorm(self.hidden_size, eps)
        self.embeddings = _PositionEmbedding((image_size // self.patch_size) ** 2,
                                             self.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg, self.hidden_size, self.num_heads, eps)
                                    for _ in range(int(cfg.depth)))
        self.post_layernorm = _RMSNorm(self.hidden_size, eps)
        m = self.spatial_merge_size
        # the Conv2d of kernel = stride = m over one merge block, as a linear map (weight
        # flattened on load): one GEMM, and no cuDNN TF32 convolution in fp32
        self.downsample = nn.Linear(self.hidden_size * m * m, self.out_hidden_size)
        self.merger = _Merger(self.out_hidden_size, int(cfg.intermediate_size),
                              str(cfg.hidden_act))

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """``[sum(t * h * w) / m**2, out_hidden_size]``: the image tokens of the items whose
        patch rows ``pixel_values`` holds in order (grids ``grid_thw``), item after item,
        each in merge-block order."""
        grids = [(int(t), int(h), int(w)) for t, h, w in (
            grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
        m = self.spatial_merge_size
        for t, h, w in grids:
            if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
                raise ValueError(f"grid (t, h, w)={(t, h, w)} must be positive with h, w "
                                 f"divisible by spatial_merge_size={m}")
        num = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (num, self.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[{num}, {self.patch_dim}] for grids {grids}")
        device = pixel_values.device
        rows, cols = patch_coordinates(grids, m)
        counts = torch.tensor([t * h * w for t, h, w in grids])
        sizes = torch.tensor([[h, w] for _, h, w in grids],
                             dtype=torch.float32).repeat_interleave(counts, dim=0)
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float)
                                              / half))
        angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = _to(angles.cos(), device), _to(angles.sin(), device)
        groups = _group_segments([h * w for t, h, w in grids for _ in range(t)], device)

        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        x = x + self.embeddings(_to(rows, device), _to(cols, device),
                                _to(sizes[:, 0].contiguous(), device),
                                _to(sizes[:, 1].contiguous(), device))
        for block in self.blocks:
            x = block(x, cos, sin, groups)
        x = self.post_layernorm(x)
        d = self.hidden_size
        x = self.downsample(x.view(-1, m, m, d).permute(0, 3, 1, 2).reshape(-1, d * m * m))
        out: torch.Tensor = self.merger(x)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors under ``model.visual.`` or ``visual.`` (others ignored); the
        Conv3d patch weight and the Conv2d downsample weight flattened. ValueError naming the
        parameter on a shape mismatch or an unknown name
        (:func:`~mrv2_qwen_vl.vision.load_tower_weights`)."""
        conv = (self.hidden_size, self.in_channels, self.temporal_patch_size,
                self.patch_size, self.patch_size)

        def flat(pairs: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                if name.endswith("downsample.weight") and tensor.dim() == 4:
                    tensor = tensor.reshape(tensor.shape[0], -1)  # [out, D * m * m]: (D, i, j)
                yield name, tensor

        return load_tower_weights(self, flat(weights), conv)
