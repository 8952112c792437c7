"""LLaVA's image encoder (:class:`~mrv2_llava.clip.LlavaVisionEncoder`: a CLIP or SigLIP tower,
the selected layers' features, the projector) against HF's
``get_image_features(...).pooler_output``, one image at a time (pixels from HF's CLIP image
processor): fp32 parity for a feature layer given as an int and as a list, both select
strategies, a SigLIP tower and no projector bias; the weights from HF's state dict, from
``save_pretrained``'s files and in the published ``vision_tower.vision_model.`` layout; bad
checkpoints and unsupported configs refused naming the tensor / field; bf16 weights near
HF's fp32 output."""

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
from mrv2_llava.clip import VISION_CHECKPOINT_PREFIXES, LlavaVisionEncoder, image_tokens

TEXT: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
VISION: dict[str, Any] = {"model_type": "clip_vision_model", "hidden_size": 32,
                          "intermediate_size": 48, "num_hidden_layers": 3,
                          "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
Weights = Iterable[tuple[str, torch.Tensor]]


def _config(vision: dict[str, Any] | None = None, **top: Any) -> Any:
    return transformers.LlavaConfig(text_config=dict(TEXT), vision_config={**VISION,
                                    **(vision or {})}, image_token_index=300, **top)


def _model(config: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    redraw_weights(model)
    return model


@pytest.fixture(scope="module")
def hf() -> Any:
    """A tiny LLaVA-1.5 (CLIP, feature layer -2, ``default``, projector biases)."""
    return _model(_config())


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """Three images of different sizes and aspect ratios through HF's CLIP processor."""
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 16},
                                                   crop_size={"height": 16, "width": 16})
    pixels: torch.Tensor = processor([random_image(40, 20, seed=0), random_image(16, 16, seed=1),
                                      random_image(21, 50, seed=2)],
                                     return_tensors="pt")["pixel_values"]
    assert pixels.shape == (3, 3, 16, 16)
    return pixels


def _reference(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    """HF's image tokens of all the images at once, ``[N, tokens, text_hidden]``."""
    with torch.no_grad():
        out = hf.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
            return_dict=True).pooler_output
    return torch.stack(list(out)).float()


def _encoder(config: Any, weights: Weights) -> tuple[LlavaVisionEncoder, set[str]]:
    encoder = LlavaVisionEncoder(config).eval()
    return encoder, encoder.load_weights(weights)


def _check_parity(hf: Any, encoder: LlavaVisionEncoder, pixels: torch.Tensor,
                  tokens: int) -> None:
    """Each image alone through ``encoder`` equals its rows of HF's batched output."""
    ref = _reference(hf, pixels)
    assert ref.shape == (len(pixels), tokens, 64) and encoder.tokens_per_image == tokens
    assert image_tokens(hf.config) == tokens
    for n in range(len(pixels)):
        with torch.no_grad():
            ours = encoder(pixels[n:n + 1])
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours[0], ref[n], rtol=1e-5,
                                   atol=1e-5 * ref[n].abs().max().item())


def test_prefixes() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {
        "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
        "multi_modal_projector."}


