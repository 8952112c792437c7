"""Qwen2.5-VL vision encoder (the ``visual`` tower of ``Qwen2_5_VLForConditionalGeneration``).

Plain PyTorch; no kernels of our own. Numerically it follows the HF reference
(transformers 5.17) to fp32 round-off.

Data layout
-----------
``pixel_values`` is the image processor's output: one row per *patch*,
``[num_patches, C * T * P * P]`` where each row is a ``(C, T, P, P)`` block flattened
C-major (channels, temporal_patch_size frames, patch_size rows, patch_size cols). Rows of
one image (or video) come in *merge-block order*: the ``h x w`` patch grid of each frame is
cut into ``m x m`` blocks (``m = spatial_merge_size``), blocks are listed row-major and the
``m * m`` patches inside a block are listed row-major, so every ``m * m`` consecutive rows form
one block (one future LLM token). Frames follow each other, images follow each other.
``grid_thw[i] = (t, h, w)`` is image ``i``'s grid in patches (``t`` = frames / T).

Algorithm
---------
1. Patch embedding: HF's ``Conv3d`` has kernel == stride == the whole patch, so it is a
   bias-free linear map ``[N, C*T*P*P] -> [N, D]``; the ``[D, C, T, P, P]`` checkpoint
   weight is flattened on load.
2. Window reordering: each frame's grid of merge blocks (``h/m x w/m``) is tiled by windows
   of ``window_size // (m * patch_size)`` blocks per side (the last row / column of windows
   may be narrower). Blocks are reordered window by window (windows row-major, blocks
   row-major inside a window); the whole stack then runs in this order.
3. Rotary embedding: 2-D rope over each patch's ``(row, col)`` in its frame. A quarter of
   the head dim's frequencies (``theta ** (-2k / (head_dim / 2))``) is used for rows and
   the same frequencies for columns: angles are ``[row * f, col * f]`` duplicated to fill
   the head dim, applied rotate-half style (NeoX) to q and k in fp32.
4. Blocks: ``x += proj(attn(rope(qkv(rms1(x)))))``, ``x += down(silu(gate(h)) * up(h))`` with
   ``h = rms2(x)``; all linears carry a bias. Blocks listed in ``fullatt_block_indexes``
   attend over the whole frame (each frame of each image is one segment), the others only
   within their window. Attention is non-causal.
5. Merger: RMSNorm over ``D``, then each ``m * m`` group of consecutive patches (one merge
   block) is concatenated to ``m*m*D`` and mapped by ``Linear -> GELU(erf) -> Linear`` to
   ``out_hidden_size``; the merged tokens are put back into the input's block order.

The output, ``[sum(t*h*w) / m**2, out_hidden_size]``, is what the LLM consumes in place of
the image placeholder tokens (HF's ``pooler_output``; its ``last_hidden_state`` is the
pre-merger stack output left in *window* order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.staging import to_device
from mrv2.layers.weights import load_encoder_weights

__all__ = ["CHECKPOINT_PREFIXES", "Qwen25VisionTower", "QwenVisionBase", "VisionPlan",
           "load_tower_weights", "plan_vision_batch"]

# Where the tower's weights live in checkpoints: transformers 5.x in-memory / state-dict
# names first, then the original Qwen release (also what ``save_pretrained`` writes in 5.17).
CHECKPOINT_PREFIXES: tuple[str, ...] = ("model.visual.", "visual.")

_NORM_EPS = 1e-6  # HF hard-codes this for every vision RMSNorm (not read from the config)


def _activation(name: str) -> nn.Module:
    acts: dict[str, nn.Module] = {
        "silu": nn.SiLU(),
        "swish": nn.SiLU(),
        "gelu": nn.GELU(),
        "gelu_pytorch_tanh": nn.GELU(approximate="tanh"),
        "quick_gelu": _QuickGELU(),
    }
    if name not in acts:
        raise ValueError(f"unsupported vision hidden_act {name!r}")
    return acts[name]


class _QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _as_int(value: Any, field: str) -> int:
    """A config field that HF types as ``int | list[int]`` but is a scalar in practice."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision config {field}={value!r}: only square/cubic sizes supported")
        value = value[0]
    return int(value)


