"""Aya Vision (``AyaVisionForConditionalGeneration``: Aya Vision 8B / 32B) in the mrv2 model
contract: a SigLIP vision tower, Aya's pixel-shuffle + LayerNorm + SwiGLU projector, and a
Cohere decoder (``text_config.model_type`` ``cohere2``, as the published checkpoints, or
``cohere``), numerically HF transformers' ``modeling_aya_vision`` (5.17).

Tower
-----
``vision_config.model_type`` ``siglip_vision_model``: the biased patch Conv2d (stride = kernel
= ``patch_size``) cuts an ``S x S`` tile into ``g * g`` patches (``g = S / patch_size``,
row-major), the learned position embedding is added, then pre-norm encoder layers
(:class:`~mrv2.layers.vision.VisionEncoderLayer`). ``vision_feature_layer`` picks HF's
``hidden_states[k]``: the state after ``k mod (L + 1)`` layers (Aya: -1, the last layer,
*before* ``post_layernorm``); one layer only, as HF's projector is sized for one layer's
features. ``vision_feature_select_strategy`` must be ``"full"`` (Aya's: every token;
``"default"`` would drop one and leave no square grid to shuffle). Only the layers up to the
feature layer are built; ``post_layernorm``, the pooling ``head`` and later layers' tensors
are skipped.

Projector
---------
HF's ``AyaVisionMultiModalProjector``: the ``g x g`` grid of features is pixel-shuffled by
``downsample_factor`` ``f`` (each ``f x f`` block's channels stacked, in HF's order), then
``layernorm`` (``adapter_layer_norm_eps``), ``linear_1`` into ``alignment_intermediate_size``,
SwiGLU (``x, gate = chunk(2)``; ``silu(gate) * x``), ``linear_2`` into the text
``hidden_size``: ``(g / f)**2`` tokens a tile.

Decoder
-------
Command R7B's (:class:`~mrv2_cohere.model.Cohere2ForCausalLM`; ``cohere``: Command R's), its
LM head tied per the top-level ``tie_word_embeddings``. The logits are multiplied by
``text_config.logit_scale`` as vLLM's Aya Vision (a ``Cohere*ForCausalLM`` language model) and
HF transformers 4.x did; transformers 5's ``AyaVisionForConditionalGeneration`` applies its
own ``lm_head`` without the scale (greedy tokens are the same; log-probabilities differ where
``logit_scale != 1``).

Command A Vision (:mod:`mrv2_cohere.cohere2_vision`) is this model with the encoder's
``last_hidden_state`` choice: every tower layer and ``post_layernorm``, no projector
``layernorm``.

Checkpoint names: ``model.vision_tower.*`` / ``vision_tower.*`` (optionally
``vision_tower.vision_model.*``), ``[model.]multi_modal_projector.*``, the decoder's as
``model.language_model.*`` / ``language_model.model.*`` with ``lm_head.weight`` or
``language_model.lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import sliding_window_of
from mrv2.layers.vision import VisionEncoder, VisionEncoderLayer, vision_activation
from mrv2.layers.weights import load_encoder_weights, load_text_and_encoder, tower_target_name
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_cohere.model import _Cohere

__all__ = ["VISION_CHECKPOINT_PREFIXES", "AyaVisionEncoder", "AyaVisionForConditionalGeneration",
           "tokens_per_tile"]

_TOWER = "vision_tower."
_PROJECTOR = "multi_modal_projector."
#: Checkpoint prefixes of the tower and the projector (transformers' in-memory names, then the
#: published / ``save_pretrained`` layout's).
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "model." + _TOWER, "model." + _PROJECTOR, _TOWER, _PROJECTOR)
#: ``text_config.model_type`` values built here.
TEXT_KINDS: tuple[str, ...] = ("cohere2", "cohere")


def _side(field: str, value: Any) -> int:
    """``value`` (an int or a square pair) as one side; ValueError naming the field else."""
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or int(sides[0]) != int(sides[1]) or int(sides[0]) < 1:
        raise ValueError(f"{field}={value!r}: only square sizes are supported")
    return int(sides[0])


def tokens_per_tile(config: Any) -> int:
    """Image tokens of one tile: ``(image_size / patch_size / downsample_factor)**2``;
    ValueError naming the field where the grid does not fold by ``downsample_factor``."""
    vc = config.vision_config
    size = _side("vision_config.image_size", vc.image_size)
    patch = _side("vision_config.patch_size", vc.patch_size)
    factor = int(getattr(config, "downsample_factor", 2))
    if size % patch or factor < 1 or (size // patch) % factor:
        raise ValueError(f"vision_config.image_size {size} / patch_size {patch} is not a "
                         f"multiple of downsample_factor {factor}")
    return (size // patch // factor) ** 2


def _feature_layers(config: Any) -> list[int]:
    """``vision_feature_layer`` as indices into HF's ``hidden_states``; ValueError naming it."""
    value = config.vision_feature_layer
    layers = list(value) if isinstance(value, (list, tuple)) else [value]
    count = int(config.vision_config.num_hidden_layers)
    if len(layers) != 1 or any(not isinstance(k, int) or isinstance(k, bool)
                         or not -count - 1 <= k <= count for k in layers):
        raise ValueError(f"vision_feature_layer={value!r}: must be one int in "
                         f"[{-count - 1}, {count}] (HF's projector takes one layer's "
                         "features)")
    return [k % (count + 1) for k in layers]


