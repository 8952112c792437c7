"""Gemma 4's image encoder: the vision tower and the vision embedder of HF's
``Gemma4ForConditionalGeneration``, in plain torch (numerically HF's, transformers 5.17), one
image at a time.

Checkpoint names
----------------
The tower's tensors come under ``model.vision_tower.`` (transformers 5.17's in-memory names and
its ``save_pretrained``) or ``vision_tower.`` (the older layout without ``model.``):
``patch_embedder.input_proj.weight`` (``[D, 3 * P * P]``, no bias),
``patch_embedder.position_embedding_table`` (``[2, position_embedding_size, D]``: x, then y),
``encoder.layers.{i}.{input_layernorm,post_attention_layernorm,pre_feedforward_layernorm,
post_feedforward_layernorm}.weight``, ``encoder.layers.{i}.self_attn.{q_norm,k_norm}.weight``,
``encoder.layers.{i}.{self_attn.{q,k,v,o}_proj,mlp.{gate,up,down}_proj}.linear.weight`` and,
with ``use_clipped_linears``, those projections' scalar buffers ``input_min``, ``input_max``,
``output_min``, ``output_max``; with ``standardize``, the buffers ``std_bias`` and
``std_scale`` (``[D]``). The embedder's come under ``model.embed_vision.`` or
``embed_vision.``: ``embedding_projection.weight`` (``[text_hidden, D]``). The module's
parameter and buffer names are the checkpoint's without ``model.``. Buffers not in the
checkpoint keep HF's init (clip bounds at +-inf, bias 0, scale 1).

Computation
-----------
The processor gives an image as ``max_patches`` rows of ``P * P * 3`` pixels in [0, 1] (each
patch row-major, channels last) and their ``(x, y)`` patch coordinates, ``(-1, -1)`` for the
padding rows. Padding rows are dropped up front: HF masks them as keys, and its pooler zeroes
them, so they change nothing. Each patch is mapped to ``2 * p - 1``, projected by
``input_proj``, and ``table[0][x] + table[1][y]`` is added. Encoder layers with Gemma's
sandwich norms follow (RMSNorms in fp32, scaled by ``weight`` itself, not ``1 + weight``):
``x += post_attention_layernorm(attn(input_layernorm(x)))``, then ``x +=
post_feedforward_layernorm(down(act(gate(h)) * up(h)))`` with ``h = pre_feedforward_layernorm(x)``.
Every projection is a bias-free linear whose input and output are clamped to the saved bounds
when ``use_clipped_linears``. Attention is bidirectional over the image's patches with
per-head RMSNormed ``q`` and ``k`` (scaled), ``v`` (unscaled), softmax scale 1 and 2-D axial
RoPE: the first half of each head's channels rotates by ``x``, the second by ``y``, each half
as rotate-half RoPE with frequencies ``rope_theta ** (-4 i / head_dim)``. The pooler averages
``k x k`` blocks of patches (``k = pooling_kernel_size``; block ``(x // k) + (W // k) * (y //
k)`` with ``W`` the patch width: the soft tokens row-major), in fp32, rounds to the working
dtype and multiplies by ``sqrt(D)`` in fp32; ``standardize`` then applies ``(t - std_bias) *
std_scale`` in fp32. The embedder RMS-normalises (no scale) and projects to the text hidden
size: ``[W * H / k**2, text_hidden]``, the rows of HF's ``get_image_features(...)
.pooler_output`` for that image.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.weights import load_encoder_weights, under_prefixes

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Gemma4VisionEncoder"]

_MODULES: tuple[str, ...] = ("vision_tower.", "embed_vision.")
#: Checkpoint prefixes of the tower and the embedder: transformers 5.17's names, then the
#: layout without ``model.``.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = tuple("model." + m for m in _MODULES) + _MODULES

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class _RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: normalised in fp32, scaled by ``weight`` (if any), cast back."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.type_as(x)


class _ClippableLinear(nn.Module):
    """A bias-free linear (``linear.weight``), its input and output clamped to the saved
    bounds when ``clipped``."""

    input_min: torch.Tensor
    input_max: torch.Tensor
    output_min: torch.Tensor
    output_max: torch.Tensor

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "output_min"):
                self.register_buffer(name, torch.tensor(-math.inf))
            for name in ("input_max", "output_max"):
                self.register_buffer(name, torch.tensor(math.inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        out: torch.Tensor = self.linear(x)
        if self.clipped:
            out = torch.clamp(out, self.output_min, self.output_max)
        return out


def _rotate_axes(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half applied to each half (x axis, y axis) of the last dimension."""
    x = x.unflatten(-1, (2, 2, -1))
    return torch.stack((-x[..., 1, :], x[..., 0, :]), dim=-2).flatten(-3)


