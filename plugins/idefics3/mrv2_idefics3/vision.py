"""Idefics3's image encoder: the SigLIP-style vision tower (HF's ``Idefics3VisionTransformer``,
SmolVLM's identical ``SmolVLMVisionTransformer``), the pixel-shuffle connector and the modality
projection, in plain torch (numerically HF's ``get_image_features(...).pooler_output``,
transformers 5.17), one image's tiles at a time.

Tower
-----
The patch Conv2d (biased; stride = kernel = ``patch_size``) cuts an ``S x S`` tile into
``n * n`` patches (``n = S // patch_size``, row-major; a remainder is dropped, as SmolVLM's
384-pixel tiles of 14-pixel patches drop 6 pixels); each patch gets the learned position
embedding of its *bucket*: HF's NaViT-style bucketing maps patch ``(i, j)`` of an ``n``-wide
grid onto the ``N x N`` grid the table was trained for (``N = image_size // patch_size``):
``bucket(i / n) * N + bucket(j / n)``, with ``bucket`` a ``torch.bucketize`` (``right=True``)
against ``arange(1/N, 1, 1/N)``. HF takes the fractions in the *pixels' dtype* (the model's):
in bf16 they round and some buckets repeat (Idefics3-8B's ``N = 26``: 10 of 26 per side), so
:func:`position_ids` repeats HF's arithmetic op for op, dtype included. The processor always
gives full square tiles of ``max_image_size`` (every frame is resized or cut to it; HF's
``pixel_attention_mask`` is all ones), so no patch is masked: the tower runs with full
bidirectional attention. Each encoder layer is SigLIP's pre-norm one
(``x += out_proj(attn(layer_norm1(x)))``, scale ``head_dim ** -0.5``, biased projections;
``x += fc2(act(fc1(layer_norm2(x))))``, ``act`` = ``vision_config.hidden_act``), and
``post_layernorm`` closes the tower (its output is what Idefics3 reads).

Connector
---------
HF's ``pixel_shuffle`` folds each ``scale_factor x scale_factor`` block of the ``n x n`` grid
into one token of ``D * scale_factor**2`` channels (``n**2 / scale_factor**2`` tokens a tile,
in HF's exact channel order), then ``modality_projection.proj`` (no bias) maps it to the text
decoder's ``hidden_size``.

Checkpoint names
----------------
``model.vision_model.<name>`` and ``model.connector.modality_projection.proj.weight``
(transformers' in-memory, ``save_pretrained`` and published layout), also without ``model.``;
``<name>`` one of ``embeddings.patch_embedding.{weight,bias}``,
``embeddings.position_embedding.weight``, ``encoder.layers.{i}.{self_attn.{q,k,v,out}_proj,
layer_norm1,layer_norm2,mlp.fc1,mlp.fc2}.{weight,bias}``, ``post_layernorm.{weight,bias}``.
Parameters are named ``vision_model.<name>`` and ``connector.modality_projection.proj.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mrv2.layers.vision import VisionEncoder, VisionEncoderLayer
from mrv2.layers.vision import vision_activation as activation
from mrv2.layers.weights import load_encoder_weights, under_prefixes

__all__ = ["TOWER_KINDS", "VISION_CHECKPOINT_PREFIXES", "Idefics3VisionEncoder", "activation",
           "position_ids", "square", "tokens_per_tile"]

#: Checkpoint prefixes of the tower and the connector (transformers' names, then without the
#: ``model.`` wrapper).
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "model.vision_model.", "model.connector.", "vision_model.", "connector.")

#: ``vision_config.model_type`` of the towers built here (the two are the same module).
TOWER_KINDS: tuple[str, ...] = ("idefics3_vision", "smolvlm_vision")

def square(field: str, value: Any) -> int:
    """``value`` (an int or a square ``(h, w)`` pair) as one side; ValueError naming ``field``
    otherwise."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or int(sides[0]) != int(sides[1]) or int(sides[0]) < 1:
        raise ValueError(f"{field}={value!r}: only positive square sizes are supported")
    return int(sides[0])


def tokens_per_tile(side: int, patch: int, scale: int) -> int:
    """Image tokens of one ``side x side`` tile: ``n**2 / scale**2`` for its ``n = side //
    patch`` patches a side (the patch Conv2d drops a remainder, as in SmolVLM's 384-pixel
    tiles of 14-pixel patches); ValueError where ``n`` is not a positive multiple of
    ``scale`` (HF's pixel shuffle needs whole blocks)."""
    n = side // patch
    if n < scale or n % scale:
        raise ValueError(f"a tile of {side} pixels has {n} patches a side (patch_size {patch}), "
                         f"not a positive multiple of scale_factor {scale}")
    return n * n // scale ** 2