class _Embeddings(nn.Module):
    """SigLIP's biased patch Conv2d and learned position embedding."""

    def __init__(self, channels: int, dim: int, size: int, patch: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((size // patch) ** 2, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, g*g, D]
        return x + self.position_embedding.weight


class _Tower(nn.Module):
    """The SigLIP tower's used part: the embeddings, the first ``layers`` layers and, with
    ``post_norm``, ``post_layernorm`` (HF's ``last_hidden_state``)."""

    def __init__(self, vc: Any, size: int, patch: int, layers: int, post_norm: bool) -> None:
        super().__init__()
        dim, eps = int(vc.hidden_size), float(vc.layer_norm_eps)
        act = vision_activation("vision_config.hidden_act", str(vc.hidden_act))
        self.embeddings = _Embeddings(int(getattr(vc, "num_channels", 3)), dim, size, patch)
        self.encoder = VisionEncoder(
            VisionEncoderLayer(dim, int(vc.num_attention_heads), int(vc.intermediate_size), act,
                               eps) for _ in range(layers))
        self.post_layernorm = nn.LayerNorm(dim, eps=eps) if post_norm else None


class _Projector(nn.Module):
    """HF's ``AyaVisionMultiModalProjector`` (module doc); ``eps`` None: no ``layernorm``
    (``Cohere2VisionMultiModalProjector``)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, factor: int, eps: float | None
                 ) -> None:
        super().__init__()
        self.factor = factor
        self.layernorm = (None if eps is None
                          else nn.LayerNorm(in_dim * factor * factor, eps=eps))
        self.linear_1 = nn.Linear(in_dim * factor * factor, hidden)
        self.linear_2 = nn.Linear(hidden // 2, out_dim)

    def shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, g*g, D]`` -> ``[N, g/f, g/f, D*f*f]``, HF's ``pixel_shuffle`` order."""
        n, seq, dim = x.shape
        g, f = int(round(seq ** 0.5)), self.factor
        x = x.reshape(n, g, g // f, dim * f).permute(0, 2, 1, 3)
        return x.reshape(n, g // f, g // f, -1).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shuffle(x)
        x = self.linear_1(x if self.layernorm is None else self.layernorm(x))
        value, gate = x.chunk(2, dim=-1)
        out: torch.Tensor = self.linear_2(F.silu(gate) * value)
        return out.flatten(1, 2)


class AyaVisionEncoder(nn.Module):
    """Tiles -> Aya Vision's image tokens: the SigLIP tower, the selected features and the
    projector (module doc). ``config``: the composite ``AyaVisionConfig``; ValueError naming
    the field for one not supported. ``image_size`` is the tile side :meth:`forward` takes,
    ``tokens_per_tile`` the tokens a tile gives.

    ``last_hidden_state``: Command A Vision's choice instead of Aya's (its
    ``Cohere2VisionConfig`` has no ``vision_feature_layer``): every layer and
    ``post_layernorm`` (HF's ``last_hidden_state``), and a projector without ``layernorm``.
    ``architecture`` names the model in errors."""

    def __init__(self, config: Any, *, last_hidden_state: bool = False,
                 architecture: str = "AyaVisionForConditionalGeneration") -> None:
        super().__init__()
        vc = config.vision_config
        kind = getattr(vc, "model_type", None)
        if kind != "siglip_vision_model":
            raise ValueError(f"config.json vision_config.model_type = {kind!r} is not supported "
                             f"for {architecture}; supported: ['siglip_vision_model']")
        self.num_hidden_layers = int(vc.num_hidden_layers)
        if last_hidden_state:
            self.feature_layer = self.num_hidden_layers
        else:
            strategy = config.vision_feature_select_strategy
            if strategy not in ("default", "full"):
                raise ValueError(f"vision_feature_select_strategy={strategy!r}: must be "
                                 "'default' or 'full'")
            if strategy == "default":
                raise ValueError("vision_feature_select_strategy='default' leaves no square "
                                 "grid for the pixel shuffle; Aya Vision uses 'full'")
            self.feature_layer = _feature_layers(config)[0]
        self.tokens_per_tile = tokens_per_tile(config)
        self.image_size = _side("vision_config.image_size", vc.image_size)
        patch = _side("vision_config.patch_size", vc.patch_size)
        self.num_channels = int(getattr(vc, "num_channels", 3))
        self.vision_tower = _Tower(vc, self.image_size, patch, self.feature_layer,
                                   post_norm=last_hidden_state)
        text_hidden = int(config.text_config.hidden_size)
        hidden = int(getattr(config, "alignment_intermediate_size", None) or text_hidden)
        self.multi_modal_projector = _Projector(
            int(vc.hidden_size), hidden, text_hidden,
            int(getattr(config, "downsample_factor", 2)),
            None if last_hidden_state else float(getattr(config, "adapter_layer_norm_eps",
                                                         1e-6)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` tiles (any float dtype) -> ``[N * tokens_per_tile, text_hidden]``
        in the parameters' dtype, tile by tile (HF's ``get_image_features`` flattened)."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected "
                             f"[N, {', '.join(map(str, expected))}]")
        tower = self.vision_tower
        x = tower.embeddings(pixel_values.to(tower.embeddings.patch_embedding.weight.dtype))
        for layer in tower.encoder.layers:  # (up to the feature layer)
            x = layer(x)
        if tower.post_layernorm is not None:
            x = tower.post_layernorm(x)
        out: torch.Tensor = self.multi_modal_projector(x)
        return out.flatten(0, 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's tensors (module doc's names; unused ones
        skipped); ValueError naming the tensor for one that matches nothing or mismatches."""
        return load_encoder_weights(self, weights, self._parameter_name,
                                    "Aya Vision encoder", hint="vision_config")

    def _parameter_name(self, ckpt_name: str) -> str | None:
        target = tower_target_name(ckpt_name, VISION_CHECKPOINT_PREFIXES, _TOWER,
                                   len(self.vision_tower.encoder.layers), self.num_hidden_layers)
        if (target is None and self.vision_tower.post_layernorm is not None
                and ckpt_name.startswith(VISION_CHECKPOINT_PREFIXES)):
            rest = ckpt_name.removeprefix("model.").removeprefix(_TOWER)
            rest = rest.removeprefix("vision_model.")
            if rest.startswith("post_layernorm."):  # (run here: HF's last_hidden_state)
                return _TOWER + rest
        return target


class AyaVisionForConditionalGeneration(_Cohere):
    """Aya Vision: the Cohere decoder and the image encoder (``vision``; module doc).
    ``config`` is the composite ``AyaVisionConfig`` (``self.hf_config``); ``self.config`` is
    its ``text_config``."""

    architecture: ClassVar[str] = "AyaVisionForConditionalGeneration"

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        text = vl_text_config(config, self.architecture)
        kind = getattr(text, "model_type", None)
        layers = int(text.num_hidden_layers)
        if kind == "cohere2":
            local = [sliding_window_of(text, i) is not None for i in range(layers)]
            super().__init__(text, local, qk_norm=False)
        elif kind == "cohere":
            super().__init__(text, [True] * layers, bool(getattr(text, "use_qk_norm", False)))
        else:
            raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported "
                             f"for {self.architecture}; supported: {list(TEXT_KINDS)}")
        self.hf_config = config
        self.vision = self.make_encoder(config)

    def make_encoder(self, config: Any) -> AyaVisionEncoder:
        """The image encoder (Aya Vision's: :class:`AyaVisionEncoder` of ``config``)."""
        return AyaVisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles ``[tiles, 3, S, S]`` -> ``[tiles * tokens_per_tile, hidden]`` in
        the model dtype (tile by tile, the thumbnail last, as HF scatters them)."""
        return self.vision(pixel_values).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: an encoder tensor)."""
        if name.startswith(VISION_CHECKPOINT_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through its loader (q/k rows reordered), the encoder's
        through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision,
                                     VISION_CHECKPOINT_PREFIXES, weights, "vision")