def _rope_theta(vision_config: Any) -> float:
    params = getattr(vision_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(vision_config, "rope_theta", 10000.0))


class _RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the normalised value is cast back before the weight scale."""

    def __init__(self, dim: int, eps: float = _NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _PatchEmbed(nn.Module):
    """The Conv3d patchifier as a linear over the flattened ``(C, T, P, P)`` patch (biased in
    Qwen3-VL, not in Qwen2.5-VL)."""

    def __init__(self, in_features: int, dim: int, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x.to(self.proj.weight.dtype))
        return out


class GatedVisionMLP(nn.Module):
    """A vision tower's gated MLP, ``down_proj(act(gate_proj(x)) * up_proj(x))`` (HF's names),
    the three linears biased or not (Qwen2.5-VL's blocks: biased; GLM-4.1V's blocks and
    merger: not)."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat((-hi, lo), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[S, H, Dh]``; ``cos``/``sin``: fp32 ``[S, Dh]``. Rotated in fp32, cast back."""
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    return (xf * c + _rotate_half(xf) * s).to(x.dtype)


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Non-causal attention within segments. ``q, k, v``: ``[S, H, Dh]``. ``groups``: one
    ``[B, L]`` row-index tensor per distinct segment length ``L`` (row ``b`` lists segment
    ``b``'s rows), so each group is one batched SDPA call."""
    if len(groups) == 1 and groups[0].shape[0] == 1:  # one segment spanning every row
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        return out.squeeze(0).transpose(0, 1)
    out = torch.empty_like(q)
    for rows in groups:
        qb, kb, vb = (t[rows].transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
        ob = F.scaled_dot_product_attention(qb, kb, vb, scale=scale)
        out[rows] = ob.transpose(1, 2)
    return out


class _VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision hidden_size {dim} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        groups: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        seq = x.shape[0]
        # qkv output is [q heads | k heads | v heads], each head contiguous.
        q, k, v = self.qkv(x).view(seq, 3, self.num_heads, self.head_dim).unbind(1)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        out = _segment_attention(q, k, v, groups, self.head_dim**-0.5)
        projected: torch.Tensor = self.proj(out.reshape(seq, -1))
        return projected


class _VisionBlock(nn.Module):
    """Pre-norm block: ``x += attn(norm1(x))``, ``x += mlp(norm2(x))`` (Qwen2.5-VL: RMSNorm
    and a gated MLP; Qwen3-VL passes LayerNorms and its plain MLP)."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module,
                 norm: Callable[[int], nn.Module] = lambda d: _RMSNorm(d)) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = _VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        groups: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _PatchMerger(nn.Module):
    """RMSNorm per patch, then ``m*m`` consecutive patches -> one ``out_dim`` token.
    Submodule names (``ln_q``, ``mlp.0``, ``mlp.2``) follow the checkpoint."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int) -> None:
        super().__init__()
        self.merged_dim = dim * merge_unit
        self.ln_q = _RMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))
        return out


@dataclass
class VisionPlan:
    """Everything about a batch that depends only on ``grid_thw`` (index math, rope tables).

    ``patch_order[j]`` is the input row placed at position ``j`` of the window order;
    ``token_restore[i]`` is the window-order position of merged token ``i`` (input order).
    ``window_groups`` / ``full_groups`` are the segment row-index groups (see
    :func:`_segment_attention`) for windowed and full-attention blocks. ``cos``/``sin`` are
    fp32 ``[num_patches, head_dim]`` in window order.
    """

    num_patches: int
    patch_order: torch.Tensor
    token_restore: torch.Tensor
    window_groups: list[torch.Tensor]
    full_groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A plan's CPU tensor on ``device`` without a host sync (pinned, non-blocking)."""
    return to_device(tensor, tensor.dtype, device)