class _Attention(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.num_heads, self.head_dim = int(cfg.num_attention_heads), int(cfg.head_dim)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"vision num_attention_heads {self.num_heads} not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = _ClippableLinear(dim, q_dim, clipped)
        self.k_proj = _ClippableLinear(dim, kv_dim, clipped)
        self.v_proj = _ClippableLinear(dim, kv_dim, clipped)
        self.o_proj = _ClippableLinear(q_dim, dim, clipped)
        self.q_norm = _RMSNorm(self.head_dim, eps)
        self.k_norm = _RMSNorm(self.head_dim, eps)
        self.v_norm = _RMSNorm(self.head_dim, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(seq, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(seq, -1, self.head_dim))
        v = self.v_norm(self.v_proj(x).view(seq, -1, self.head_dim))
        q, k = (t * cos + _rotate_axes(t) * sin for t in (q, k))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, seq, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, scale=1.0, enable_gqa=self.num_heads != self.num_kv_heads)
        projected: torch.Tensor = self.o_proj(out[0].transpose(0, 1).reshape(seq, -1))
        return projected


class _MLP(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim, hidden = int(cfg.hidden_size), int(cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_activation]
        self.gate_proj = _ClippableLinear(dim, hidden, clipped)
        self.up_proj = _ClippableLinear(dim, hidden, clipped)
        self.down_proj = _ClippableLinear(hidden, dim, clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.input_layernorm = _RMSNorm(dim, eps)
        self.self_attn = _Attention(cfg, clipped)
        self.post_attention_layernorm = _RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = _RMSNorm(dim, eps)
        self.mlp = _MLP(cfg, clipped)
        self.post_feedforward_layernorm = _RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        out: torch.Tensor = x + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(x)))
        return out


class _PatchEmbedder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = int(cfg.hidden_size)
        self.input_proj = nn.Linear(3 * int(cfg.patch_size) ** 2, dim, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, int(cfg.position_embedding_size), dim))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        out: torch.Tensor = x + (table[0][positions[:, 0]] + table[1][positions[:, 1]])
        return out


class _Encoder(nn.Module):
    def __init__(self, layers: Iterable[_EncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class _VisionTower(nn.Module):
    """HF's ``Gemma4VisionModel`` before pooling (the pooler, which has no weights, is
    :meth:`Gemma4VisionEncoder.forward`'s)."""

    std_bias: torch.Tensor
    std_scale: torch.Tensor

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        clipped, dim = bool(cfg.use_clipped_linears), int(cfg.hidden_size)
        self.patch_embedder = _PatchEmbedder(cfg)
        self.encoder = _Encoder(
            _EncoderLayer(cfg, clipped) for _ in range(int(cfg.num_hidden_layers)))
        self.standardize = bool(cfg.standardize)
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(dim))
            self.register_buffer("std_scale", torch.ones(dim))
        self.rope_theta, self.head_dim = float(cfg.rope_parameters["rope_theta"]), int(cfg.head_dim)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedder(pixels, positions)
        half = self.head_dim // 2  # frequencies in fp32 whatever the dtype, as HF loads them
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, half, 2, device=x.device, dtype=torch.float32) / half)
        angles = positions.float()[:, :, None] * inv_freq  # [seq, 2 axes, head_dim / 4]
        angles = torch.cat((angles[:, 0], angles[:, 0], angles[:, 1], angles[:, 1]), dim=-1)
        cos, sin = (f(angles).to(x.dtype)[:, None] for f in (torch.cos, torch.sin))
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        return x


