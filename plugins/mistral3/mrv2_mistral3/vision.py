"""Mistral 3's image encoder: the Pixtral vision tower and the multimodal projector of HF's
``Mistral3ForConditionalGeneration`` (Mistral Small 3.1 / 3.2), in plain torch (numerically
HF's, transformers 5.17), one image at a time.

Checkpoint names
----------------
The tower's tensors come under ``model.vision_tower.`` (transformers 5.17's in-memory names) or
``vision_tower.`` (the published files and 5.17's ``save_pretrained``): ``patch_conv.weight``
(a bias-free Conv2d), ``ln_pre.weight``, ``transformer.layers.{i}.{attention_norm,ffn_norm}
.weight``, ``transformer.layers.{i}.attention.{q,k,v,o}_proj.weight`` and
``transformer.layers.{i}.feed_forward.{gate,up,down}_proj.weight`` (all bias-free). The
projector's come under ``model.multi_modal_projector.`` or ``multi_modal_projector.``:
``norm.weight``, ``patch_merger.merging_layer.weight`` (``[D, D * m * m]``) and
``linear_{1,2}.weight`` (plus ``.bias`` with ``multimodal_projector_bias``). The module's
parameter names are the checkpoint's without ``model.``.

Computation
-----------
``h x w`` pixels (the image's real size; the processor pads a batch at the bottom and right)
make a ``H = h // P`` by ``W = w // P`` patch grid (``P = patch_size``). The conv embeds each
patch, row-major, then ``ln_pre``. Pre-norm layers follow: ``x += o(attn(q, k, v))`` over
``attention_norm(x)``, bidirectional over the image's patches (HF's block-diagonal mask over a
batch gives each image the same), then ``x += down(act(gate(y)) * up(y))`` with ``y =
ffn_norm(x)``. Attention has 2-D axial RoPE (rotate-half): of the ``head_dim / 2`` frequencies
``theta ** (-2 j / head_dim)``, the even ones turn with the patch's row, the odd ones with its
column (row angles first), in fp32, cast to the working dtype. The RMSNorms normalise in fp32,
round to the working dtype and scale by ``weight`` (the tower's eps 1e-5, the projector's
``text_config.rms_norm_eps``). HF's ``hidden_states[vision_feature_layer]`` is used: index 0
is ``ln_pre``'s output, ``i`` the ``i``-th layer's (negative from the end), so only that many
layers run. The projector normalises it, merges each ``m x m`` block of patches (``m =
spatial_merge_size``; rows and columns past a multiple of ``m`` dropped) into one token by
``merging_layer`` over the block's features ordered channel-major, then kernel row, then
kernel column, and applies ``linear_2(act(linear_1(t)))``: ``[(H // m) * (W // m),
text_hidden]``, row-major over the merged grid, the image's rows of HF's
``get_image_features(...).pooler_output``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.weights import load_encoder_weights, under_prefixes

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Mistral3VisionEncoder"]

_MODULES: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")
#: Checkpoint prefixes of the tower and the projector: transformers 5.17's in-memory names,
#: then the published (and ``save_pretrained``) layout's.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = tuple("model." + m for m in _MODULES) + _MODULES

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}
_TOWER_EPS = 1e-5  # hard-coded in HF's Pixtral


class _RMSNorm(nn.Module):
    """Normalised in fp32, rounded to the input's dtype, then scaled by ``weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0]
        q, k, v = (proj(x).view(seq, self.num_heads, -1)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, seq, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)  # no mask; scale head_dim ** -0.5
        projected: torch.Tensor = self.o_proj(out.transpose(0, 1).reshape(seq, -1))
        return projected


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]
                 ) -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Layer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = int(cfg.hidden_size)
        self.attention_norm = _RMSNorm(dim, _TOWER_EPS)
        self.attention = _Attention(dim, int(cfg.num_attention_heads))
        self.ffn_norm = _RMSNorm(dim, _TOWER_EPS)
        self.feed_forward = _FeedForward(dim, int(cfg.intermediate_size),
                                         _ACTIVATIONS[cfg.hidden_act])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class _Transformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(int(cfg.num_hidden_layers)))


class _VisionTower(nn.Module):
    """HF's ``PixtralVisionModel`` for one image, stopping after ``num_layers`` layers."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, self.patch_size = int(cfg.hidden_size), int(cfg.patch_size)
        self.patch_conv = nn.Conv2d(int(cfg.num_channels), dim, kernel_size=self.patch_size,
                                    stride=self.patch_size, bias=False)
        self.ln_pre = _RMSNorm(dim, _TOWER_EPS)
        self.transformer = _Transformer(cfg)
        self.head_dim = dim // int(cfg.num_attention_heads)
        self.rope_theta = float(cfg.rope_parameters["rope_theta"])

    def forward(self, pixels: torch.Tensor, rows: int, cols: int, num_layers: int
                ) -> torch.Tensor:
        x = self.patch_conv(pixels).flatten(1).T  # [rows * cols, D], row-major
        x = self.ln_pre(x)
        hd, f32 = self.head_dim, {"device": x.device, "dtype": torch.float32}
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, hd, 2, **f32) / hd)
        row_angles = torch.arange(rows, **f32)[:, None] * inv_freq[0::2]  # [rows, hd / 4]
        col_angles = torch.arange(cols, **f32)[:, None] * inv_freq[1::2]  # [cols, hd / 4]
        angles = torch.cat((row_angles[:, None].expand(rows, cols, -1),
                            col_angles[None].expand(rows, cols, -1)), dim=-1).flatten(0, 1)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [seq, 1, head_dim]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.transformer.layers[:num_layers]:
            x = layer(x, cos, sin)
        return x


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(dim * merge * merge, dim, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        m, dim = self.merge, x.shape[-1]
        grid = x.view(rows, cols, dim)[:rows // m * m, :cols // m * m]
        blocks = grid.reshape(rows // m, m, cols // m, m, dim).permute(0, 2, 4, 1, 3)
        out: torch.Tensor = self.merging_layer(blocks.reshape(-1, dim * m * m))
        return out


class _Projector(nn.Module):
    """HF's ``Mistral3MultiModalProjector`` for one image."""

    def __init__(self, config: Any, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        dim, text_dim = int(config.vision_config.hidden_size), int(config.text_config.hidden_size)
        bias = bool(config.multimodal_projector_bias)
        self.norm = _RMSNorm(dim, float(config.text_config.rms_norm_eps))
        self.patch_merger = _PatchMerger(dim, int(config.spatial_merge_size))
        self.linear_1 = nn.Linear(dim, text_dim, bias=bias)
        self.act = act
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        merged = self.patch_merger(self.norm(x), rows, cols)
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(merged)))
        return out


