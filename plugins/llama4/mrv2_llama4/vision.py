"""Llama 4's image encoder: HF's ``Llama4VisionModel`` and ``Llama4MultiModalProjector``
(transformers 5.17's ``modeling_llama4.py``) in plain torch, one image's tiles at a time.

Tower
-----
Each ``S x S`` tile (``S = vision_config.image_size``, 336) is cut into ``n x n`` patches of
``P = patch_size`` pixels (``n = S // P``: 24), row-major, by an unfold (channel, then kernel
row, then kernel column) and a linear map without bias (``patch_embedding.linear``). A
learned ``class_embedding`` is appended *after* the patches, ``positional_embedding_vlm``
(``[n * n + 1, D]``) added, then ``layernorm_pre``. Pre-norm layers follow (``x +=
o_proj(attn(input_layernorm(x)))``, ``x += fc2(gelu(fc1(post_attention_layernorm(x))))``; all
projections biased; the exact GELU, whatever ``hidden_act`` says, as HF hard-codes it), with
attention bidirectional over the tile's ``n * n + 1`` tokens (scale ``head_dim ** -0.5``) and
a 2-D RoPE on q and k: of each head's ``head_dim / 2`` complex pairs ``(x0, x1), (x2, x3),
...``, pair ``j < head_dim / 4`` turns by ``(col + 1) * f_j`` and pair ``head_dim / 4 + j`` by
``(row + 1) * f_j``, ``f_j = rope_theta ** (-4 j / head_dim)``; the class token does not
turn. The rotation is HF's complex product in fp32, cast back. ``layernorm_post`` closes the
tower and the class token is dropped. Every LayerNorm has eps 1e-5 (``nn.LayerNorm``'s
default, as HF builds them; ``norm_eps`` is not read by HF either).

Adapter and projector
---------------------
HF's ``pixel_shuffle`` folds each ``k x k`` block of the patch grid (``k = 1 /
pixel_shuffle_ratio``: 2) into one token of ``D * k * k`` channels (``(n / k)**2`` tokens a
tile: 144), in HF's exact channel order; ``vision_adapter.mlp`` maps it by ``fc2(gelu(fc1(t)))``
then a GELU again (no biases), and ``multi_modal_projector.linear_1`` (no bias) to the text
model's ``hidden_size``. The tiles' tokens, tile by tile, fill the prompt's ``<|patch|>``
positions in order, as HF's ``masked_scatter`` does.

Tensor parallelism: the encoder is replicated (every rank holds and runs all of it; it runs
once per image, outside the decode step).

Checkpoint names: ``vision_model.<name>`` and ``multi_modal_projector.linear_1.weight`` (the
published layout and transformers 5.17's, in memory and saved), also under ``model.``. The
module's parameter names are those without ``model.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.vision import VisionMLP
from mrv2.layers.weights import load_encoder_weights, under_prefixes

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Llama4VisionEncoder", "pixel_shuffle", "rope_angles",
           "shuffle_factor", "tile_side", "tokens_per_tile"]

#: Checkpoint prefixes of the tower and the projector: transformers' in-memory names under a
#: ``model.`` wrapper, then the published (and ``save_pretrained``) layout.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "model.vision_model.", "model.multi_modal_projector.", "vision_model.",
    "multi_modal_projector.")
_EPS = 1e-5  # nn.LayerNorm's default: HF's vision layer norms take no eps


def _side(field: str, value: Any) -> int:
    """An int or a square ``(h, w)`` size as one side; ValueError naming ``field``
    otherwise."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) \
            or sides[0] < 1:
        raise ValueError(f"vision_config.{field} = {value!r}: a positive int (square) only")
    return int(sides[0])


def tile_side(vc: Any) -> int:
    """The tower's tile side ``S`` (``vision_config.image_size``); ValueError naming the field
    for a size that is not one positive int (or a square pair)."""
    return _side("image_size", vc.image_size)


def shuffle_factor(vc: Any) -> int:
    """``k = 1 / pixel_shuffle_ratio`` (2 in Scout); ValueError naming the field where the
    ratio is not ``1 / k`` for a whole ``k`` dividing the patch grid's side."""
    ratio = float(vc.pixel_shuffle_ratio)
    factor = round(1 / ratio) if ratio > 0 else 0
    side = _side("image_size", vc.image_size) // _side("patch_size", vc.patch_size)
    if factor < 1 or abs(factor * ratio - 1) > 1e-9 or side % factor:
        raise ValueError(f"vision_config.pixel_shuffle_ratio = {vc.pixel_shuffle_ratio!r}: "
                         f"must be 1 / k for a whole k dividing the {side} patches a side "
                         "(image_size // patch_size)")
    return factor