def _published(weights: Weights) -> Weights:
    """Names as the ``llava-hf`` files have them (``vision_tower.vision_model.*``)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        yield name, tensor


@pytest.mark.parametrize("layout", ["in_memory", "saved", "published"])
def test_matches_hf_fp32(hf: Any, images: torch.Tensor, tmp_path: Path, layout: str) -> None:
    """Every parameter is loaded (text tensors, ``post_layernorm`` and the never-run last
    layer passed over) and each image's tokens equal HF's to fp32 round-off."""
    if layout == "saved":
        hf.save_pretrained(tmp_path)
        names = [name for name, _ in iter_safetensors(tmp_path)]
        assert "vision_tower.embeddings.class_embedding" in names
        assert "vision_tower.encoder.layers.2.mlp.fc1.weight" in names
        weights: Weights = iter_safetensors(tmp_path)
    else:
        weights = hf.state_dict().items()
        if layout == "published":
            weights = _published(weights)
    encoder, loaded = _encoder(hf.config, weights)
    assert loaded == {name for name, _ in encoder.named_parameters()}
    assert len(encoder.vision_tower.encoder.layers) == 2  # (feature layer -2 of 3)
    _check_parity(hf, encoder, images, 16)


@pytest.mark.parametrize(("vision", "top", "tokens"), [
    ({}, {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}, 17),
    ({}, {"vision_feature_layer": [0, -3, 3], "vision_feature_select_strategy": "default"}, 16),
    ({}, {"vision_feature_layer": [-1, 1], "vision_feature_select_strategy": "full",
          "multimodal_projector_bias": False, "projector_hidden_act": "quick_gelu"}, 17),
    ({"model_type": "siglip_vision_model"}, {"vision_feature_layer": -1,
                                             "vision_feature_select_strategy": "full"}, 16),
    ({"model_type": "siglip_vision_model", "hidden_act": "gelu"},
     {"vision_feature_layer": [-2, 1], "vision_feature_select_strategy": "default"}, 15),
])
def test_feature_options(images: torch.Tensor, vision: dict[str, Any], top: dict[str, Any],
                         tokens: int) -> None:
    """Feature layers as an int and as a list (concatenated), both strategies, a SigLIP tower
    (its pooling head skipped), no projector bias."""
    hf = _model(_config(vision, **top))
    encoder, loaded = _encoder(hf.config, _published(hf.state_dict().items()))
    assert loaded == {name for name, _ in encoder.named_parameters()}
    _check_parity(hf, encoder, images, tokens)


def test_text_tensors_ignored(hf: Any) -> None:
    encoder, loaded = _encoder(hf.config, [
        ("model.language_model.embed_tokens.weight", torch.zeros(3)),
        ("language_model.model.norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("vision_tower.vision_model.post_layernorm.weight", torch.zeros(3)),
        ("vision_tower.embeddings.position_ids", torch.zeros(3))])
    assert loaded == set()


@pytest.mark.parametrize("name", [
    "model.vision_tower.encoder.layers.3.mlp.fc1.weight",
    "vision_tower.vision_model.embeddings.patch_embedding.bias",  # (CLIP's conv has none)
    "multi_modal_projector.linear_3.bias",
])
def test_unknown_name_refused(hf: Any, name: str) -> None:
    encoder = LlavaVisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(32))])


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_tower.embeddings.position_embedding.weight", (16, 32)),
    ("vision_tower.vision_model.encoder.layers.1.layer_norm1.weight", (48,)),
    ("multi_modal_projector.linear_1.weight", (64, 64)),
])
def test_shape_mismatch_refused(hf: Any, name: str, shape: tuple[int, ...]) -> None:
    encoder = LlavaVisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


@pytest.mark.parametrize(("field", "vision", "top"), [
    ("vision_feature_layer", {}, {"vision_feature_layer": 4}),
    ("vision_feature_layer", {}, {"vision_feature_layer": []}),
    ("vision_feature_select_strategy", {}, {"vision_feature_select_strategy": "cls"}),
    ("projector_hidden_act", {}, {"projector_hidden_act": "swish_x"}),
    ("hidden_act", {"hidden_act": "swish_x"}, {}),
    ("vision_config.model_type", {"model_type": "pixtral"}, {}),
    ("image_size", {"image_size": 18}, {}),
])
def test_unsupported_config_refused(field: str, vision: dict[str, Any],
                                    top: dict[str, Any]) -> None:
    config = _config()  # (set past the config's own validation, as a hand-edited file could)
    for key, value in vision.items():
        object.__setattr__(config.vision_config, key, value)
    for key, value in top.items():
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=field):
        LlavaVisionEncoder(config)


def test_bad_pixels_refused(hf: Any) -> None:
    encoder = LlavaVisionEncoder(hf.config)
    with pytest.raises(ValueError, match="pixel_values"):
        encoder(torch.zeros(1, 3, 12, 12))


def test_bf16(hf: Any, images: torch.Tensor, tmp_path: Path) -> None:
    """bf16 weights (saved in bf16, loaded into a bf16 encoder) compute in bf16: compared in
    fp32, near HF's fp32 output and near HF's own bf16 model."""
    half = copy.deepcopy(hf).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    encoder = LlavaVisionEncoder(hf.config).to(torch.bfloat16).eval()
    loaded = encoder.load_weights(iter_safetensors(tmp_path))
    assert loaded == {name for name, _ in encoder.named_parameters()}
    ref, ref_half = _reference(hf, images), _reference(half, images)
    with torch.no_grad():
        ours = torch.cat([encoder(images[n:n + 1]) for n in range(len(images))])
    assert ours.dtype == torch.bfloat16
    err = (ours.float() - ref).norm() / ref.norm()
    assert err < 0.03, err
    torch.testing.assert_close(ours.float(), ref_half, rtol=0.02,
                               atol=0.02 * ref.abs().max().item())
