"""LFM2-VL (``Lfm2VlForConditionalGeneration``: LFM2-VL-450M, 1.6B, 3B) in the mrv2 model
contract: LFM2's hybrid decoder (:class:`~mrv2_lfm2.model.Lfm2ForCausalLM`, the
``text_config``) and the image encoder below (numerically HF's ``get_image_features``,
transformers 5.17), one image's frames at a time.

Tower (HF's ``Siglip2VisionModel``, NaFlex)
-------------------------------------------
Each frame (a tile or the thumbnail, :mod:`mrv2_lfm2.vl_inputs`) comes as its ``h x w``
patches, row-major, each ``patch_size**2 * 3`` values in ``(row, column, channel)`` order.
``embeddings.patch_embedding`` (a biased Linear) maps each patch to ``hidden_size``; the
learned position table (``num_patches`` rows, a ``N x N`` grid) is resized to ``h x w`` by a
bilinear ``interpolate`` with antialiasing (fp32 on the CPU, where HF upcasts; the table's
dtype elsewhere, as in HF) and added. The encoder layers are SigLIP's pre-norm ones
(:class:`~mrv2.layers.vision.VisionEncoderLayer`), ``post_layernorm`` closes the tower; its
``head`` (SigLIP's pooling head, where ``vision_use_head``) is not used by LFM2-VL and its
tensors are skipped. HF pads every frame to the processor's ``max_num_patches`` and masks the
padding out of attention; here each frame runs alone over its own patches, which gives the
same rows.

Projector (HF's ``Lfm2VlMultiModalProjector``)
----------------------------------------------
The ``h x w`` grid is pixel-unshuffled by ``downsample_factor`` ``f`` (each ``f x f`` block one
token of ``f**2 * hidden_size`` channels, in HF's channel order; ``h`` and ``w`` multiples of
``f``), then ``layer_norm`` (where ``projector_use_layernorm``), ``linear_1``, the
``projector_hidden_act``, ``linear_2`` (biases per ``projector_bias``): ``h * w / f**2`` rows
of the text ``hidden_size``, row-major.

Checkpoint names
----------------
``model.vision_tower.<name>`` (also ``model.vision_tower.vision_model.<name>``, as the
published checkpoints' older layout nests it), ``model.multi_modal_projector.<name>``,
``model.language_model.*`` (the decoder, LFM2's names) and ``lm_head.weight``; also without
the ``model.`` wrapper (``language_model.model.*``). The LM head is tied by the top-level
``tie_word_embeddings`` as HF ties it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.vision import VisionEncoder, VisionEncoderLayer, vision_activation
from mrv2.layers.weights import load_encoder_weights, load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_lfm2.model import Lfm2ForCausalLM

__all__ = ["VISION_CHECKPOINT_PREFIXES", "Lfm2VlForConditionalGeneration", "Lfm2VlVisionEncoder",
           "pixel_unshuffle"]

#: Checkpoint prefixes of the tower and the projector (transformers' names, then without the
#: ``model.`` wrapper).
VISION_CHECKPOINT_PREFIXES: tuple[str, ...] = (
    "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
    "multi_modal_projector.")
#: ``vision_config.model_type`` / ``text_config.model_type`` of the parts built here.
TOWER_KINDS: tuple[str, ...] = ("siglip2_vision_model",)
TEXT_KINDS: tuple[str, ...] = ("lfm2",)


def _positive_int(field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json {field}={value!r}: must be a positive int")
    return value


def pixel_unshuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """HF's ``Lfm2VlMultiModalProjector.pixel_unshuffle``: ``[B, h, w, C]`` -> ``[B, h / f,
    w / f, C * f**2]`` in its channel order."""
    b, h, w, c = x.shape
    x = x.reshape(b, h, w // factor, c * factor).permute(0, 2, 1, 3)
    x = x.reshape(b, w // factor, h // factor, c * factor * factor)
    return x.permute(0, 2, 1, 3)


class _Embeddings(nn.Module):
    """HF's ``Siglip2VisionEmbeddings``: the patch Linear and the resized position table."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim = int(vc.hidden_size)
        patch = _positive_int("vision_config.patch_size", vc.patch_size)
        channels = int(getattr(vc, "num_channels", 3))
        count = _positive_int("vision_config.num_patches", vc.num_patches)
        self.side = int(count ** 0.5)
        if self.side * self.side != count:
            raise ValueError(f"config.json vision_config.num_patches={count}: must be a square "
                             f"(the position table's grid)")
        self.patch_embedding = nn.Linear(channels * patch * patch, dim)
        self.position_embedding = nn.Embedding(count, dim)

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The position table resized to ``h x w`` (``[h * w, D]``, row-major), as HF's
        ``resize_positional_embeddings``."""
        table = self.position_embedding.weight
        grid = table.reshape(self.side, self.side, -1).permute(2, 0, 1)[None]
        if grid.device.type == "cpu":  # (HF: antialias has no bf16 / fp16 CPU kernel)
            grid = grid.float()
        out = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False,
                            antialias=True)
        return out.reshape(table.shape[-1], h * w).transpose(0, 1).to(table.dtype)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        out: torch.Tensor = x + self.positions(h, w)
        return out


class _Tower(nn.Module):
    """HF's ``Siglip2VisionModel`` without its pooling head: embeddings, layers,
    ``post_layernorm``."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        act = vision_activation("vision_config.hidden_act", str(vc.hidden_act))
        dim, eps = int(vc.hidden_size), float(vc.layer_norm_eps)
        self.embeddings = _Embeddings(vc)
        self.encoder = VisionEncoder(
            VisionEncoderLayer(dim, int(vc.num_attention_heads), int(vc.intermediate_size),
                               act, eps) for _ in range(int(vc.num_hidden_layers)))
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.embeddings(patches, h, w)[None]
        for layer in self.encoder.layers:
            x = layer(x)
        out: torch.Tensor = self.post_layernorm(x)[0]
        return out