def tokens_per_tile(vc: Any) -> int:
    """The ``<|patch|>`` tokens of one tile: ``(n / k)**2`` (module doc)."""
    side = _side("image_size", vc.image_size) // _side("patch_size", vc.patch_size)
    return (side // shuffle_factor(vc)) ** 2


def rope_angles(side: int, head_dim: int, theta: float) -> torch.Tensor:
    """The 2-D RoPE angles ``[side * side + 1, head_dim / 2]`` (fp32, on the CPU) of a tile's
    patches (row-major) and its class token (last, all 0), as HF's
    ``Llama4VisionRotaryEmbedding`` computes them (module doc)."""
    quarter, cpu = head_dim // 4, torch.device("cpu")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, device=cpu)[:quarter].float()
                             / (head_dim // 2)))
    index = torch.arange(side * side, dtype=torch.int32, device=cpu)
    cols, rows = (index % side + 1)[:, None], (index // side + 1)[:, None]
    angles = torch.cat([cols * freqs[None], rows * freqs[None]], dim=-1)
    return torch.cat([angles, angles.new_zeros(1, 2 * quarter)])


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """HF's ``pixel_shuffle`` with ratio ``1 / factor``: ``[T, n * n, C]`` -> ``[T, (n /
    factor)**2, C * factor**2]``, op for op."""
    tiles, count, channels = x.shape
    side, k = int(round(count ** 0.5)), factor
    x = x.view(tiles, side, side, channels).view(tiles, side, side // k, channels * k)
    x = x.permute(0, 2, 1, 3).contiguous().view(tiles, side // k, side // k, channels * k * k)
    return x.permute(0, 2, 1, 3).contiguous().view(tiles, -1, channels * k * k)


class _Attention(nn.Module):
    """Bidirectional attention with the 2-D RoPE on q and k; biased projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    @staticmethod
    def _rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * turns[None, :, None, :]).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        tiles, seq, dim = x.shape
        q, k, v = (proj(x).view(tiles, seq, self.num_heads, -1)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self._rotate(q, turns), self._rotate(k, turns)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(tiles, seq, dim))
        return projected


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.mlp = VisionMLP(dim, hidden, F.gelu)
        self.input_layernorm = nn.LayerNorm(dim, eps=_EPS)
        self.post_attention_layernorm = nn.LayerNorm(dim, eps=_EPS)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), turns)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Encoder(nn.Module):
    def __init__(self, layers: Iterable[_Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class _PatchEmbedding(nn.Module):
    """HF's ``Llama4UnfoldConvolution``: unfold, then a linear map without bias."""

    def __init__(self, channels: int, patch: int, dim: int) -> None:
        super().__init__()
        self.patch = patch
        self.linear = nn.Linear(channels * patch * patch, dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cols = F.unfold(pixels, kernel_size=self.patch, stride=self.patch)
        out: torch.Tensor = self.linear(cols.permute(0, 2, 1))
        return out


class _AdapterMLP(nn.Module):
    """HF's ``Llama4VisionMLP2``: ``gelu(fc2(gelu(fc1(x))))``, no biases."""

    def __init__(self, in_dim: int, mid_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, mid_dim, bias=False)
        self.fc2 = nn.Linear(out_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class _Adapter(nn.Module):
    """HF's ``Llama4VisionPixelShuffleMLP``."""

    def __init__(self, vc: Any, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.mlp = _AdapterMLP(int(vc.intermediate_size), int(vc.projector_input_dim),
                               int(vc.projector_output_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(pixel_shuffle(x, self.factor))
        return out


class _VisionModel(nn.Module):
    """HF's ``Llama4VisionModel`` (module doc); ``forward`` takes tiles ``[T, C, S, S]`` of
    the parameters' dtype and the RoPE turns."""

    def __init__(self, vc: Any, factor: int) -> None:
        super().__init__()
        dim, channels = int(vc.hidden_size), int(getattr(vc, "num_channels", 3))
        patch = _side("patch_size", vc.patch_size)
        side = _side("image_size", vc.image_size) // patch
        self.patch_embedding = _PatchEmbedding(channels, patch, dim)
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(side * side + 1, dim))
        self.layernorm_pre = nn.LayerNorm(dim, eps=_EPS)
        self.layernorm_post = nn.LayerNorm(dim, eps=_EPS)
        heads, hidden = int(vc.num_attention_heads), int(vc.intermediate_size)
        self.model = _Encoder(_Layer(dim, heads, hidden)
                              for _ in range(int(vc.num_hidden_layers)))
        self.vision_adapter = _Adapter(vc, factor)

    def forward(self, pixels: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)
        cls = self.class_embedding.expand(x.shape[0], 1, x.shape[-1])
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)
        x = self.layernorm_pre(x)
        for layer in self.model.layers:
            x = layer(x, turns)
        x = self.layernorm_post(x)[:, :-1]
        out: torch.Tensor = self.vision_adapter(x)
        return out


class _Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_1(x)
        return out


class Llama4VisionEncoder(nn.Module):
    """Tiles -> Llama 4's image tokens: the tower, the pixel-shuffle adapter and the projector
    (module doc). ``config`` is the composite ``Llama4Config`` (its ``vision_config`` and
    ``text_config.hidden_size``); ValueError naming the field for a setting HF's model does
    not run as this does (HF fails on them too)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = getattr(config, "vision_config", None)
        if vc is None or getattr(vc, "model_type", None) != "llama4_vision_model":
            raise ValueError(f"vision_config.model_type = {getattr(vc, 'model_type', None)!r}:"
                             " expected 'llama4_vision_model'")
        dim, heads = int(vc.hidden_size), int(vc.num_attention_heads)
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision_config.num_attention_heads = {heads} (hidden_size "
                             f"{dim}): the head size must be a whole multiple of 4 (2-D RoPE)")
        factor = shuffle_factor(vc)
        checks = (("intermediate_size", int(vc.intermediate_size), dim * factor * factor,
                   "hidden_size / pixel_shuffle_ratio**2 (the adapter's input)"),
                  ("projector_output_dim", int(vc.projector_output_dim),
                   int(vc.projector_input_dim), "projector_input_dim"),
                  ("vision_output_dim", int(vc.vision_output_dim),
                   int(vc.projector_output_dim), "projector_output_dim"))
        for field, value, want, what in checks:
            if value != want:
                raise ValueError(f"vision_config.{field} = {value}: HF's Llama 4 needs it to "
                                 f"equal {what} = {want}")
        rope = dict(getattr(vc, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(vc, "rope_theta", None))
        if rope.get("rope_type", "default") != "default" or theta is None:
            raise ValueError(f"vision_config.rope_parameters = {rope}: the default rope_type "
                             "with a rope_theta only")
        self.tile = _side("image_size", vc.image_size)
        self.patch = _side("patch_size", vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.tokens_per_tile = tokens_per_tile(vc)
        self._rope = (self.tile // self.patch, dim // heads, float(theta))
        self._turns: torch.Tensor | None = None
        self.vision_model = _VisionModel(vc, factor)
        self.multi_modal_projector = _Projector(int(vc.vision_output_dim),
                                                int(config.text_config.hidden_size))

    def turns(self, device: torch.device) -> torch.Tensor:
        """The RoPE's unit complex numbers ``[n * n + 1, head_dim / 2]`` (complex64) on
        ``device``: ``cos + i sin`` of :func:`rope_angles`, made on the CPU as HF makes them,
        on first use (not a buffer: the model may be built on the meta device, and a cast of
        the model must leave them complex64)."""
        turns = self._turns
        if turns is None or turns.device != device:
            angles = rope_angles(*self._rope)
            turns = torch.view_as_complex(torch.stack([angles.cos(), angles.sin()], dim=-1))
            turns = self._turns = turns.to(device)
        return turns

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [T, C, S, S]`` (any float dtype, cast to the parameters') -> ``[T *
        tokens_per_tile, text_hidden_size]`` in the parameters' dtype: HF's projected image
        features, tile by tile. ValueError for another shape."""
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[0] < 1 or shape[1:] != (self.num_channels, self.tile,
                                                             self.tile):
            raise ValueError(f"pixel_values {shape}: expected [tiles, {self.num_channels}, "
                             f"{self.tile}, {self.tile}]")
        dtype = self.vision_model.patch_embedding.linear.weight.dtype
        x = self.vision_model(pixel_values.to(dtype), self.turns(pixel_values.device))
        out: torch.Tensor = self.multi_modal_projector(x.flatten(0, 1))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`; others ignored) and return the parameter names
        loaded. ValueError naming the tensor for a name under those prefixes that matches no
        parameter, or a shape mismatch."""
        return load_encoder_weights(self, weights, under_prefixes(VISION_CHECKPOINT_PREFIXES),
                                    "Llama 4 vision encoder", hint="vision_config")
