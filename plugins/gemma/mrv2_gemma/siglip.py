"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector of HF's
``Gemma3ForConditionalGeneration``, in plain torch (numerically HF's, transformers 5.17).

Checkpoint names
----------------
The tower's tensors come under ``model.vision_tower.`` (transformers 5.x in memory) or
``vision_tower.`` (the published files and 5.17's ``save_pretrained``), each optionally
followed by ``vision_model.`` (the published Gemma 3 files keep that level; transformers 5.x
drops it): ``embeddings.patch_embedding.{weight,bias}`` (a Conv2d),
``embeddings.position_embedding.weight``, ``encoder.layers.{i}.{layer_norm1,layer_norm2,
self_attn.{q,k,v,out}_proj,mlp.fc1,mlp.fc2}.{weight,bias}``, ``post_layernorm.{weight,bias}``.
SigLIP's attention-pooling ``head.*`` (built by transformers unless the config says
``vision_use_head: false``) is unused by Gemma 3 and skipped. The projector's come under
``model.multi_modal_projector.`` or ``multi_modal_projector.``: ``mm_soft_emb_norm.weight``
(an RMSNorm weight stored as an offset from 1) and ``mm_input_projection_weight``
(``[vision_hidden, text_hidden]``, a bare matrix). Parameters are named ``vision_model.*`` for
the tower and as in the checkpoint for the projector.

Computation
-----------
``pixel_values [N, C, S, S]`` (``S = image_size``) are cut into ``(S / patch_size)**2``
patches by the Conv2d (stride = kernel = patch_size), flattened row-major, and a learned
position embedding is added in that order (no interpolation: the size is fixed). Pre-norm
encoder layers follow: ``x += out_proj(attn(q, k, v))`` over ``layer_norm1(x)``, bidirectional
over the image's patches, then ``x += fc2(act(fc1(layer_norm2(x))))``; then
``post_layernorm``. The projector puts the patches back on their grid, average-pools it to
``sqrt(mm_tokens_per_image)`` tokens a side, flattens row-major, applies Gemma's RMSNorm (in
fp32, scaled by ``1 + weight``) and multiplies by ``mm_input_projection_weight``: ``[N,
mm_tokens_per_image, text_hidden_size]``, the image's soft tokens for the language model.
Everything runs in the parameters' dtype except that RMSNorm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.vision import VisionEncoder, VisionEncoderLayer
from mrv2.layers.weights import load_encoder_weights

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Gemma3VisionEncoder"]

_TOWER_PREFIXES: tuple[str, ...] = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES: tuple[str, ...] = ("model.multi_modal_projector.", "multi_modal_projector.")
#: Checkpoint prefixes of the tower and the projector: transformers' in-memory names, then the
#: published (and ``save_pretrained``) layout's.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    _TOWER_PREFIXES[0], _PROJECTOR_PREFIXES[0], _TOWER_PREFIXES[1], _PROJECTOR_PREFIXES[1])

_ACTIVATIONS: dict[str, Any] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class _Embeddings(nn.Module):
    def __init__(self, channels: int, dim: int, patch: int, num_patches: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding(num_patches, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, patches, D]
        return x + self.position_embedding.weight


class _VisionTransformer(nn.Module):
    """SigLIP's vision transformer without its pooling head (``last_hidden_state``)."""

    def __init__(self, cfg: Any, num_patches: int) -> None:
        super().__init__()
        dim, eps = int(cfg.hidden_size), float(cfg.layer_norm_eps)
        act = str(getattr(cfg, "hidden_act", "gelu_pytorch_tanh"))
        self.embeddings = _Embeddings(int(getattr(cfg, "num_channels", 3)), dim,
                                      int(cfg.patch_size), num_patches)
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}")
        self.encoder = VisionEncoder(
            VisionEncoderLayer(dim, int(cfg.num_attention_heads), int(cfg.intermediate_size),
                               _ACTIVATIONS[act], eps)
            for _ in range(int(cfg.num_hidden_layers)))
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        out: torch.Tensor = self.post_layernorm(x)
        return out


class _GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised and scaled by ``1 + weight`` in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class Gemma3VisionEncoder(nn.Module):
    """Images -> Gemma 3's image soft tokens: the SigLIP tower and the projector (module
    docstring). ``config`` is the composite ``Gemma3Config`` (its ``vision_config``,
    ``text_config.hidden_size`` and ``mm_tokens_per_image``). ``image_size`` is the pixel
    side :meth:`forward` expects; ``tokens_per_image`` the tokens it yields per image."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.image_size = int(vc.image_size)
        self.patch_size = int(vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.tokens_per_image = int(config.mm_tokens_per_image)
        self.patches_per_side = self.image_size // self.patch_size
        self.tokens_per_side = math.isqrt(self.tokens_per_image)
        if (self.tokens_per_side**2 != self.tokens_per_image
                or self.patches_per_side % self.tokens_per_side):
            raise ValueError(f"mm_tokens_per_image={self.tokens_per_image} must be a square "
                             f"whose side divides the {self.patches_per_side} patches a side")
        self.vision_model = _VisionTransformer(vc, self.patches_per_side**2)
        self.mm_soft_emb_norm = _GemmaRMSNorm(int(vc.hidden_size), float(vc.layer_norm_eps))
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(int(vc.hidden_size), int(config.text_config.hidden_size)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, C, image_size, image_size]`` (any float dtype, cast to the
        parameters') -> ``[N, mm_tokens_per_image, text_hidden_size]`` in the parameters'
        dtype: HF's ``get_image_features(...).pooler_output``."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[N, {', '.join(map(str, expected))}]")
        dtype = self.mm_input_projection_weight.dtype
        x = self.vision_model(pixel_values.to(dtype))  # [N, patches, D]
        n, _, dim = x.shape
        side, kernel = self.patches_per_side, self.patches_per_side // self.tokens_per_side
        grid = x.transpose(1, 2).reshape(n, dim, side, side)
        pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        tokens = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return tokens.type_as(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES`, see the module docstring; others, and the unused
        ``head.*``, are ignored) and return the parameter names loaded. ValueError naming the
        tensor for a name under those prefixes that matches no parameter, or a shape
        mismatch."""
        return load_encoder_weights(self, weights, _parameter_name, "Gemma 3 vision encoder")

def _parameter_name(ckpt_name: str) -> str | None:
    """The encoder's parameter name of a checkpoint name (None: not the encoder's, or the
    unused SigLIP head)."""
    for prefix in _TOWER_PREFIXES:
        if ckpt_name.startswith(prefix):
            rest = ckpt_name[len(prefix):].removeprefix("vision_model.")
            return None if rest.startswith("head.") else "vision_model." + rest
    for prefix in _PROJECTOR_PREFIXES:
        if ckpt_name.startswith(prefix):
            return ckpt_name[len(prefix):]
    return None
