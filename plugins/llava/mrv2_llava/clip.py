"""LLaVA's image encoder: the CLIP (or SigLIP) vision tower, the feature selection and the
``LlavaMultiModalProjector`` of HF's ``LlavaForConditionalGeneration``, in plain torch
(numerically HF's ``get_image_features``, transformers 5.17).

Towers
------
``vision_config.model_type`` ``clip_vision_model`` (LLaVA-1.5: CLIP ViT-L/14): the patch
Conv2d (no bias; stride = kernel = ``patch_size``) cuts an ``S x S`` image into ``g * g``
patches (``g = S / patch_size``, row-major), a learned ``class_embedding`` (CLS) goes in front,
the ``position_embedding`` (``g * g + 1`` rows) is added, then ``pre_layrnorm``.
``siglip_vision_model``: the same with a biased patch Conv2d, no CLS token (``g * g``
positions) and no ``pre_layrnorm``. Each encoder layer (both towers):
``x += out_proj(attn(layer_norm1(x)))`` (bidirectional multi-head attention over the image,
scale ``head_dim ** -0.5``, biased q/k/v/out projections), then
``x += fc2(act(fc1(layer_norm2(x))))`` with ``act`` = ``vision_config.hidden_act``
(``quick_gelu`` for CLIP). ``post_layernorm`` (and SigLIP's pooling ``head``) only feed HF's
pooled output, which LLaVA never reads: their tensors are skipped.

Features
--------
HF's ``hidden_states[k]`` is the tower's state after ``k mod (L + 1)`` layers (``k = 0``: the
embeddings, after ``pre_layrnorm``). ``vision_feature_layer`` is one such ``k`` (LLaVA-1.5:
-2) or a list of them, whose states are concatenated along the channels in list order;
``vision_feature_select_strategy`` ``"default"`` drops the first token (CLIP's CLS; for a
SigLIP tower, as HF does, its first patch), ``"full"`` keeps every token. Only the layers up
to the deepest selected one are built and run: the checkpoint's later layers are skipped.
The projector is ``linear_2(act(linear_1(features)))`` (``projector_hidden_act``, biases iff
``multimodal_projector_bias``) into the text decoder's ``hidden_size``.

Checkpoint names
----------------
The tower's tensors come as ``model.vision_tower.<name>`` (transformers 5.x in memory),
``vision_tower.<name>`` (5.17's ``save_pretrained``) or ``vision_tower.vision_model.<name>``
(the published ``llava-hf`` files, transformers 4.x), with ``<name>`` one of
``embeddings.class_embedding`` ``[D]`` (CLIP), ``embeddings.patch_embedding.{weight,bias}``,
``embeddings.position_embedding.weight``, ``pre_layrnorm.{weight,bias}`` (CLIP),
``encoder.layers.{i}.{self_attn.{q,k,v,out}_proj,layer_norm1,layer_norm2,mlp.fc1,mlp.fc2}.
{weight,bias}``; the projector's as ``[model.]multi_modal_projector.linear_{1,2}.{weight,bias}``.
Parameters are named ``vision_tower.<name>`` and ``multi_modal_projector.<...>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mrv2.layers.vision import VisionEncoder, VisionEncoderLayer
from mrv2.layers.vision import vision_activation as activation
from mrv2.layers.weights import load_encoder_weights, tower_target_name

__all__ = ["TOWER_KINDS", "VISION_CHECKPOINT_PREFIXES", "LlavaVisionEncoder", "activation",
           "image_tokens"]

_TOWER = "vision_tower."
_PROJECTOR = "multi_modal_projector."
#: Checkpoint prefixes of the tower and the projector: transformers' in-memory names, then the
#: published (and ``save_pretrained``) layout's.
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "model." + _TOWER, "model." + _PROJECTOR, _TOWER, _PROJECTOR)

#: ``vision_config.model_type`` -> whether the tower has a CLS token and ``pre_layrnorm``.
TOWER_KINDS: dict[str, bool] = {"clip_vision_model": True, "siglip_vision_model": False}

def _side(field: str, value: Any) -> int:
    """``value`` (an int or a square ``(h, w)`` pair) as one side; ValueError naming
    ``vision_config.<field>`` otherwise."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or int(sides[0]) != int(sides[1]):
        raise ValueError(f"vision_config.{field}={value!r}: only square sizes are supported")
    return int(sides[0])


def _tower_kind(config: Any) -> bool:
    """Whether ``config.vision_config`` is CLIP's (True) or SigLIP's (False); ValueError naming
    ``vision_config.model_type`` for any other tower."""
    kind = getattr(config.vision_config, "model_type", None)
    if kind not in TOWER_KINDS:
        raise ValueError(f"config.json vision_config.model_type = {kind!r} is not supported for "
                         f"LLaVA; supported: {sorted(TOWER_KINDS)}")
    return TOWER_KINDS[kind]


def _feature_layers(config: Any) -> list[int]:
    """``vision_feature_layer`` as non-negative indices into HF's ``hidden_states`` (``L + 1``
    of them); ValueError naming the field for anything else."""
    value = config.vision_feature_layer
    layers = value if isinstance(value, (list, tuple)) else [value]
    count = int(config.vision_config.num_hidden_layers)
    if not layers or any(not isinstance(k, int) or isinstance(k, bool)
                         or not -count - 1 <= k <= count for k in layers):
        raise ValueError(f"vision_feature_layer={value!r}: must be an int or a non-empty list of "
                         f"ints in [{-count - 1}, {count}]")
    return [k % (count + 1) for k in layers]


