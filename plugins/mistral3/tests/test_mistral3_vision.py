"""Mistral 3's image encoder (:class:`~mrv2_mistral3.vision.Mistral3VisionEncoder`: the Pixtral
tower and the multimodal projector) against HF's ``get_image_features(...).pooler_output``,
image by image, on inputs from HF's own image processor (two images of different aspect
ratios batched, so both are padded): fp32 parity with the weights from HF's state dict and
from ``save_pretrained``'s files (the older ``vision_tower.*`` layout), for the default config
and for one with a merge of 3, an earlier feature layer, projector biases and other
activations; every feature layer HF accepts; sizes that are not multiples of the merge; bad
checkpoints, inputs and configs refused; bf16 near fp32 and near HF's bf16."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2.model_loader import iter_safetensors
from mrv2.testing import random_image, redraw_weights
from mrv2_mistral3.vision import VISION_CHECKPOINT_PREFIXES, Mistral3VisionEncoder

TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "patch_size": 4, "image_size": 64}
#: "default": HF's defaults (last layer, gelu, no projector bias), a merge of 2;
#: "variant": 3 layers (feature layer -2), silu tower, gelu-tanh projector with biases, a
#: merge of 3, rope_theta 100 and the text rms_norm_eps 1e-2.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"text_config": TEXT, "vision_config": VISION, "spatial_merge_size": 2},
    "variant": {
        "text_config": {**TEXT, "rms_norm_eps": 1e-2},
        "vision_config": {**VISION, "num_hidden_layers": 3, "hidden_act": "silu",
                          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}},
        "spatial_merge_size": 3, "vision_feature_layer": -2,
        "projector_hidden_act": "gelu_pytorch_tanh", "multimodal_projector_bias": True},
}
IMAGE_SIZES = ((40, 90), (90, 70))  # (height, width)
Weights = Iterable[tuple[str, torch.Tensor]]


def _config(name: str) -> Any:
    return transformers.Mistral3Config(**copy.deepcopy(CONFIGS[name]))


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf(request: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(_config(request.param)).eval()
    redraw_weights(model)
    return model


def _inputs(config: Any) -> dict[str, torch.Tensor]:
    """The two images through HF's image processor as ``PixtralProcessor`` calls it (patch
    size ``patch_size * spatial_merge_size``): ``pixel_values [2, 3, H_max, W_max]``,
    ``image_sizes [2, 2]``."""
    side = config.vision_config.patch_size * config.spatial_merge_size
    processor = transformers.PixtralImageProcessorPil(
        patch_size={"height": side, "width": side}, size={"longest_edge": 64})
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    out: dict[str, torch.Tensor] = dict(processor(images, return_tensors="pt"))
    return out


def _sizes(inputs: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return [(int(h), int(w)) for h, w in inputs["image_sizes"].tolist()]


def _reference(hf: Any, inputs: dict[str, torch.Tensor], **kwargs: Any
               ) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out: tuple[torch.Tensor, ...] = hf.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
            return_dict=True, **kwargs).pooler_output
    return out


def _ours(encoder: Mistral3VisionEncoder, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder(pixels, size)
                for pixels, size in zip(inputs["pixel_values"], _sizes(inputs), strict=True)]


def _encoder(config: Any, weights: Weights) -> tuple[Mistral3VisionEncoder, set[str]]:
    encoder = Mistral3VisionEncoder(config).eval()
    return encoder, encoder.load_weights(weights)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_prefixes() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {
        "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
        "multi_modal_projector."}


@pytest.mark.parametrize("layout", ["in_memory", "saved"])
def test_matches_hf_fp32(hf: Any, tmp_path: Path, layout: str) -> None:
    """Every parameter is loaded, and each image's tokens equal its rows of HF's output to
    fp32 round-off, whether given padded or cropped."""
    if layout == "in_memory":
        weights: Weights = hf.state_dict().items()
    else:
        hf.save_pretrained(tmp_path)
        weights = list(iter_safetensors(tmp_path))
        # (5.17 saves the older layout: no "model." before the tower and the projector)
        assert any(n.startswith("vision_tower.") for n, _ in weights)
        assert not [n for n, _ in weights if n.startswith("model.")]
    encoder, loaded = _encoder(hf.config, weights)
    assert loaded == {name for name, _ in encoder.named_parameters()}
    assert (encoder.patch_size, encoder.merge) == (4, hf.config.spatial_merge_size)
    inputs = _inputs(hf.config)
    sizes, padded = _sizes(inputs), inputs["pixel_values"].shape[2:]
    assert all(size != tuple(padded) for size in sizes)  # both images are padded
    ours, ref = _ours(encoder, inputs), _reference(hf, inputs)
    side = 4 * encoder.merge
    assert [len(t) for t in ours] == [len(t) for t in ref] == [
        (h // side) * (w // side) for h, w in sizes]
    for pixels, (h, w), mine, theirs in zip(inputs["pixel_values"], sizes, ours, ref,
                                            strict=True):
        assert mine.dtype == torch.float32 and mine.shape[1] == 64
        _close(mine, theirs)
        with torch.no_grad():
            cropped = encoder(pixels[:, :h, :w].contiguous(), (h, w))
        torch.testing.assert_close(cropped, mine, rtol=0, atol=0)


@pytest.mark.parametrize("layer", [0, 1, -1, -3, [-2]])
def test_feature_layers(layer: Any) -> None:
    """Each ``vision_feature_layer`` HF accepts (an index into ``ln_pre``'s output and the
    layers', or a one-element list) selects the same hidden state as HF's, and they differ."""
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(_config("default")).eval()
    redraw_weights(hf)
    config = copy.deepcopy(hf.config)
    config.vision_feature_layer = layer
    encoder, _ = _encoder(config, hf.state_dict().items())
    inputs = _inputs(hf.config)
    ours, ref = _ours(encoder, inputs), _reference(hf, inputs, vision_feature_layer=layer)
    last = _reference(hf, inputs)
    for mine, theirs, final in zip(ours, ref, last, strict=True):
        _close(mine, theirs)
        if layer not in (-1, 2):
            assert not torch.allclose(mine, final, atol=1e-3)


@pytest.mark.parametrize("image_size", [(28, 44), (30, 45), (64, 48)])
def test_sizes_not_multiples_of_the_merge(hf: Any, image_size: tuple[int, int]) -> None:
    """Sizes the processor would not give (not multiples of ``patch_size * merge``, or of
    ``patch_size``): HF's floors (patches past the size, grid rows and columns past a multiple
    of the merge dropped), too."""
    encoder, _ = _encoder(hf.config, hf.state_dict().items())
    pixels = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = encoder(pixels[0], image_size)
    (ref,) = _reference(hf, {"pixel_values": pixels, "image_sizes": torch.tensor([image_size])})
    side = 4 * encoder.merge
    assert ours.shape == ref.shape == ((image_size[0] // side) * (image_size[1] // side), 64)
    _close(ours, ref)


def test_other_tensors_ignored(hf: Any) -> None:
    encoder, loaded = _encoder(hf.config, [
        ("model.language_model.embed_tokens.weight", torch.zeros(3)),
        ("language_model.model.norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("vision_encoder.transformer.layers.0.attention.wq.weight", torch.zeros(3))])
    assert loaded == set()


@pytest.mark.parametrize("name", [
    "model.vision_tower.transformer.layers.3.attention.q_proj.weight",
    "vision_tower.patch_conv.bias",
    "model.vision_tower.patch_positional_embedding.inv_freq",
    "multi_modal_projector.patch_merger.merging_layer.bias",
    "model.multi_modal_projector.linear_3.weight",
])
def test_unknown_name_refused(hf: Any, name: str) -> None:
    encoder = Mistral3VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(32))])


def test_projector_bias_refused_without_it() -> None:
    encoder = Mistral3VisionEncoder(_config("default"))
    with pytest.raises(ValueError, match=r"linear_1\.bias"):
        encoder.load_weights([("model.multi_modal_projector.linear_1.bias", torch.zeros(64))])


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_tower.patch_conv.weight", (32, 3, 8, 8)),
    ("vision_tower.transformer.layers.1.feed_forward.up_proj.weight", (32, 48)),
    ("vision_tower.ln_pre.weight", (64,)),
    ("multi_modal_projector.patch_merger.merging_layer.weight", (32, 32)),
    ("model.multi_modal_projector.linear_2.weight", (64, 32)),
])
def test_shape_mismatch_refused(hf: Any, name: str, shape: tuple[int, ...]) -> None:
    encoder = Mistral3VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


def test_bad_inputs_refused(hf: Any) -> None:
    encoder = Mistral3VisionEncoder(hf.config)
    side = 4 * encoder.merge
    pixels = torch.zeros(3, 2 * side, 2 * side)
    for bad_pixels, size in [(pixels[None], (side, side)), (pixels[:2], (side, side)),
                             (pixels, (2 * side + 1, side)), (pixels, (side, 3 * side)),
                             (pixels, (side - 1, side)), (pixels, (side, 0))]:
        with pytest.raises(ValueError, match="pixel_values|image_size"):
            encoder(bad_pixels, size)


@pytest.mark.parametrize(("field", "value"), [
    ("vision_feature_layer", [-1, -2]), ("vision_feature_layer", 3),
    ("vision_feature_layer", -4), ("projector_hidden_act", "quick_gelu"),
    ("spatial_merge_size", 0), ("vision_config.hidden_act", "gelu_new"),
    ("vision_config.rope_parameters", {"rope_type": "default", "rope_theta": 100.0}),
    ("vision_config.patch_size", (4, 4)), ("vision_config.num_attention_heads", 16),
    ("vision_config.model_type", "siglip_vision_model"),
])
def test_unsupported_config_refused(field: str, value: Any) -> None:
    config = _config("default")
    owner = config.vision_config if field.startswith("vision_config.") else config
    owner.__dict__[field.removeprefix("vision_config.")] = value  # (past the strict checks)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Mistral3VisionEncoder(config)


def test_hf_fails_on_several_feature_layers(hf: Any) -> None:
    """Why a list of layers is refused: HF concatenates them, then its projector's norm (of
    the tower's width) fails."""
    with pytest.raises(RuntimeError):
        _reference(hf, _inputs(hf.config), vision_feature_layer=[-1, -2])


def test_bf16(hf: Any, tmp_path: Path) -> None:
    """In bf16 (HF's model loaded with ``dtype=bfloat16``, as served) the encoder is as near
    fp32 as HF's model is, and near HF's output image by image."""
    encoder, _ = _encoder(hf.config, hf.state_dict().items())
    inputs = _inputs(hf.config)
    ref = _ours(encoder, inputs)
    ours = _ours(encoder.to(torch.bfloat16), inputs)
    hf.save_pretrained(tmp_path)
    hf_bf16 = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.bfloat16).eval()
    theirs_all = _reference(hf_bf16, inputs)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for i, (mine, fp32, theirs) in enumerate(zip(ours, ref, theirs_all, strict=True)):
        assert mine.dtype == theirs.dtype == torch.bfloat16
        assert err(mine, fp32) < 1.1 * err(theirs, fp32) + 1e-3 < 0.06
        h, w = _sizes(inputs)[i]
        alone = {"pixel_values": inputs["pixel_values"][i:i + 1, :, :h, :w],
                 "image_sizes": inputs["image_sizes"][i:i + 1]}
        (theirs,) = _reference(hf_bf16, alone)
        assert err(mine, theirs) < 0.01
