"""Command A Vision (``Cohere2VisionForConditionalGeneration``), numerically HF transformers'
``modeling_cohere2_vision`` (5.17): Aya Vision's pieces
(:mod:`mrv2_cohere.aya_vision`, :mod:`mrv2_cohere.aya_vision_inputs`) with its own choices.

- **Tower**: a SigLIP tower (``vision_config.model_type`` ``siglip_vision_model``; the
  published checkpoint's SigLIP2 so400m at 512 pixels, patches of 16) over each tile, *every*
  layer and ``post_layernorm`` (HF's ``last_hidden_state``; the pooling ``head`` is not run
  and its tensors are skipped).
- **Projector**: HF's ``Cohere2VisionMultiModalProjector``: Aya's pixel shuffle by
  ``downsample_factor``, then, with no LayerNorm, ``linear_1`` into
  ``alignment_intermediate_size``, SwiGLU (``x, gate = chunk(2)``; ``silu(gate) * x``),
  ``linear_2`` into the text ``hidden_size``: ``(image_size / patch_size /
  downsample_factor)**2`` tokens a tile (256 at 512 pixels).
- **Decoder**: Command A's (:class:`~mrv2_cohere.model.Cohere2ForCausalLM`), the LM head tied
  per the top-level ``tie_word_embeddings``; the logits multiplied by
  ``text_config.logit_scale`` as vLLM's Command A Vision (a ``Cohere2ForCausalLM`` language
  model) does; transformers 5's model applies its LM head unscaled (same greedy tokens,
  other log-probabilities where the scale is not 1).
- **Images**: the checkpoint's ``Cohere2VisionImageProcessor`` (with torchvision; without it
  :class:`Cohere2VisionImageProcessorPil`, the same tiling on GOT-OCR2's PIL backend) with
  ``crop_to_patches`` on: the image resized to the grid of ``size`` tiles (at most
  ``max_patches``) that needs the least upscaling, or the least downscaling where every grid
  downscales (HF's ``get_optimal_tiled_canvas``; not GOT-OCR2's aspect-ratio rule), cut
  row-major, and a thumbnail of the whole image last where there is more than one tile.
- **Prompt**: each image is one ``<|IMG_PATCH|>`` (``image_token_id``: the text HF's
  processor replaces, and vLLM's token-prompt placeholder), expanded as HF's
  ``Cohere2VisionProcessor``: ``<|START_OF_IMG|>``, per tile (the thumbnail last)
  ``patch_size**2`` ``<|IMG_PATCH|>`` (the image processor's ``patch_size``) and one
  ``<|IMG_LINE_BREAK|>``, then ``<|END_OF_IMG|>``; the token names are the tokenizer's
  ``boi_token`` / ``image_token`` / ``img_line_break_token`` / ``eoi_token``. An image
  processor whose ``patch_size**2`` is not the model's tokens a tile, or whose ``size`` is
  not ``vision_config.image_size``, refuses images naming the field (text prompts still run).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from mrv2.contract.input_processor import load_image_processor, preprocessor_config
from mrv2_cohere.aya_vision import AyaVisionEncoder, AyaVisionForConditionalGeneration
from mrv2_cohere.aya_vision_inputs import TiledImageInputProcessor

#: (also ``Cohere2VisionImageProcessorPil``, made on first access: module ``__getattr__``)
__all__ = ["Cohere2VisionForConditionalGeneration", "Cohere2VisionInputProcessor", "tile_grid"]

#: The tokenizer attributes HF's ``Cohere2VisionProcessor`` reads, and the published names.
TOKENS: dict[str, str] = {
    "boi_token": "<|START_OF_IMG|>", "image_token": "<|IMG_PATCH|>",
    "img_line_break_token": "<|IMG_LINE_BREAK|>", "eoi_token": "<|END_OF_IMG|>"}
#: The image processor's defaults (HF's ``Cohere2VisionImageProcessor``).
IMAGE_DEFAULTS: dict[str, Any] = {
    "size": {"height": 512, "width": 512}, "crop_to_patches": True, "min_patches": 1,
    "max_patches": 12, "patch_size": 16}


class Cohere2VisionForConditionalGeneration(AyaVisionForConditionalGeneration):
    """Command A Vision: Command A's decoder and the image encoder (``vision``; module doc).
    ``config`` is the composite ``Cohere2VisionConfig`` (``self.hf_config``); ``self.config``
    is its ``text_config``."""

    architecture: ClassVar[str] = "Cohere2VisionForConditionalGeneration"

    def make_encoder(self, config: Any) -> AyaVisionEncoder:
        """Every tower layer and ``post_layernorm``, the projector without a LayerNorm."""
        return AyaVisionEncoder(config, last_hidden_state=True, architecture=self.architecture)


def tile_grid(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """``(columns, rows)`` of HF's ``get_optimal_tiled_canvas``: among the grids of at most
    ``max_tiles`` tiles (ordered by tile count, then columns), each needing the scale
    ``min(columns * tile / width, rows * tile / height)``: where every scale is below 1, the
    largest (the least downscaling); else the least of those at least 1 (the least
    upscaling); ties to the first."""
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if c * r <= max_tiles), key=lambda g: g[0] * g[1])
    scales = [min(c * tile / width, r * tile / height) for c, r in grids]
    if all(s < 1 for s in scales):
        return grids[scales.index(max(scales))]
    upscales = [s if s >= 1 else 1e10 for s in scales]
    return grids[upscales.index(min(upscales))]


@functools.cache
def _pil_processor_class() -> Any:
    """:class:`Cohere2VisionImageProcessorPil`, made on first use (transformers imported
    lazily)."""
    from transformers.image_utils import (
        ChannelDimension,
        get_image_size,
        infer_channel_dimension_format,
    )
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    class _Pil(GotOcr2ImageProcessorPil):
        """HF's ``Cohere2VisionImageProcessor`` tiling on GOT-OCR2's PIL backend: the same
        resize / rescale / normalize, :func:`tile_grid`'s grid; HF's defaults
        (:data:`IMAGE_DEFAULTS`: ``crop_to_patches`` on, 512-pixel tiles)."""

        size = IMAGE_DEFAULTS["size"]
        crop_to_patches = IMAGE_DEFAULTS["crop_to_patches"]
        min_patches = IMAGE_DEFAULTS["min_patches"]
        max_patches = IMAGE_DEFAULTS["max_patches"]
        #: Image tokens a tile side (HF's processor: ``patch_size**2`` tokens a tile).
        patch_size = IMAGE_DEFAULTS["patch_size"]

        def crop_image_to_patches(self, image: Any, min_patches: int, max_patches: int,
                                  use_thumbnail: bool = True, patch_size: Any = None,
                                  resample: Any = None) -> list[Any]:
            from transformers.image_processing_utils import SizeDict
            from transformers.image_transforms import to_channel_dimension_format

            fmt = infer_channel_dimension_format(image)
            image = to_channel_dimension_format(image, ChannelDimension.FIRST, fmt)
            h, w = get_image_size(image, channel_dim=ChannelDimension.FIRST)
            th, tw = patch_size.height, patch_size.width
            cols, rows = tile_grid(h, w, th, max_patches)
            whole = self.resize(image, SizeDict(height=th * rows, width=tw * cols),
                                resample=resample)
            tiles = [whole[..., r * th:(r + 1) * th, c * tw:(c + 1) * tw]
                     for r in range(rows) for c in range(cols)]
            if use_thumbnail and len(tiles) > 1:
                tiles.append(self.resize(image, patch_size, resample=resample))
            return [to_channel_dimension_format(t, fmt, ChannelDimension.FIRST) for t in tiles]

    _Pil.__name__ = _Pil.__qualname__ = "Cohere2VisionImageProcessorPil"
    return _Pil


def __getattr__(name: str) -> Any:
    if name == "Cohere2VisionImageProcessorPil":
        return _pil_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_cohere2_image_processor(model_dir: str) -> Any:
    """The checkpoint's image processor (HF's, where torchvision is installed), else
    :class:`Cohere2VisionImageProcessorPil` with its settings; FileNotFoundError where the
    checkpoint has none. ``patch_size`` (tokens a tile side) kept as an attribute."""
    import importlib.util

    settings = {**IMAGE_DEFAULTS, **preprocessor_config(model_dir)}
    if importlib.util.find_spec("torchvision") is not None:
        processor = load_image_processor(model_dir, "Cohere2VisionImageProcessor")
    else:
        if not preprocessor_config(model_dir):
            load_image_processor(model_dir, "Cohere2VisionImageProcessor")  # (raises)
        keys = ("size", "crop_to_patches", "min_patches", "max_patches", "image_mean",
                "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
                "do_convert_rgb", "resample")
        processor = _pil_processor_class()(**{k: settings[k] for k in keys if k in settings})
    processor.patch_size = int(settings["patch_size"])
    return processor


class Cohere2VisionInputProcessor(TiledImageInputProcessor):
    """Command A Vision's :class:`~mrv2.contract.input_processor.InputProcessor` (module
    doc)."""

    family = "Command A Vision"

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        if tokenizer is None:
            self.images_refused = (f"{hf_config.architectures} needs the checkpoint's tokenizer "
                                   "(the <|START_OF_IMG|> / <|IMG_PATCH|> ids)")
            return
        hf = getattr(tokenizer, "hf", tokenizer)  # (the engine's wraps HF's)
        names = {k: str(getattr(hf, k, None) or v) for k, v in TOKENS.items()}
        self.placeholder_label = f"{names['image_token']}, token {self.image_token}"
        unknown = getattr(hf, "unk_token_id", None)
        ids = {k: hf.convert_tokens_to_ids(v) for k, v in names.items()}
        if ids["image_token"] != self.image_token:
            self.images_refused = (f"the tokenizer's {names['image_token']} is id "
                                   f"{ids['image_token']}, but config.json image_token_id is "
                                   f"{self.image_token}")
            return
        missing = [names[k] for k, i in ids.items() if not isinstance(i, int) or i == unknown]
        if missing:
            self.images_refused = f"the tokenizer has no {' / '.join(missing)} tokens"
            return
        self.ids = {k: int(i) for k, i in ids.items()}
        try:
            processor = load_cohere2_image_processor(model_dir)
        except FileNotFoundError as error:  # (text prompts still run; images are refused)
            self.images_refused = str(error)
            return
        self.image_processor = processor
        side = int(processor.patch_size)
        if side * side != self.per_tile:
            self.image_processor = None
            self.images_refused = (
                f"preprocessor_config.json patch_size={side} gives {side * side} image tokens "
                f"a tile, but the model's tiles give {self.per_tile} "
                "(vision_config.image_size / patch_size / downsample_factor)")
            return
        self.check_tile_size(hf_config)

    def layout(self, tiles: int) -> list[int]:
        """``<|START_OF_IMG|>``, per tile ``per_tile`` ``<|IMG_PATCH|>`` and a
        ``<|IMG_LINE_BREAK|>``, ``<|END_OF_IMG|>`` (HF's ``replace_image_token``)."""
        ids = self.ids
        tile = [ids["image_token"]] * self.per_tile + [ids["img_line_break_token"]]
        return [ids["boi_token"], *(tile * tiles), ids["eoi_token"]]
