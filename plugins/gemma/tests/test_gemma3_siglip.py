"""Gemma 3's image encoder (:class:`~mrv2_gemma.siglip.Gemma3VisionEncoder`: the SigLIP tower
and the multimodal projector) against HF's ``get_image_features(...).pooler_output``: fp32
parity with the weights from HF's state dict, from ``save_pretrained``'s files and in the
published ``vision_tower.vision_model.*`` layout; bad checkpoints refused naming the tensor,
text tensors and SigLIP's unused head ignored; bf16 near fp32 and equal to HF's
bf16."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2.model_loader import iter_safetensors
from mrv2.testing import redraw_weights
from mrv2_gemma.siglip import VISION_CHECKPOINT_PREFIXES, Gemma3VisionEncoder

TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
Weights = Iterable[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def hf() -> Any:
    """A tiny Gemma3ForConditionalGeneration (16 patches an image pooled to 4 tokens), its
    weights redrawn far from their init (SigLIP's attention-pooling head is built too: the
    config does not say ``vision_use_head: false``)."""
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION,
                                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    redraw_weights(model)
    return model


def _pixels(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dtype)


def _reference(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf.model.get_image_features(
            pixel_values=pixels, return_dict=True).pooler_output
    return out


def _encoder(hf: Any, weights: Weights) -> tuple[Gemma3VisionEncoder, set[str]]:
    encoder = Gemma3VisionEncoder(hf.config).eval()
    return encoder, encoder.load_weights(weights)


def _published(weights: Weights) -> Weights:
    """The published Gemma 3 files' names: the tower's tensors under ``vision_model.``."""
    for name, tensor in weights:
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        yield name, tensor


def test_prefixes() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {
        "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
        "multi_modal_projector."}


@pytest.mark.parametrize("layout", ["in_memory", "saved", "published"])
def test_matches_hf_fp32(hf: Any, tmp_path: Path, layout: str) -> None:
    """Every parameter is loaded (the head and the text tensors passed over) and the image
    tokens equal HF's to fp32 round-off, for a batch of two images."""
    if layout == "in_memory":
        weights: Weights = hf.state_dict().items()
    else:
        hf.save_pretrained(tmp_path)
        weights = iter_safetensors(tmp_path)
        if layout == "published":
            weights = _published(weights)
    encoder, loaded = _encoder(hf, weights)
    assert loaded == {name for name, _ in encoder.named_parameters()}
    assert encoder.image_size == 32
    pixels = _pixels()
    with torch.no_grad():
        ours = encoder(pixels)
    ref = _reference(hf, pixels)
    assert ours.shape == ref.shape == (2, 4, 64)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_head_and_text_tensors_ignored(hf: Any) -> None:
    state = hf.state_dict()
    assert "model.vision_tower.head.probe" in state  # (the unused SigLIP head is in there)
    encoder, loaded = _encoder(hf, [
        ("language_model.model.embed_tokens.weight", torch.zeros(3)),
        ("model.language_model.norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("vision_tower.vision_model.head.probe", torch.zeros(3)),
        ("model.vision_tower.head.attention.in_proj_weight", torch.zeros(3))])
    assert loaded == set()


@pytest.mark.parametrize("name", [
    "model.vision_tower.encoder.layers.2.mlp.fc1.weight",
    "vision_tower.vision_model.embeddings.class_embedding",
    "multi_modal_projector.mm_input_projection_bias",
])
def test_unknown_name_refused(hf: Any, name: str) -> None:
    encoder = Gemma3VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(32))])


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_tower.embeddings.patch_embedding.weight", (32, 192)),
    ("vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight", (32, 48)),
    ("multi_modal_projector.mm_input_projection_weight", (64, 32)),
])
def test_shape_mismatch_refused(hf: Any, name: str, shape: tuple[int, ...]) -> None:
    encoder = Gemma3VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


def test_bad_pixels_refused(hf: Any) -> None:
    encoder = Gemma3VisionEncoder(hf.config)
    with pytest.raises(ValueError, match="pixel_values"):
        encoder(torch.zeros(1, 3, 16, 16))


def test_bf16(hf: Any) -> None:
    """In bf16 the encoder computes in bf16 (fp32 pixels cast in): near its fp32 output and
    equal to HF's model in bf16 up to bf16 round-off."""
    encoder, _ = _encoder(hf, hf.state_dict().items())
    pixels = _pixels()
    with torch.no_grad():
        ref = encoder(pixels)
        ours = encoder.to(torch.bfloat16)(pixels)
    assert ours.dtype == torch.bfloat16
    assert ours.shape == ref.shape
    err = (ours.float() - ref).norm() / ref.norm()
    assert err < 0.03, err
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    torch.testing.assert_close(ours, _reference(hf_bf16, pixels))