class _Projector(nn.Module):
    """HF's ``Lfm2VlMultiModalProjector`` (module doc)."""

    def __init__(self, config: Any, dim: int) -> None:
        super().__init__()
        self.factor = _positive_int("downsample_factor", getattr(config, "downsample_factor", 2))
        wide = dim * self.factor ** 2
        bias = bool(getattr(config, "projector_bias", True))
        hidden = _positive_int("projector_hidden_size", config.projector_hidden_size)
        self.layer_norm = (nn.LayerNorm(wide)
                           if getattr(config, "projector_use_layernorm", True) else None)
        self.act = vision_activation("projector_hidden_act",
                                     str(getattr(config, "projector_hidden_act", "gelu")))
        self.linear_1 = nn.Linear(wide, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, int(config.text_config.hidden_size), bias=bias)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        """``[h, w, D]`` -> ``[h * w / f**2, text hidden]``."""
        x = pixel_unshuffle(grid[None], self.factor)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out.reshape(-1, out.shape[-1])


class Lfm2VlVisionEncoder(nn.Module):
    """Frames -> LFM2-VL's image rows: the SigLIP2 tower and the projector (module doc).
    ``config`` is the composite ``Lfm2VlConfig``; ValueError naming the field for one not
    supported."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        kind = getattr(vc, "model_type", None)
        if kind not in TOWER_KINDS:
            raise ValueError(f"config.json vision_config.model_type = {kind!r} is not "
                             f"supported; supported: {list(TOWER_KINDS)}")
        self.patch = _positive_int("vision_config.patch_size", vc.patch_size)
        self.channels = int(getattr(vc, "num_channels", 3))
        self.vision_tower = _Tower(vc)
        self.multi_modal_projector = _Projector(config, int(vc.hidden_size))
        self.factor = self.multi_modal_projector.factor

    def forward(self, patches: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``patches [sum h * w, 3 * patch_size**2]`` (the frames' patches one after another,
        any float dtype) and each frame's ``(h, w)`` -> ``[sum h * w / f**2, text hidden]``
        in the parameters' dtype, frame by frame. ValueError where they do not fit."""
        width = self.channels * self.patch ** 2
        total = sum(h * w for h, w in shapes)
        if patches.dim() != 2 or patches.shape[1] != width or patches.shape[0] != total or any(
                h < 1 or w < 1 or h % self.factor or w % self.factor for h, w in shapes):
            raise ValueError(f"patches {tuple(patches.shape)} with frames {list(shapes)}: "
                             f"expected [sum h * w, {width}], h and w multiples of "
                             f"{self.factor}")
        out, start = [], 0
        for h, w in shapes:
            grid = self.vision_tower(patches[start:start + h * w], h, w)
            out.append(self.multi_modal_projector(grid.reshape(h, w, -1)))
            start += h * w
        return out[0] if len(out) == 1 else torch.cat(out)

    @staticmethod
    def target_name(name: str) -> str | None:
        """A checkpoint name under :data:`VISION_CHECKPOINT_PREFIXES` as this module's
        parameter name (module doc); None for the unused pooling head and other names."""
        if not name.startswith(VISION_CHECKPOINT_PREFIXES):
            return None
        name = name.removeprefix("model.")
        name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        if name.startswith("vision_tower.head.") or name.endswith(".position_ids"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the projector's tensors; the parameter names loaded.
        ValueError naming the tensor for a name that matches no parameter or a shape
        mismatch."""
        return load_encoder_weights(self, weights, self.target_name, "LFM2-VL vision encoder",
                                    hint="vision_config / downsample_factor")


class Lfm2VlForConditionalGeneration(Lfm2ForCausalLM):
    """LFM2-VL: LFM2's decoder and the image encoder (``vision``; module doc). ``config`` is
    the composite ``Lfm2VlConfig`` (``self.hf_config``); ``self.config`` is its
    ``text_config``."""

    architecture: ClassVar[str] = "Lfm2VlForConditionalGeneration"

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        text = vl_text_config(config, self.architecture)
        kind = getattr(text, "model_type", None)
        if kind not in TEXT_KINDS:
            raise ValueError(f"config.json text_config.model_type = {kind!r} is not supported "
                             f"for {self.architecture}; supported: {list(TEXT_KINDS)}")
        super().__init__(text)
        self.hf_config = config
        self.vision = Lfm2VlVisionEncoder(config)

    def embed_image(self, patches: torch.Tensor, shapes: Sequence[tuple[int, int]]
                    ) -> torch.Tensor:
        """One image's frames (:meth:`Lfm2VlVisionEncoder.forward`) -> their rows in the
        model dtype."""
        return self.vision(patches, shapes).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (None: an encoder tensor, which
        :meth:`load_weights` hands to the encoder)."""
        if name.startswith(VISION_CHECKPOINT_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through LFM2's loader, the tower's and the projector's
        through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision,
                                     VISION_CHECKPOINT_PREFIXES, weights, "vision")
