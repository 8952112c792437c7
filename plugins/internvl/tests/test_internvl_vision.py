"""InternVL's image encoder (:class:`~mrv2_internvl.vision.InternVLVisionEncoder`: InternViT,
pixel shuffle, projector) against HF's ``get_image_features(...).pooler_output``, one image's
tiles at a time (tiles from HF's GotOcr2 processor, ``crop_to_patches``, two aspect ratios):
fp32 parity with the weights from HF's state dict and from ``save_pretrained``'s files, for the
InternVL3 settings and for the other tower options (RMSNorm, qk norm, attention bias, final
layernorm, an earlier feature layer); bad checkpoints and unsupported configs refused naming
the tensor / field; bf16 near fp32 and equal to HF's bf16."""

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
from mrv2_internvl.vision import VISION_CHECKPOINT_PREFIXES, InternVLVisionEncoder

TEXT: dict[str, Any] = {
    "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 4}
#: The other tower options: InternViT-6B's RMSNorm and qk norm, biases, a final layernorm.
OPTIONS: dict[str, Any] = {"norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": True,
                           "use_mean_pooling": False, "use_mask_token": True}
TOKENS = 16  # (32 / 4 * 0.5)**2 tokens a tile
Weights = Iterable[tuple[str, torch.Tensor]]


def _config(vision: dict[str, Any] | None = None, **top: Any) -> Any:
    return transformers.InternVLConfig(text_config=dict(TEXT), vision_config={**VISION,
                                       **(vision or {})}, image_token_id=300, **top)


def _model(config: Any) -> Any:
    """HF's model, its weights redrawn far from their init; the layer scales made ~1 and
    uneven so every layer matters (redraw makes them normal(0, 0.15))."""
    torch.manual_seed(0)
    model = transformers.InternVLForConditionalGeneration(config).eval()
    redraw_weights(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lambda_" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model


@pytest.fixture(scope="module")
def hf() -> Any:
    """A tiny InternVL3 (InternViT with layernorms, no qk norm, feature layer -1)."""
    return _model(_config())


@pytest.fixture(scope="module")
def images() -> list[torch.Tensor]:
    """Two images' tiles from HF's processor as InternVL's processor calls it: a wide image
    (2x1 tiles + thumbnail = 3) and a tall one (1x3 tiles + thumbnail = 4)."""
    processor = transformers.GotOcr2ImageProcessorPil(
        size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1, max_patches=4)
    out = processor([random_image(30, 64, seed=0), random_image(90, 31, seed=1)],
                    return_tensors="pt")
    counts = [int(n) for n in out["num_patches"]]
    assert counts == [3, 4]
    assert out["pixel_values"].shape == (7, 3, 32, 32)
    return list(torch.split(out["pixel_values"], counts))


def _reference(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    """HF's image tokens of all the images' tiles at once, ``[tiles, TOKENS, text_hidden]``."""
    with torch.no_grad():
        out: torch.Tensor = hf.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
            return_dict=True).pooler_output
    return out


def _encoder(hf: Any, weights: Weights) -> tuple[InternVLVisionEncoder, set[str]]:
    encoder = InternVLVisionEncoder(hf.config).eval()
    return encoder, encoder.load_weights(weights)


def _check_parity(hf: Any, encoder: InternVLVisionEncoder, images: list[torch.Tensor]) -> None:
    """Each image alone through ``encoder`` equals its rows of HF's batched output."""
    ref = _reference(hf, torch.cat(images))
    start = 0
    for tiles in images:
        with torch.no_grad():
            ours = encoder(tiles)
        rows = ref[start:start + len(tiles)].flatten(0, 1)
        start += len(tiles)
        assert ours.shape == rows.shape == (len(tiles) * TOKENS, 64)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, rows, rtol=1e-5, atol=1e-5 * rows.abs().max().item())


def test_prefixes() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {
        "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
        "multi_modal_projector."}


@pytest.mark.parametrize("layout", ["in_memory", "saved"])
def test_matches_hf_fp32(hf: Any, images: list[torch.Tensor], tmp_path: Path,
                         layout: str) -> None:
    """Every parameter is loaded (text tensors passed over) and each image's tokens equal its
    rows of HF's output to fp32 round-off."""
    if layout == "in_memory":
        weights: Weights = hf.state_dict().items()
    else:
        hf.save_pretrained(tmp_path)
        names = [name for name, _ in iter_safetensors(tmp_path)]
        assert "vision_tower.encoder.layer.0.lambda_1" in names
        assert "multi_modal_projector.linear_1.weight" in names
        weights = iter_safetensors(tmp_path)
    encoder, loaded = _encoder(hf, weights)
    assert loaded == {name for name, _ in encoder.named_parameters()}
    assert encoder.tokens_per_tile == TOKENS and encoder.image_size == 32
    _check_parity(hf, encoder, images)


@pytest.mark.parametrize("layer", [-1, -2, 1])
def test_tower_options(images: list[torch.Tensor], layer: int) -> None:
    """RMSNorm, qk norm, attention biases and the final layernorm (applied for layer -1 only;
    ``hidden_states[k]`` otherwise), the unused mask token skipped."""
    hf = _model(_config(OPTIONS, vision_feature_layer=layer))
    assert "model.vision_tower.embeddings.mask_token" in hf.state_dict()
    encoder, loaded = _encoder(hf, hf.state_dict().items())
    assert loaded == {name for name, _ in encoder.named_parameters()}
    assert "vision_tower.layernorm.weight" in loaded
    assert "vision_tower.encoder.layer.0.attention.q_norm.weight" in loaded
    _check_parity(hf, encoder, images)


def test_text_tensors_ignored(hf: Any) -> None:
    encoder, loaded = _encoder(hf, [
        ("model.language_model.embed_tokens.weight", torch.zeros(3)),
        ("language_model.model.norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("vision_tower.embeddings.mask_token", torch.zeros(3))])
    assert loaded == set()


@pytest.mark.parametrize("name", [
    "model.vision_tower.encoder.layer.2.mlp.fc1.weight",
    "vision_tower.encoder.layer.0.attention.q_norm.weight",  # no qk norm in this config
    "multi_modal_projector.linear_3.bias",
])
def test_unknown_name_refused(hf: Any, name: str) -> None:
    encoder = InternVLVisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(32))])


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_tower.embeddings.position_embeddings", (1, 64, 32)),
    ("vision_tower.encoder.layer.1.lambda_2", (48,)),
    ("multi_modal_projector.linear_1.weight", (64, 32)),
])
def test_shape_mismatch_refused(hf: Any, name: str, shape: tuple[int, ...]) -> None:
    encoder = InternVLVisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