class Mistral3VisionEncoder(nn.Module):
    """One image -> its Mistral 3 image tokens: the Pixtral tower and the projector (module
    docstring). ``config`` is the composite ``Mistral3Config`` (its ``vision_config``,
    ``text_config.{hidden_size,rms_norm_eps}``, ``vision_feature_layer``,
    ``spatial_merge_size``, ``projector_hidden_act``, ``multimodal_projector_bias``).
    ``patch_size`` and ``merge`` (``spatial_merge_size``) are in pixels / patches. ValueError
    naming the config field for a setting HF's code does not run as this does."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        if vc is None or getattr(vc, "model_type", None) != "pixtral":
            raise ValueError(f"vision_config.model_type {getattr(vc, 'model_type', None)!r}: "
                             "only a Pixtral vision tower is supported")
        rope = dict(vc.rope_parameters or {})
        if rope.get("rope_type") != "axial" or "rope_theta" not in rope:
            raise ValueError(f"vision_config.rope_parameters {rope}: axial with a rope_theta only")
        dim, heads = int(vc.hidden_size), int(vc.num_attention_heads)
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision_config.hidden_size {dim} / vision_config."
                             f"num_attention_heads {heads}: the head size must be a whole "
                             "multiple of 4 (2-D RoPE)")
        if not isinstance(vc.patch_size, int):
            raise ValueError(f"vision_config.patch_size {vc.patch_size!r}: an int only")
        for field, act in (("vision_config.hidden_act", vc.hidden_act),
                           ("projector_hidden_act", config.projector_hidden_act)):
            if act not in _ACTIVATIONS:
                raise ValueError(f"unsupported {field} {act!r}")
        self.patch_size, self.merge = int(vc.patch_size), int(config.spatial_merge_size)
        if self.merge < 1:
            raise ValueError(f"spatial_merge_size {self.merge} must be >= 1")
        layer = config.vision_feature_layer
        if isinstance(layer, (list, tuple)):
            if len(layer) != 1:  # HF concatenates them, then its projector's norm fails
                raise ValueError(f"vision_feature_layer {layer}: one layer only")
            layer = layer[0]
        depth = int(vc.num_hidden_layers)
        if not isinstance(layer, int) or not -(depth + 1) <= layer <= depth:
            raise ValueError(f"vision_feature_layer {layer!r}: an index into the {depth + 1} "
                             "hidden states (ln_pre's output, then each layer's)")
        self.num_layers = layer % (depth + 1)  # the layers run
        self.vision_tower = _VisionTower(vc)
        self.multi_modal_projector = _Projector(config, _ACTIVATIONS[config.projector_hidden_act])

    def forward(self, pixel_values: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image: ``pixel_values [C, H, W]`` (any float dtype, cast to the parameters';
        the processor's padded tensor for it, or already cropped) and ``image_size = (h, w)``,
        its real size in pixels (``h <= H``, ``w <= W``; the processor makes them multiples of
        ``patch_size * merge``) -> ``[(h // P // m) * (w // P // m), text_hidden_size]`` in the
        parameters' dtype: the image's rows of HF's ``get_image_features(...).pooler_output``,
        row-major over the merged grid. Reads nothing back from the device. ValueError for
        shapes or sizes the processor would not give."""
        height, width = (int(v) for v in image_size)
        p, m = self.patch_size, self.merge
        channels = self.vision_tower.patch_conv.in_channels
        if pixel_values.dim() != 3 or pixel_values.shape[0] != channels:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[{channels}, H, W]")
        if not (p * m <= height <= pixel_values.shape[1]
                and p * m <= width <= pixel_values.shape[2]):
            raise ValueError(f"image_size {(height, width)}: must be at least {p * m} "
                             f"(patch_size * spatial_merge_size) and fit pixel_values "
                             f"{tuple(pixel_values.shape)}")
        rows, cols = height // p, width // p
        weight = self.vision_tower.patch_conv.weight
        pixels = pixel_values[:, :rows * p, :cols * p].to(weight.dtype)
        x = self.vision_tower(pixels, rows, cols, self.num_layers)
        out: torch.Tensor = self.multi_modal_projector(x, rows, cols)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`; others ignored) and return the parameter names
        loaded. ValueError naming the tensor for a name under those prefixes that matches no
        parameter, or a shape mismatch."""
        return load_encoder_weights(self, weights, under_prefixes(VISION_CHECKPOINT_PREFIXES),
                                    "Mistral 3 vision encoder",
                                    hint="multimodal_projector_bias / the layer count")