def image_tokens(config: Any) -> int:
    """Image tokens (placeholders) of one image: the tower's tokens (``g * g`` patches, plus
    CLIP's CLS), one fewer for ``vision_feature_select_strategy: default``. ValueError naming
    the field for a config this encoder refuses."""
    cls_token = _tower_kind(config)
    size = _side("image_size", config.vision_config.image_size)
    patch = _side("patch_size", config.vision_config.patch_size)
    if size % patch:
        raise ValueError(f"vision_config.image_size {size} is not a multiple of patch_size "
                         f"{patch}")
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy={strategy!r}: must be 'default' or "
                         "'full'")
    return (size // patch) ** 2 + int(cls_token) - int(strategy == "default")


class _Embeddings(nn.Module):
    """Patch Conv2d, CLIP's CLS token, the learned position embedding."""

    def __init__(self, vc: Any, cls_token: bool, size: int, patch: int) -> None:
        super().__init__()
        dim = int(vc.hidden_size)
        self.class_embedding = nn.Parameter(torch.zeros(dim)) if cls_token else None
        self.patch_embedding = nn.Conv2d(int(getattr(vc, "num_channels", 3)), dim,
                                         kernel_size=patch, stride=patch, bias=not cls_token)
        self.position_embedding = nn.Embedding((size // patch) ** 2 + int(cls_token), dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, g*g, D]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class _Tower(nn.Module):
    """The vision tower's used part: embeddings, ``pre_layrnorm`` (CLIP), the first layers."""

    def __init__(self, vc: Any, cls_token: bool, size: int, patch: int, num_layers: int) -> None:
        super().__init__()
        act = activation("vision_config.hidden_act", str(vc.hidden_act))
        self.embeddings = _Embeddings(vc, cls_token, size, patch)
        self.pre_layrnorm: nn.Module = (
            nn.LayerNorm(int(vc.hidden_size), eps=float(vc.layer_norm_eps)) if cls_token
            else nn.Identity())
        self.encoder = VisionEncoder(
            VisionEncoderLayer(int(vc.hidden_size), int(vc.num_attention_heads),
                               int(vc.intermediate_size), act, float(vc.layer_norm_eps))
            for _ in range(num_layers))


class _Projector(nn.Module):
    """HF's ``LlavaMultiModalProjector``: ``linear_2(act(linear_1(x)))``."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = act
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class LlavaVisionEncoder(nn.Module):
    """Images -> LLaVA's image tokens: the CLIP / SigLIP tower, the selected layers' features
    and the projector (module doc). ``config`` is the composite ``LlavaConfig`` (its
    ``vision_config``, ``text_config.hidden_size``, ``vision_feature_layer``,
    ``vision_feature_select_strategy``, ``projector_hidden_act``,
    ``multimodal_projector_bias``); ValueError naming the field for one not supported.
    ``image_size`` is the side :meth:`forward` expects, ``tokens_per_image`` the tokens it
    yields per image."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.tokens_per_image = image_tokens(config)
        cls_token = _tower_kind(config)
        self.image_size = _side("image_size", vc.image_size)
        patch = _side("patch_size", vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.feature_layers = _feature_layers(config)
        self.num_hidden_layers = int(vc.num_hidden_layers)
        self.drop_first = config.vision_feature_select_strategy == "default"
        self.vision_tower = _Tower(vc, cls_token, self.image_size, patch,
                                   max(self.feature_layers))
        self.multi_modal_projector = _Projector(
            int(vc.hidden_size) * len(self.feature_layers), int(config.text_config.hidden_size),
            bool(getattr(config, "multimodal_projector_bias", True)),
            activation("projector_hidden_act", str(config.projector_hidden_act)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, C, image_size, image_size]`` (any float dtype, cast to the
        parameters') -> ``[N, tokens_per_image, text_hidden_size]`` in the parameters' dtype:
        HF's ``get_image_features(...).pooler_output`` stacked."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[N, {', '.join(map(str, expected))}]")
        tower = self.vision_tower
        dtype = tower.embeddings.patch_embedding.weight.dtype
        x = tower.pre_layrnorm(tower.embeddings(pixel_values.to(dtype)))
        states = {0: x}  # (the selected layers' outputs only)
        for k, layer in enumerate(tower.encoder.layers, start=1):
            x = layer(x)
            if k in self.feature_layers:
                states[k] = x
        features = torch.cat([states[k] for k in self.feature_layers], dim=-1)
        if self.drop_first:
            features = features[:, 1:]
        out: torch.Tensor = self.multi_modal_projector(features)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's checkpoint tensors (names under
        :data:`VISION_CHECKPOINT_PREFIXES` in any of the three layouts, see the module doc;
        the unused ``post_layernorm``, SigLIP ``head``, ``position_ids`` and layers past the
        deepest feature layer skipped; others ignored) and return the parameter names loaded.
        ValueError naming the tensor for a name under those prefixes that matches no
        parameter, or a shape mismatch."""
        return load_encoder_weights(self, weights, self._parameter_name,
                                    "LLaVA vision encoder",
                                    hint="vision_config / multimodal_projector_bias")

    def _parameter_name(self, ckpt_name: str) -> str | None:
        """The encoder's parameter name of a checkpoint name (None: not the encoder's, or a
        tensor it does not use)."""
        return tower_target_name(ckpt_name, VISION_CHECKPOINT_PREFIXES, _TOWER,
                                 len(self.vision_tower.encoder.layers), self.num_hidden_layers)