@pytest.mark.parametrize(("field", "vision", "top"), [
    ("vision_feature_layer", {}, {"vision_feature_layer": [-1, -2]}),
    ("vision_feature_layer", {}, {"vision_feature_layer": 3}),
    ("vision_feature_select_strategy", {}, {"vision_feature_select_strategy": "full"}),
    ("downsample_ratio", {}, {"downsample_ratio": 0.3}),
    ("projector_hidden_act", {}, {"projector_hidden_act": "swish_x"}),
    ("hidden_act", {"hidden_act": "swish_x"}, {}),
    ("norm_type", {"norm_type": "group_norm"}, {}),
    ("image_size", {"image_size": [32, 28]}, {}),
])
def test_unsupported_config_refused(field: str, vision: dict[str, Any],
                                    top: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field):
        InternVLVisionEncoder(_config(vision, **top))


def test_bad_pixels_refused(hf: Any) -> None:
    encoder = InternVLVisionEncoder(hf.config)
    with pytest.raises(ValueError, match="pixel_values"):
        encoder(torch.zeros(1, 3, 28, 28))


def test_bf16(hf: Any, images: list[torch.Tensor]) -> None:
    """In bf16 the encoder computes in bf16 (fp32 pixels cast in): near its fp32 output and
    equal to HF's model in bf16 up to bf16 round-off."""
    encoder, _ = _encoder(hf, hf.state_dict().items())
    tiles = images[1]
    with torch.no_grad():
        ref = encoder(tiles)
        ours = encoder.to(torch.bfloat16)(tiles)
    assert ours.dtype == torch.bfloat16
    assert ours.shape == ref.shape
    err = (ours.float() - ref).norm() / ref.norm()
    assert err < 0.03, err
    torch.testing.assert_close(
        ours, _reference(copy.deepcopy(hf).to(torch.bfloat16), tiles).flatten(0, 1))