class _Embedder(nn.Module):
    """HF's ``Gemma4MultimodalEmbedder`` of the vision tower."""

    def __init__(self, dim: int, text_dim: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = _RMSNorm(dim, eps, with_scale=False)
        self.embedding_projection = nn.Linear(dim, text_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embedding_projection(self.embedding_pre_projection_norm(x))
        return out


class Gemma4VisionEncoder(nn.Module):
    """One image's patches -> its Gemma 4 soft tokens: the vision tower, the pooler and the
    vision embedder (module docstring). ``config`` is the composite ``Gemma4Config`` (its
    ``vision_config`` and ``text_config.hidden_size``). ValueError naming the config field
    for a setting HF's code does not run as this does."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        if vc is None:
            raise ValueError("vision_config is None: the checkpoint has no vision tower")
        rope = dict(vc.rope_parameters or {})
        if rope.get("rope_type", "axial") != "axial" or "rope_theta" not in rope:
            raise ValueError(f"vision_config.rope_parameters {rope}: axial with a rope_theta only")
        if int(vc.head_dim) % 4:
            raise ValueError(f"vision_config.head_dim {vc.head_dim} must be a multiple of 4")
        if vc.hidden_activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision_config.hidden_activation "
                             f"{vc.hidden_activation!r}")
        if int(vc.pooling_kernel_size) < 2:
            raise ValueError(f"vision_config.pooling_kernel_size {vc.pooling_kernel_size}: HF's "
                             "pooler keeps the padding rows, not the image's, without pooling")
        dim = int(vc.hidden_size)
        if int(getattr(vc, "output_proj_dims", dim)) != dim:
            raise ValueError(f"vision_config.output_proj_dims {vc.output_proj_dims} != "
                             f"hidden_size {dim}")
        self.patch_size, self.kernel = int(vc.patch_size), int(vc.pooling_kernel_size)
        self.vision_tower = _VisionTower(vc)
        self.embed_vision = _Embedder(dim, int(config.text_config.hidden_size),
                                      float(vc.rms_norm_eps))

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor,
                grid: tuple[int, int] | None = None) -> torch.Tensor:
        """One image as the processor gives it: ``pixel_values [max_patches, 3 * P * P]`` (any
        float dtype) and ``position_ids [max_patches, 2]`` (``(x, y)``; ``(-1, -1)`` for
        padding) -> ``[num_soft_tokens, text_hidden_size]`` in the parameters' dtype: the
        image's rows of HF's ``get_image_features(...).pooler_output``. ValueError for shapes
        or positions the processor would not give.

        ``grid``: the image's ``(width, height)`` in patches, known on the host (the engine's
        model state reads it from the CPU positions): the real patches are then the first
        ``width * height`` rows (the processor pads at the end), taken as they are (checked
        by the caller), and nothing reads the device tensors back (no host sync)."""
        if grid is not None:
            width, height = grid
            real_rows = width * height
            positions = position_ids[:real_rows].long()
            x = self.vision_tower(pixel_values[:real_rows], positions)
            return self._tokens(x, positions, width, real_rows // (self.kernel**2))
        k, dim = self.kernel, self.vision_tower.patch_embedder.input_proj.in_features
        max_patches = pixel_values.shape[0]
        if (pixel_values.dim() != 2 or pixel_values.shape[1] != dim
                or tuple(position_ids.shape) != (max_patches, 2) or max_patches % (k * k)):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} / position_ids "
                             f"{tuple(position_ids.shape)}: expected [max_patches, {dim}] / "
                             f"[max_patches, 2], max_patches a multiple of {k * k}")
        real = (position_ids != -1).any(-1)
        positions = position_ids[real].long()
        if positions.shape[0] == 0:
            raise ValueError("position_ids: no patch that is not padding")
        width, height = (int(m) + 1 for m in positions.max(0).values.tolist())
        table_size = self.vision_tower.patch_embedder.position_embedding_table.shape[1]
        if (positions.min() < 0 or width % k or height % k or max(width, height) > table_size
                or positions.shape[0] != width * height):
            raise ValueError(f"position_ids: the non-padding patches must make a {k}-divisible "
                             f"grid from (0, 0) within the position embeddings, got {width} x "
                             f"{height} for {positions.shape[0]} patches")
        x = self.vision_tower(pixel_values[real], positions)
        return self._tokens(x, positions, width, positions.shape[0] // (k * k))

    def _tokens(self, x: torch.Tensor, positions: torch.Tensor, width: int,
                count: int) -> torch.Tensor:
        """The tower's output over the real patches -> the ``count`` soft tokens."""
        tokens = self._pool(x, positions, width, count)
        tower = self.vision_tower
        if tower.standardize:
            tokens = (tokens - tower.std_bias.float()) * tower.std_scale.float()
        out: torch.Tensor = self.embed_vision(tokens.to(x.dtype))
        return out

    def _pool(self, x: torch.Tensor, positions: torch.Tensor, width: int,
              length: int) -> torch.Tensor:
        """HF's pooler: ``k x k`` block means (fp32, then rounded to ``x``'s dtype) times
        ``sqrt(D)`` in fp32, for the blocks holding patches, in block order."""
        k = self.kernel
        blocks = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
        # (a whole grid's blocks are 0 .. length - 1, each holding k * k patches)
        weights = F.one_hot(blocks, length).float() / (k * k)  # [patches, length]
        pooled = weights.T @ x.float()
        return pooled.to(x.dtype).float() * x.shape[-1] ** 0.5

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the embedder's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`; others ignored) and return the names of the
        parameters and buffers loaded. ValueError naming the tensor for a name under those
        prefixes that matches none of them, or a shape mismatch."""
        return load_encoder_weights(self, weights, under_prefixes(VISION_CHECKPOINT_PREFIXES),
                                    "Gemma 4 vision encoder", buffers=True,
                                    hint="use_clipped_linears / standardize")