def _group_segments(lengths: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Row-index tensors ``[B, L]`` grouping consecutive segments by their length ``L``."""
    by_len: dict[int, list[int]] = {}
    start = 0
    for n in lengths:
        by_len.setdefault(n, []).append(start)
        start += n
    return [
        _to(torch.tensor(starts)[:, None] + torch.arange(n)[None, :], device)
        for n, starts in by_len.items()
    ]


def plan_vision_batch(
    grid_thw: torch.Tensor | Sequence[Sequence[int]], *, merge: int, window_blocks: int,
    head_dim: int, rope_theta: float, device: torch.device,
) -> VisionPlan:
    """Build the :class:`VisionPlan` for a batch of images / videos (index math on the CPU).

    ``merge``: spatial_merge_size; ``window_blocks``: window side in merge blocks
    (``window_size // (merge * patch_size)``)."""
    grids = [tuple(int(v) for v in g) for g in (
        grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
    unit = merge * merge
    block_order: list[torch.Tensor] = []
    window_lens: list[int] = []
    full_lens: list[int] = []
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    offset = 0  # in merge blocks
    for t, h, w in grids:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid (t, h, w)={(t, h, w)} must be positive with h, w "
                             f"divisible by spatial_merge_size={merge}")
        bh, bw = h // merge, w // merge
        # Sort the frame's blocks by (window row, window col, row in window, col in window).
        br = torch.arange(bh)[:, None].expand(bh, bw)
        bc = torch.arange(bw)[None, :].expand(bh, bw)
        n_wc = -(-bw // window_blocks)
        win = (br // window_blocks) * n_wc + bc // window_blocks
        key = (win * window_blocks + br % window_blocks) * window_blocks + bc % window_blocks
        frame_order = torch.argsort(key.flatten())
        lens = [n * unit for n in torch.bincount(win.flatten()).tolist()]
        for f in range(t):
            block_order.append(frame_order + offset + f * bh * bw)
            window_lens += lens
            full_lens.append(h * w)
        offset += t * bh * bw
        # Patch coordinates in merge-block order: (block row, block col, in-row, in-col).
        r = (torch.arange(bh)[:, None, None, None] * merge
             + torch.arange(merge)[None, None, :, None]).expand(bh, bw, merge, merge)
        c = (torch.arange(bw)[None, :, None, None] * merge
             + torch.arange(merge)[None, None, None, :]).expand(bh, bw, merge, merge)
        rows.append(r.flatten().repeat(t))
        cols.append(c.flatten().repeat(t))

    blocks = torch.cat(block_order)
    patch_order = (blocks[:, None] * unit + torch.arange(unit)[None, :]).flatten()
    # Frequencies exactly as the reference builds them (fp32, python-float base).
    half = head_dim // 2
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    pos = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1)[patch_order].float()
    angles = (pos[:, :, None] * inv_freq).flatten(1)  # [N, head_dim/2]: rows | cols
    angles = torch.cat([angles, angles], dim=-1)
    return VisionPlan(
        num_patches=int(patch_order.numel()),
        patch_order=_to(patch_order, device),
        token_restore=_to(torch.argsort(blocks), device),
        window_groups=_group_segments(window_lens, device),
        full_groups=_group_segments(full_lens, device),
        cos=_to(angles.cos(), device),
        sin=_to(angles.sin(), device),
    )


class QwenVisionBase(nn.Module):
    """What both Qwen vision towers read from their config (sizes of the patches, the blocks
    and the merge) and how they load checkpoint tensors."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(getattr(cfg, "num_heads", None) or cfg.num_attention_heads)
        self.head_dim = self.hidden_size // self.num_heads
        self.depth = int(cfg.depth)
        self.in_channels = int(getattr(cfg, "in_channels", 3))
        self.patch_size = _as_int(cfg.patch_size, "patch_size")
        self.temporal_patch_size = _as_int(getattr(cfg, "temporal_patch_size", 2),
                                           "temporal_patch_size")
        self.spatial_merge_size = int(getattr(cfg, "spatial_merge_size", 2))
        self.out_hidden_size = int(cfg.out_hidden_size)
        self.rope_theta = _rope_theta(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the tower; return the names of the parameters loaded.

        Accepts names under any of :data:`CHECKPOINT_PREFIXES` (``model.visual.`` as in
        transformers 5.x state dicts and Qwen3-VL files, ``visual.`` as in the Qwen2.5-VL
        release and 5.17's ``save_pretrained`` files); other names are ignored. The Conv3d
        patch weight ``[D, C, T, P, P]`` is flattened. A shape mismatch or an unknown name
        under the prefix raises ``ValueError`` naming the parameter
        (:func:`load_tower_weights`)."""
        conv = (self.hidden_size, self.in_channels, self.temporal_patch_size,
                self.patch_size, self.patch_size)
        return load_tower_weights(self, weights, conv)


class Qwen25VisionTower(QwenVisionBase):
    """The Qwen2.5-VL vision transformer: pixels of patches -> LLM-ready image tokens.

    Built from ``hf_config.vision_config`` (a ``Qwen2_5_VLVisionConfig`` or any object with
    the same attributes). Parameter names mirror the checkpoint's (``patch_embed.proj``,
    ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.{gate,up,down}_proj}``,
    ``merger.{ln_q,mlp.0,mlp.2}``); ``patch_embed.proj.weight`` is kept 2-D ``[D, C*T*P*P]``.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__(vision_config)
        cfg = vision_config
        self.window_size = int(cfg.window_size)
        self.fullatt_block_indexes = frozenset(
            int(i) for i in getattr(cfg, "fullatt_block_indexes", ()) or ())
        self.window_blocks = self.window_size // (self.spatial_merge_size * self.patch_size)
        if self.window_blocks < 1:
            raise ValueError(f"window_size {self.window_size} is smaller than one merge block "
                             f"({self.spatial_merge_size} x {self.patch_size} px)")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D rope)")

        self.patch_dim = (self.in_channels * self.temporal_patch_size
                          * self.patch_size * self.patch_size)
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden_size, bias=False)
        act = str(getattr(cfg, "hidden_act", "silu"))
        self.blocks = nn.ModuleList(
            _VisionBlock(self.hidden_size, self.num_heads,
                         GatedVisionMLP(self.hidden_size, int(cfg.intermediate_size), act))
            for _ in range(self.depth)
        )
        self.merger = _PatchMerger(self.hidden_size, self.out_hidden_size,
                                   self.spatial_merge_size**2)

    # ------------------------------------------------------------------ forward
    def plan(self, grid_thw: torch.Tensor | Sequence[Sequence[int]],
             device: torch.device | None = None) -> VisionPlan:
        """Index math and rope tables for ``grid_thw`` (can be built ahead of ``forward``)."""
        dev = device if device is not None else self.patch_embed.proj.weight.device
        return plan_vision_batch(
            grid_thw, merge=self.spatial_merge_size, window_blocks=self.window_blocks,
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
        x = self.patch_embed(pixel_values[plan.patch_order])
        for i, block in enumerate(self.blocks):
            groups = plan.full_groups if i in self.fullatt_block_indexes else plan.window_groups
            x = block(x, plan.cos, plan.sin, groups)
        tokens: torch.Tensor = self.merger(x)
        return tokens[plan.token_restore]

    # ------------------------------------------------------------------ weights


def load_tower_weights(tower: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       conv_shape: tuple[int, ...]) -> set[str]:
    """Load a vision tower's checkpoint tensors (names under :data:`CHECKPOINT_PREFIXES`;
    others ignored, as are rope tables); the Conv3d patch weight of ``conv_shape`` is
    flattened. Returns the parameter names loaded; ValueError naming the parameter on a shape
    mismatch or an unknown name under the prefix."""
    def target(ckpt_name: str) -> str | None:
        name = next((ckpt_name[len(p):] for p in CHECKPOINT_PREFIXES
                     if ckpt_name.startswith(p)), None)
        return None if name is None or name.startswith("rotary_pos_emb.") else name

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name != "patch_embed.proj.weight" or tensor.dim() != 5:
            return tensor
        if tuple(tensor.shape) != tuple(conv_shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected Conv3d shape "
                             f"{tuple(conv_shape)}")
        return tensor.reshape(conv_shape[0], -1)

    return load_encoder_weights(tower, weights, target, "vision tower", convert=convert)
