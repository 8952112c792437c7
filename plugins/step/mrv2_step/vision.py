"""Step-3.7's image encoder, numerically HF transformers' ``Step3p7VisionModel`` and
``multi_modal_projector`` (5.17).

- **Tower**: a bias-free patch Conv2d (stride = kernel = ``patch_size``, 14) over an ``H x W``
  view (``H``, ``W`` multiples of 56), the learned position table (a square grid of
  ``image_size / patch_size`` a side) added, bilinearly resized to the view's grid where it
  differs (HF's ``interpolate_pos_encoding``: the 504-pixel local crops of a 728-pixel
  tower), ``pre_layernorm``, then ``num_hidden_layers`` pre-norm layers, each ``x + lambda_1 *
  attn(layernorm_before(x))``, then ``+ lambda_2 * mlp(layernorm_after(x))`` (``quick_gelu``
  MLP of ``hidden_size * mlp_ratio``). Attention is bidirectional over the view's patches,
  q and k rotated by a 2-D RoPE: the first half of each head's rotary pairs by the patch's
  row, the second by its column, ``rope_theta ** (-4k / head_dim)`` (GPT-NeoX halves, HF's
  in-memory layout).
- **Downsampler**: two 3 x 3 Conv2d of stride 2 and padding 1 (``hidden -> 2 hidden -> 4
  hidden``): a ``g x g`` grid of patches gives ``ceil(ceil(g / 2) / 2)**2`` features.
- **Projector**: ``multi_modal_projector`` (``vit_large_projector`` in the checkpoint), one
  linear ``4 * hidden -> text hidden`` (biased where ``projector_bias``).

Checkpoint names: the published OpenCLIP layout (``vision_model.conv1`` /
``positional_embedding`` / ``ln_pre`` / ``transformer.resblocks.{i}.{ln_1, ln_2, attn.in_proj_*,
attn.out_proj, ls_1.gamma, ls_2.gamma, mlp.c_fc, mlp.c_proj}`` / ``vit_downsampler{1,2}``,
``vit_large_projector``; what ``save_pretrained`` writes too), q and k rows reordered from the
checkpoint's interleaved rotary pairs into halves (HF's ``PermuteForRope``); or transformers'
in-memory names (``model.vision_model.*``, ``model.multi_modal_projector.*``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.vision import VisionMLP, vision_activation
from mrv2.layers.weights import load_encoder_weights

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Step3p7VisionEncoder", "features_per_side"]

#: Checkpoint prefixes of the tower and the projector (published, then in-memory names).
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "vision_model.", "vit_large_projector.", "model.vision_model.",
    "model.multi_modal_projector.")
#: Published tower names -> HF's in-memory ones (after ``vision_model.``).
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^conv1\.weight$", "embeddings.patch_embedding.weight"),
    (r"^positional_embedding$", "embeddings.position_embedding.weight"),
    (r"^transformer\.resblocks\.", "layers."), (r"^ln_pre\.", "pre_layernorm."),
    (r"^vit_downsampler1\.", "downsampler1."), (r"^vit_downsampler2\.", "downsampler2."),
    (r"\.ls_1\.gamma$", ".lambda_1"), (r"\.ls_2\.gamma$", ".lambda_2"),
    (r"\.mlp\.c_fc\.", ".mlp.fc1."), (r"\.mlp\.c_proj\.", ".mlp.fc2."),
    (r"\.attn\.", ".self_attn."), (r"\.ln_1\.", ".layernorm_before."),
    (r"\.ln_2\.", ".layernorm_after."))


def features_per_side(pixels: int, patch: int) -> int:
    """Features a side of a ``pixels``-wide view: its ``pixels // patch`` patches halved twice
    (rounded up) by the downsampler."""
    return math.ceil(math.ceil((pixels // patch) / 2) / 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    """Bidirectional attention with q and k rotated by the 2-D RoPE (fp32 rotation, as HF)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision_config.hidden_size {dim} / num_attention_heads {heads}: "
                             "the head size must be a multiple of 4 (2-D RoPE)")
        self.num_heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, seq, dim = x.shape
        q, k, v = (proj(x).view(n, seq, self.num_heads, -1)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        c, s = cos[:, None], sin[:, None]  # [seq, 1, head_dim]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(n, seq, dim))
        return projected


class _Layer(nn.Module):
    """One pre-norm layer with layer scales (``lambda_1`` / ``lambda_2``)."""

    def __init__(self, dim: int, heads: int, hidden: int, act: Any, eps: float) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.mlp = VisionMLP(dim, hidden, act)
        self.layernorm_before = nn.LayerNorm(dim, eps=eps)
        self.layernorm_after = nn.LayerNorm(dim, eps=eps)
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.self_attn(self.layernorm_before(x), cos, sin)
        out: torch.Tensor = x + self.lambda_2 * self.mlp(self.layernorm_after(x))
        return out


class _Embeddings(nn.Module):
    """The bias-free patch Conv2d and the learned position table."""

    def __init__(self, channels: int, dim: int, grid: int, patch: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch,
                                         bias=False)
        self.position_embedding = nn.Embedding(grid * grid, dim)
        self.grid = grid

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The table for a ``rows x cols`` grid (bilinearly resized where it differs)."""
        table = self.position_embedding.weight
        if (rows, cols) == (self.grid, self.grid):
            return table
        dim = table.shape[-1]
        grid = table.view(1, self.grid, self.grid, dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(rows * cols, dim)


class _Tower(nn.Module):
    """HF's ``Step3p7VisionModel`` (module doc)."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim, eps = int(vc.hidden_size), float(vc.layer_norm_eps)
        heads = int(vc.num_attention_heads)
        act = vision_activation("vision_config.hidden_act", str(vc.hidden_act))
        self.patch = int(vc.patch_size)
        self.embeddings = _Embeddings(int(getattr(vc, "num_channels", 3)), dim,
                                      int(vc.image_size) // self.patch, self.patch)
        self.pre_layernorm = nn.LayerNorm(dim, eps=eps)
        self.layers = nn.ModuleList(_Layer(dim, heads, int(vc.intermediate_size), act, eps)
                                    for _ in range(int(vc.num_hidden_layers)))
        self.downsampler1 = nn.Conv2d(dim, dim * 2, kernel_size=3, stride=2, padding=1)
        self.downsampler2 = nn.Conv2d(dim * 2, dim * 4, kernel_size=3, stride=2, padding=1)
        rope = getattr(vc, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        quarter = dim // heads // 2
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32) / quarter), persistent=False)

    def rotary(self, rows: int, cols: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[rows * cols, head_dim]`` of the row-major grid (module doc)."""
        r, c = torch.meshgrid(torch.arange(rows, device=device),
                              torch.arange(cols, device=device), indexing="ij")
        pos = torch.stack((r.flatten(), c.flatten()), dim=-1).float()  # [seq, 2]
        freqs = (pos[..., None] * self.inv_freq.float()).flatten(1)  # [seq, head_dim / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, features, 4 * hidden]``, row-major."""
        n = pixels.shape[0]
        rows, cols = pixels.shape[2] // self.patch, pixels.shape[3] // self.patch
        conv = self.embeddings.patch_embedding
        x = conv(pixels.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        x = self.pre_layernorm(x + self.embeddings.positions(rows, cols))
        cos, sin = self.rotary(rows, cols, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = x.transpose(1, 2).reshape(n, -1, rows, cols)
        x = self.downsampler2(self.downsampler1(x))
        return x.flatten(2).transpose(1, 2)


class Step3p7VisionEncoder(nn.Module):
    """Step-3.7's views -> image tokens: :class:`_Tower` (``vision_model``) and the
    projector (``multi_modal_projector``); module doc. ``config``: the composite
    ``Step3p7Config``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.vision_model = _Tower(vc)
        self.num_heads = int(vc.num_attention_heads)
        self.patch = int(vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.multi_modal_projector = nn.Linear(
            int(vc.hidden_size) * 4, int(config.text_config.hidden_size),
            bias=bool(getattr(config, "projector_bias", False)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` views (``H``, ``W`` multiples of ``4 * patch_size``) ->
        ``[N * features, text_hidden]``, view by view."""
        side = 4 * self.patch
        if (pixel_values.dim() != 4 or pixel_values.shape[1] != self.num_channels
                or pixel_values.shape[2] % side or pixel_values.shape[3] % side):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[N, {self.num_channels}, H, W], H and W multiples of {side}")
        out: torch.Tensor = self.multi_modal_projector(self.vision_model(pixel_values))
        return out.flatten(0, 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's tensors (module doc's names); ValueError naming
        the tensor for one that matches nothing or mismatches."""
        return load_encoder_weights(self, self._converted(weights), self._target,
                                    "Step-3.7 vision encoder", hint="vision_config")

    def _converted(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """Published names as in-memory ones, ``in_proj`` split into q / k / v with q and k
        rows reordered into rotary halves."""
        for name, tensor in weights:
            if name.startswith("vit_large_projector."):
                yield "multi_modal_projector." + name.removeprefix("vit_large_projector."), tensor
                continue
            if not name.startswith("vision_model."):
                yield name.removeprefix("model."), tensor
                continue
            rest = name.removeprefix("vision_model.")
            for pattern, new in _RENAMES:
                rest = re.sub(pattern, new, rest)
            fused = re.match(r"(.*\.self_attn\.)in_proj_(weight|bias)$", rest)
            if fused is None:
                yield "vision_model." + rest, tensor
                continue
            for kind, part in zip(("q", "k", "v"), tensor.chunk(3, dim=0), strict=True):
                if kind != "v":
                    part = self._halves(part)
                yield f"vision_model.{fused.group(1)}{kind}_proj.{fused.group(2)}", part

    def _halves(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each head's interleaved rotary pairs ``(2j, 2j+1)`` as rows ``j`` and
        ``j + head_dim / 2``."""
        rows = tensor.shape[0]
        half = rows // self.num_heads // 2
        view = tensor.reshape(self.num_heads, half, 2, *tensor.shape[1:])
        return view.transpose(1, 2).reshape(tensor.shape)

    def _target(self, name: str) -> str | None:
        if name.endswith("embeddings.position_ids"):
            return None
        return name if name.startswith(("vision_model.", "multi_modal_projector.")) else None
