"""InternVL's image encoder: the InternViT vision tower, the pixel-shuffle downsampling and the
multimodal projector of HF's ``InternVLForConditionalGeneration`` (InternVL3 / 3.5 in
transformers' native format), in plain torch (numerically HF's ``get_image_features``,
transformers 5.17).

Checkpoint names
----------------
The tower's tensors come under ``model.vision_tower.`` (transformers 5.x in memory) or
``vision_tower.`` (the published ``-hf`` files and 5.17's ``save_pretrained``):
``embeddings.cls_token`` ``[1, 1, D]``, ``embeddings.position_embeddings`` ``[1, 1 + P, D]``
(absent when ``use_absolute_position_embeddings`` is false),
``embeddings.patch_embeddings.projection.{weight,bias}`` (a Conv2d), per layer ``i``
``encoder.layer.{i}.`` + ``attention.{q,k,v}_proj.{weight,bias}`` (biases iff
``attention_bias``), ``attention.projection_layer.{weight,bias}``,
``attention.{q,k}_norm.weight`` (iff ``use_qk_norm``), ``layernorm_{before,after}.{weight,bias}``
(no bias for ``norm_type: rms_norm``), ``lambda_1``, ``lambda_2`` (layer scale),
``mlp.fc{1,2}.{weight,bias}``; and ``layernorm.{weight,bias}`` iff ``use_mean_pooling`` is
false. The unused ``embeddings.mask_token`` (``use_mask_token``) is skipped. The projector's
come under ``model.multi_modal_projector.`` or ``multi_modal_projector.``:
``layer_norm``, ``linear_1``, ``linear_2`` (``.weight``, ``.bias``). Parameters are named as in
the checkpoint without the leading ``model.``.

Computation
-----------
A tile ``[3, S, S]`` (``S = image_size``) is cut by the Conv2d (stride = kernel = patch_size)
into ``g * g`` patches (``g = S / patch_size``), flattened row-major; the CLS token is put in
front and the position embedding added (no interpolation: the size is fixed). Each layer:
``x += lambda_1 * proj(attn(norm_before(x)))`` (``q_norm`` / ``k_norm``, an RMSNorm over all
heads, on q and k before splitting heads; attention bidirectional within the tile), then
``x += lambda_2 * fc2(act(fc1(norm_after(x))))``. ``vision_feature_layer`` -1 takes the last
layer's output through ``layernorm`` (Identity when ``use_mean_pooling``); another ``k`` takes
the output after ``k mod (L + 1)`` layers (HF's ``hidden_states[k]``). The CLS token is dropped
(``vision_feature_select_strategy: default``), the ``g x g`` grid pixel-shuffled by
``r = 1 / downsample_ratio``: token ``(i, j)`` of the ``g/r x g/r`` grid concatenates the
patches ``(r*i + a, r*j + b)`` ordered by ``a`` then ``b`` (``r*r*D`` channels), tokens
row-major; then ``linear_2(act(linear_1(layer_norm(t))))``. Everything runs in the parameters'
dtype (the RMSNorms normalise in fp32, as HF's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.weights import load_encoder_weights

__all__ = ["VISION_CHECKPOINT_PREFIXES", "InternVLVisionEncoder"]

_TOWER_PREFIXES: tuple[str, ...] = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES: tuple[str, ...] = ("model.multi_modal_projector.", "multi_modal_projector.")
#: Checkpoint prefixes of the tower and the projector: transformers' in-memory names, then the
#: published (and ``save_pretrained``) layout's.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    _TOWER_PREFIXES[0], _PROJECTOR_PREFIXES[0], _TOWER_PREFIXES[1], _PROJECTOR_PREFIXES[1])

_ACTIVATIONS: dict[str, Any] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def _activation(field: str, name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported {field} {name!r} (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _square(field: str, value: Any) -> int:
    """``value`` (an int or an ``(h, w)`` pair) as one side; ValueError naming ``field``."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or int(sides[0]) != int(sides[1]):
        raise ValueError(f"vision_config.{field}={value!r}: only square sizes are supported")
    return int(sides[0])


