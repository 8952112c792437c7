"""Qwen2-VL vision encoder (the ``visual`` tower of ``Qwen2VLForConditionalGeneration``).

Plain PyTorch; numerically it follows the HF reference (transformers 5.17,
``Qwen2VisionTransformerPretrainedModel``) to fp32 round-off. Shares its attention, rope,
segment and loading helpers with the Qwen2.5-VL tower (:mod:`.vision`).

Config
------
Qwen2-VL's vision config names its sizes differently from Qwen2.5-VL's: ``embed_dim`` is the
tower width ``D``, ``hidden_size`` the *output* width (the text model's hidden size; there is
no ``out_hidden_size``), and the MLP width is ``int(embed_dim * mlp_ratio)`` (no
``intermediate_size``). On the tower, :attr:`~Qwen2VisionTower.hidden_size` is ``D`` and
:attr:`~Qwen2VisionTower.out_hidden_size` the output width, as on the other Qwen towers.

Data layout
-----------
Same as Qwen2.5-VL: ``pixel_values`` is ``[num_patches, C * T * P * P]`` (one ``(C, T, P, P)``
patch per row, C-major), rows of each frame in *merge-block order* (``m x m`` blocks row-major,
the ``m * m`` patches of a block row-major inside it), frames and images one after the other;
``grid_thw[i] = (t, h, w)`` in patches. Qwen2-VL's defaults: ``P = 14``, ``T = 2``, ``m = 2``.

Algorithm
---------
1. Patch embedding: the bias-free ``Conv3d`` (kernel == stride == the patch) is a linear map
   ``[N, C*T*P*P] -> [N, D]``; the ``[D, C, T, P, P]`` checkpoint weight is flattened.
2. Rotary embedding: the 2-D rope of Qwen2.5-VL (rows and columns each use the frequencies
   ``theta ** (-2k / (head_dim / 2))``; angles ``[row * f, col * f]`` duplicated to the head
   dim, rotate-half style, in fp32), ``theta`` from the vision config (10000). No learned
   position embedding.
3. Blocks: ``x += proj(attn(rope(qkv(ln1(x)))))``, ``x += fc2(act(fc1(ln2(x))))`` with
   LayerNorms (eps 1e-6, with bias), biased linears (``qkv`` included) and ``hidden_act``
   (``quick_gelu``: ``x * sigmoid(1.702 x)``). Attention is non-causal over each whole frame
   in every block (no window attention, so no reordering of the patches).
4. Merger: LayerNorm (eps 1e-6) over ``D`` per patch, then each ``m * m`` group of consecutive
   patches (one merge block) is concatenated to ``m*m*D`` and mapped by
   ``Linear -> GELU(erf) -> Linear`` to the output width.

The output, ``[sum(t*h*w) / m**2, out_hidden_size]``, is what the LLM consumes in place of the
image placeholder tokens (HF's ``pooler_output``, concatenated over images).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from mrv2_qwen_vl.vision import (
    CHECKPOINT_PREFIXES,
    QwenVisionBase,
    VisionPlan,
    _activation,
    _PatchEmbed,
    _VisionBlock,
    plan_vision_batch,
)

__all__ = ["CHECKPOINT_PREFIXES", "Qwen2VisionTower"]

# CHECKPOINT_PREFIXES (shared with Qwen2.5-VL): the Qwen2-VL release and 5.17's
# ``save_pretrained`` write ``visual.*``; transformers' in-memory names are ``model.visual.*``.

_NORM_EPS = 1e-6  # HF hard-codes this for every vision LayerNorm (not read from the config)


def _base_config(cfg: Any) -> SimpleNamespace:
    """Qwen2-VL's vision config in the names :class:`~mrv2_qwen_vl.vision.QwenVisionBase`
    reads (``hidden_size`` = the tower width ``embed_dim``, ``out_hidden_size`` = Qwen2-VL's
    ``hidden_size``)."""
    for field in ("embed_dim", "hidden_size", "depth", "patch_size"):
        if getattr(cfg, field, None) is None:
            raise ValueError(f"Qwen2-VL vision config has no {field!r}")
    return SimpleNamespace(
        hidden_size=cfg.embed_dim,
        out_hidden_size=cfg.hidden_size,
        num_heads=getattr(cfg, "num_heads", None) or cfg.num_attention_heads,
        depth=cfg.depth,
        in_channels=getattr(cfg, "in_channels", 3),
        patch_size=cfg.patch_size,
        temporal_patch_size=getattr(cfg, "temporal_patch_size", 2),
        spatial_merge_size=getattr(cfg, "spatial_merge_size", 2),
        rope_parameters=getattr(cfg, "rope_parameters", None),
        rope_theta=getattr(cfg, "rope_theta", 10000.0),
    )


class _VisionMlp(nn.Module):
    """``fc2(act(fc1(x)))``, both linears biased (HF's ``VisionMlp`` names)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=True)
        self.act = _activation(act)
        self.fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class _PatchMerger(nn.Module):
    """LayerNorm per patch, then ``m*m`` consecutive patches -> one ``out_dim`` token.
    Submodule names (``ln_q``, ``mlp.0``, ``mlp.2``) follow the checkpoint."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int) -> None:
        super().__init__()
        self.merged_dim = dim * merge_unit
        self.ln_q = nn.LayerNorm(dim, eps=_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))
        return out


class Qwen2VisionTower(QwenVisionBase):
    """The Qwen2-VL vision transformer: pixels of patches -> LLM-ready image tokens.

    Built from ``hf_config.vision_config`` (a ``Qwen2VLVisionConfig`` or any object with the
    same attributes: ``embed_dim``, ``hidden_size`` (output), ``depth``, ``num_heads``,
    ``mlp_ratio``, ``hidden_act``, ``patch_size``, ...). Parameter names mirror the
    checkpoint's (``patch_embed.proj``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,
    mlp.fc1,mlp.fc2}``, ``merger.{ln_q,mlp.0,mlp.2}``); ``patch_embed.proj.weight`` is kept
    2-D ``[D, C*T*P*P]``. ``hidden_size`` is the tower width (``embed_dim``),
    ``out_hidden_size`` the output width, ``patch_dim`` the width of a ``pixel_values`` row.
    Loading: :meth:`~mrv2_qwen_vl.vision.QwenVisionBase.load_weights`.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__(_base_config(vision_config))
        cfg = vision_config
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D rope)")
        self.mlp_hidden = int(self.hidden_size * getattr(cfg, "mlp_ratio", 4))  # as HF
        self.patch_dim = (self.in_channels * self.temporal_patch_size
                          * self.patch_size * self.patch_size)
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden_size, bias=False)
        act = str(getattr(cfg, "hidden_act", "quick_gelu"))
        self.blocks = nn.ModuleList(
            _VisionBlock(self.hidden_size, self.num_heads,
                         _VisionMlp(self.hidden_size, self.mlp_hidden, act),
                         lambda d: nn.LayerNorm(d, eps=_NORM_EPS))
            for _ in range(self.depth)
        )
        self.merger = _PatchMerger(self.hidden_size, self.out_hidden_size,
                                   self.spatial_merge_size**2)

    # ------------------------------------------------------------------ forward
    def plan(self, grid_thw: torch.Tensor | Sequence[Sequence[int]],
             device: torch.device | None = None) -> VisionPlan:
        """Index math and rope tables for ``grid_thw`` (on the host; can be built ahead of
        ``forward``): :func:`~mrv2_qwen_vl.vision.plan_vision_batch` with one window as large
        as the largest frame, so every frame is one window (``window_groups`` ==
        ``full_groups``: one segment per frame) and ``patch_order`` / ``token_restore`` are
        the identity, which :meth:`forward` therefore does not apply."""
        dev = device if device is not None else self.patch_embed.proj.weight.device
        grids = [tuple(int(v) for v in g) for g in (
            grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
        side = max((max(h, w) for _, h, w in grids), default=0) // self.spatial_merge_size
        return plan_vision_batch(
            grids, merge=self.spatial_merge_size, window_blocks=max(side, 1),
            head_dim=self.head_dim, rope_theta=self.rope_theta, device=dev)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
        plan: VisionPlan | None = None,
    ) -> torch.Tensor:
        """Encode a batch of images / videos.

        ``pixel_values``: ``[num_patches, C*T*P*P]`` (see the module docstring for the row
        order); cast to the weights' dtype. ``grid_thw``: ``[num_images, 3]`` ints.
        ``plan``: optional precomputed :meth:`plan` for this ``grid_thw``.
        Returns ``[num_patches / spatial_merge_size**2, out_hidden_size]``: the image tokens,
        image after image, each in its row-major merge-block order.
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
        for block in self.blocks:
            x = block(x, plan.cos, plan.sin, plan.full_groups)
        tokens: torch.Tensor = self.merger(x)
        return tokens