def position_ids(rows: int, cols: int, per_side: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """The position-embedding rows ``[rows * cols]`` (row-major) of a full ``rows x cols``
    patch grid, bucketed onto the ``per_side x per_side`` table exactly as HF's
    ``Idefics3VisionEmbeddings`` buckets them for pixels of ``dtype`` (module doc). Device work
    only (no host copy)."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)

    def buckets(count: int) -> torch.Tensor:
        step = 1.0 / torch.full((1,), count, dtype=torch.int64, device=device)
        indices = torch.arange(count, device=device, dtype=torch.float32)
        fractions = torch.clamp(indices[None, :] * step[:, None], max=(1.0 - 1e-6))
        return torch.bucketize(fractions.to(dtype), boundaries, right=True)[0]

    return (buckets(rows)[:, None] * per_side + buckets(cols)[None, :]).reshape(-1)


class _Embeddings(nn.Module):
    """Patch Conv2d and the bucketed position embedding."""

    def __init__(self, vc: Any, patch: int, per_side: int) -> None:
        super().__init__()
        dim = int(vc.hidden_size)
        self.patch = patch
        self.per_side = per_side
        self.patch_embedding = nn.Conv2d(int(getattr(vc, "num_channels", 3)), dim,
                                         kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding(per_side * per_side, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, n*n, D]
        ids = position_ids(pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch,
                           self.per_side, pixels.dtype, pixels.device)
        out: torch.Tensor = x + self.position_embedding(ids)
        return out


class _Tower(nn.Module):
    """HF's ``Idefics3VisionTransformer``: embeddings, layers, ``post_layernorm``."""

    def __init__(self, vc: Any, patch: int, per_side: int) -> None:
        super().__init__()
        act = activation("vision_config.hidden_act", str(vc.hidden_act))
        self.embeddings = _Embeddings(vc, patch, per_side)
        self.encoder = VisionEncoder(
            VisionEncoderLayer(int(vc.hidden_size), int(vc.num_attention_heads),
                               int(vc.intermediate_size), act, float(vc.layer_norm_eps))
            for _ in range(int(vc.num_hidden_layers)))
        self.post_layernorm = nn.LayerNorm(int(vc.hidden_size), eps=float(vc.layer_norm_eps))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        out: torch.Tensor = self.post_layernorm(x)
        return out


class _Projection(nn.Module):
    """HF's ``Idefics3SimpleMLP``: one linear map, no bias."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x)
        return out


class _Connector(nn.Module):
    """HF's ``Idefics3Connector``: the pixel shuffle, then the modality projection."""

    def __init__(self, dim: int, scale: int, out_dim: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = _Projection(dim * scale * scale, out_dim)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, n*n, D]`` -> ``[N, n*n / s**2, D * s**2]`` in HF's order."""
        n, seq, dim = x.shape
        side, s = int(round(seq ** 0.5)), self.scale
        x = x.view(n, side, side, dim).view(n, side, side // s, dim * s)
        x = x.permute(0, 2, 1, 3).reshape(n, side // s, side // s, dim * s * s)
        return x.permute(0, 2, 1, 3).reshape(n, seq // (s * s), dim * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.modality_projection(self.pixel_shuffle(x))
        return out


class Idefics3VisionEncoder(nn.Module):
    """Tiles -> Idefics3's image tokens: the tower, the pixel shuffle and the projection
    (module doc). ``config`` is the composite ``Idefics3Config`` / ``SmolVLMConfig`` (its
    ``vision_config``, ``scale_factor`` and ``text_config.hidden_size``); ValueError naming
    the field for one not supported."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        kind = getattr(vc, "model_type", None)
        if kind not in TOWER_KINDS:
            raise ValueError(f"config.json vision_config.model_type = {kind!r} is not "
                             f"supported; supported: {list(TOWER_KINDS)}")
        size = square("vision_config.image_size", vc.image_size)
        self.patch = square("vision_config.patch_size", vc.patch_size)
        if size < self.patch:
            raise ValueError(f"vision_config.image_size {size} is smaller than patch_size "
                             f"{self.patch}")
        scale = getattr(config, "scale_factor", 2)
        if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
            raise ValueError(f"scale_factor={scale!r}: must be a positive int")
        self.scale = scale
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.vision_model = _Tower(vc, self.patch, size // self.patch)
        self.connector = _Connector(int(vc.hidden_size), scale,
                                    int(config.text_config.hidden_size))

    def tokens_per_tile(self, side: int) -> int:
        """Image tokens of one ``side x side`` tile (:func:`tokens_per_tile`)."""
        return tokens_per_tile(side, self.patch, self.scale)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, C, S, S]`` (any float dtype, cast to the parameters'; ``S //
        patch_size`` a multiple of ``scale_factor``) -> ``[N, tokens_per_tile(S),
        text_hidden_size]`` in the parameters' dtype: HF's ``get_image_features(...)
        .pooler_output`` of full (unmasked) tiles."""
        shape = tuple(pixel_values.shape)
        if (pixel_values.dim() != 4 or shape[1] != self.num_channels or shape[2] != shape[3]
                or shape[2] < self.patch * self.scale or (shape[2] // self.patch) % self.scale):
            raise ValueError(f"pixel_values {shape}: expected [N, {self.num_channels}, S, S] "
                             f"with S // {self.patch} a multiple of {self.scale}")
        dtype = self.vision_model.embeddings.patch_embedding.weight.dtype
        out: torch.Tensor = self.connector(self.vision_model(pixel_values.to(dtype)))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the connector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`; a ``position_ids`` table skipped, others ignored)
        and return the parameter names loaded. ValueError naming the tensor for a name under
        those prefixes that matches no parameter, or a shape mismatch."""
        target = under_prefixes(VISION_CHECKPOINT_PREFIXES,
                                skip=lambda name: name.endswith(".position_ids"))
        return load_encoder_weights(self, weights, target, "Idefics3 vision encoder",
                                    hint="vision_config / scale_factor")