class _RMSNorm(nn.Module):
    """HF's InternVL RMSNorm: normalised in fp32, cast back, then scaled by ``weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    if norm_type == "layer_norm":
        return nn.LayerNorm(dim, eps=eps)
    if norm_type == "rms_norm":
        return _RMSNorm(dim, eps)
    raise ValueError(f"unsupported vision_config.norm_type {norm_type!r}")


class _PatchEmbeddings(nn.Module):
    def __init__(self, channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.projection = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)


class _Embeddings(nn.Module):
    def __init__(self, vc: Any, channels: int, patch: int, num_patches: int) -> None:
        super().__init__()
        dim = int(vc.hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embeddings = _PatchEmbeddings(channels, dim, patch)
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, num_patches + 1, dim))
            if getattr(vc, "use_absolute_position_embeddings", True) else None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)  # [T, P, D]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class _Attention(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim, heads = int(vc.hidden_size), int(vc.num_attention_heads)
        if dim % heads:
            raise ValueError(f"vision_config.hidden_size {dim} not divisible by "
                             f"num_attention_heads {heads}")
        self.num_heads = heads
        bias = bool(getattr(vc, "attention_bias", False))
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.projection_layer = nn.Linear(dim, dim)
        qk_norm = bool(getattr(vc, "use_qk_norm", False))
        self.q_norm: nn.Module = _RMSNorm(dim, 1e-6) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = _RMSNorm(dim, 1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, dim = x.shape
        q = self.q_norm(self.q_proj(x))
        k = self.k_norm(self.k_proj(x))
        q, k, v = (t.view(n, seq, self.num_heads, -1).transpose(1, 2)
                   for t in (q, k, self.v_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional; scale head_dim**-0.5
        projected: torch.Tensor = self.projection_layer(out.transpose(1, 2).reshape(n, seq, dim))
        return projected


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Any) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class _Layer(nn.Module):
    def __init__(self, vc: Any, act: Any) -> None:
        super().__init__()
        dim, eps, norm = int(vc.hidden_size), float(vc.layer_norm_eps), str(vc.norm_type)
        self.attention = _Attention(vc)
        self.mlp = _MLP(dim, int(vc.intermediate_size), act)
        self.layernorm_before = _norm(norm, dim, eps)
        self.layernorm_after = _norm(norm, dim, eps)
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        out: torch.Tensor = x + self.lambda_2 * self.mlp(self.layernorm_after(x))
        return out


class _Encoder(nn.Module):
    def __init__(self, layers: Iterable[_Layer]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)


class _VisionTower(nn.Module):
    """InternViT: embeddings, ``encoder.layer.*`` and the final ``layernorm`` (if any)."""

    def __init__(self, vc: Any, channels: int, patch: int, num_patches: int) -> None:
        super().__init__()
        act = _activation("vision_config.hidden_act", str(vc.hidden_act))
        self.embeddings = _Embeddings(vc, channels, patch, num_patches)
        self.encoder = _Encoder(_Layer(vc, act) for _ in range(int(vc.num_hidden_layers)))
        self.layernorm: nn.Module = (
            nn.Identity() if getattr(vc, "use_mean_pooling", True)
            else nn.LayerNorm(int(vc.hidden_size), eps=float(vc.layer_norm_eps)))


class _Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: Any) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(in_dim)  # eps 1e-5, as HF's
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.act = act
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(self.layer_norm(x))))
        return out


class InternVLVisionEncoder(nn.Module):
    """One image's tiles -> InternVL's image tokens: the InternViT tower, the pixel shuffle and
    the projector (module docstring). ``config`` is the composite ``InternVLConfig`` (its
    ``vision_config``, ``text_config.hidden_size``, ``downsample_ratio``,
    ``projector_hidden_act``, ``vision_feature_layer``, ``vision_feature_select_strategy``).
    ``image_size`` is the tile side :meth:`forward` expects; ``tokens_per_tile`` the tokens it
    yields per tile (``(image_size / patch_size * downsample_ratio)**2``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.image_size = _square("image_size", vc.image_size)
        patch = _square("patch_size", vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        grid = self.image_size // patch
        if grid * patch != self.image_size:
            raise ValueError(f"vision_config.image_size {self.image_size} is not a multiple of "
                             f"patch_size {patch}")
        ratio = float(config.downsample_ratio)
        self.shuffle = round(1.0 / ratio) if ratio > 0 else 0
        if self.shuffle < 1 or abs(self.shuffle * ratio - 1.0) > 1e-6 or grid % self.shuffle:
            raise ValueError(f"downsample_ratio={ratio}: must be 1/r for an integer r dividing "
                             f"the {grid} patches a side")
        self.grid = grid
        self.tokens_per_tile = (grid // self.shuffle) ** 2
        strategy = config.vision_feature_select_strategy
        if strategy != "default":
            raise ValueError(f"vision_feature_select_strategy={strategy!r}: only 'default' "
                             "(drop the CLS token) is supported")
        layer, num_layers = config.vision_feature_layer, int(vc.num_hidden_layers)
        if not isinstance(layer, int) or isinstance(layer, bool) or not (
                -num_layers - 1 <= layer <= num_layers):
            raise ValueError(f"vision_feature_layer={layer!r}: must be one int in "
                             f"[{-num_layers - 1}, {num_layers}]")
        self.final_norm = layer == -1
        self.num_layers_run = num_layers if layer == -1 else layer % (num_layers + 1)
        dim = int(vc.hidden_size)
        self.vision_tower = _VisionTower(vc, self.num_channels, patch, grid * grid)
        self.multi_modal_projector = _Projector(
            dim * self.shuffle**2, int(config.text_config.hidden_size),
            _activation("projector_hidden_act", str(config.projector_hidden_act)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [num_tiles, C, image_size, image_size]`` of ONE image (any float
        dtype, cast to the parameters') -> ``[num_tiles * tokens_per_tile, text_hidden_size]``
        in the parameters' dtype: HF's ``get_image_features(...).pooler_output`` flattened
        tile-major, each tile's tokens row-major on its downsampled grid."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[num_tiles, {', '.join(map(str, expected))}]")
        tower = self.vision_tower
        x = tower.embeddings(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype))
        for layer in tower.encoder.layer[:self.num_layers_run]:
            x = layer(x)
        if self.final_norm:
            x = tower.layernorm(x)
        tiles, _, dim = x.shape
        g, r = self.grid, self.shuffle
        x = x[:, 1:].reshape(tiles, g // r, r, g // r, r, dim)  # [T, i, a, j, b, D]
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(tiles * self.tokens_per_tile, r * r * dim)
        out: torch.Tensor = self.multi_modal_projector(x)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`, see the module docstring; others, and the unused
        ``embeddings.mask_token``, are ignored) and return the parameter names loaded.
        ValueError naming the tensor for a name under those prefixes that matches no
        parameter, or a shape mismatch."""
        return load_encoder_weights(self, weights, _parameter_name, "InternVL vision encoder")

def _parameter_name(ckpt_name: str) -> str | None:
    """The encoder's parameter name of a checkpoint name (None: not the encoder's, or the
    unused mask token)."""
    for prefix in (*_TOWER_PREFIXES, *_PROJECTOR_PREFIXES):
        if ckpt_name.startswith(prefix):
            name = ckpt_name.removeprefix("model.")
            return None if name == "vision_tower.embeddings.mask_token" else name
    return None
