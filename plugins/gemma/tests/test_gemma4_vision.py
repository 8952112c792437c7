"""Gemma 4's image encoder (:class:`~mrv2_gemma.gemma4_vision.Gemma4VisionEncoder`: the vision
tower, the pooler and the vision embedder) against HF's ``get_image_features(...)
.pooler_output``, image by image, on inputs from HF's own image processor (two images of
different sizes, so both have padding patches): fp32 parity with the weights from HF's state
dict, from ``save_pretrained``'s files and in the layout without ``model.``, for a config with
clipped linears (finite bounds that bite), standardization and grouped kv heads and a plain
one; bad checkpoints, inputs and configs refused; bf16 near fp32 and near HF's bf16."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2.model_loader import iter_safetensors
from mrv2.testing import random_image, redraw_weights
from mrv2_gemma.gemma4_vision import VISION_CHECKPOINT_PREFIXES, Gemma4VisionEncoder

TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
    "layer_types": ["full_attention"], "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 320}
BASE_VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 2, "head_dim": 16, "position_embedding_size": 48}
#: "clipped": patch 4, 2 x 2 pooling, clipped linears, standardization, one kv head;
#: "plain": patch 8, 3 x 3 pooling, neither option.
VISIONS: dict[str, dict[str, Any]] = {
    "clipped": {**BASE_VISION, "patch_size": 4, "pooling_kernel_size": 2,
                "num_key_value_heads": 1, "use_clipped_linears": True, "standardize": True},
    "plain": {**BASE_VISION, "patch_size": 8, "pooling_kernel_size": 3,
              "num_key_value_heads": 2, "rope_parameters": {"rope_type": "axial",
                                                            "rope_theta": 30.0}},
}
IMAGE_SIZES = ((30, 50), (90, 28))  # (height, width)
Weights = Iterable[tuple[str, torch.Tensor]]
_OPTIONAL = ("_min", "_max", "std_bias", "std_scale")  # buffers of the two options


def _config(vision: dict[str, Any]) -> Any:
    return transformers.Gemma4Config(text_config=TEXT, vision_config=vision, audio_config=None)


def _redraw(model: Any) -> None:
    """Weights far from init; clip bounds finite (in [-2, -1) / [1, 2): they bite), the
    standardization's bias normal(0, 0.5), scale in [0.5, 1.5)."""
    redraw_weights(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            sign = -1.0 if name.endswith("_min") else 1.0
            if name.endswith(("_min", "_max")):
                buf.fill_(sign * (1.0 + torch.rand((), generator=gen).item()))
            elif name.endswith("std_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
            elif name.endswith("std_scale"):
                buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)


@pytest.fixture(scope="module", params=list(VISIONS))
def hf(request: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(_config(VISIONS[request.param])).eval()
    _redraw(model)
    return model


def _inputs(config: Any) -> dict[str, torch.Tensor]:
    """The two images through HF's image processor: ``pixel_values [2, max_patches, 3 P P]``,
    ``image_position_ids [2, max_patches, 2]``, ``num_soft_tokens_per_image [2]``."""
    vc = config.vision_config
    processor = transformers.Gemma4ImageProcessorPil(
        patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
        max_soft_tokens=70)
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    out: dict[str, torch.Tensor] = dict(processor(images, return_tensors="pt"))
    return out


def _reference(hf: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out: tuple[torch.Tensor, ...] = hf.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"],
            return_dict=True).pooler_output
    return out


def _ours(encoder: Gemma4VisionEncoder, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder(pixels, positions) for pixels, positions
                in zip(inputs["pixel_values"], inputs["image_position_ids"], strict=True)]


def _encoder(hf: Any, weights: Weights) -> tuple[Gemma4VisionEncoder, set[str]]:
    encoder = Gemma4VisionEncoder(hf.config).eval()
    return encoder, encoder.load_weights(weights)


def _without_model_prefix(weights: Weights) -> Weights:
    for name, tensor in weights:
        yield name.removeprefix("model."), tensor


def test_prefixes() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {
        "model.vision_tower.", "vision_tower.", "model.embed_vision.", "embed_vision."}


@pytest.mark.parametrize("layout", ["in_memory", "saved", "no_model_prefix"])
def test_matches_hf_fp32(hf: Any, tmp_path: Path, layout: str) -> None:
    """Every parameter and buffer is loaded, and each image's soft tokens equal its rows of
    HF's output to fp32 round-off."""
    if layout == "in_memory":
        weights: Weights = hf.state_dict().items()
    else:
        hf.save_pretrained(tmp_path)
        weights = iter_safetensors(tmp_path)
        if layout == "no_model_prefix":
            weights = _without_model_prefix(weights)
    encoder, loaded = _encoder(hf, weights)
    assert loaded == set(encoder.state_dict())
    assert {name for name, _ in encoder.named_parameters()} <= loaded
    inputs = _inputs(hf.config)
    positions = inputs["image_position_ids"]
    assert ((positions == -1).all(-1).sum(-1) > 0).all()  # both images have padding
    ours, ref = _ours(encoder, inputs), _reference(hf, inputs)
    assert [len(t) for t in ours] == [len(t) for t in ref] == (
        inputs["num_soft_tokens_per_image"].tolist())
    with torch.no_grad():  # the engine's call: the grid known on the host (no device reads)
        gridded = [encoder(pixels, where, _grid(where)) for pixels, where
                   in zip(inputs["pixel_values"], positions, strict=True)]
    for mine, grid_rows, theirs in zip(ours, gridded, ref, strict=True):
        assert mine.dtype == torch.float32 and mine.shape[1] == 64
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())
        torch.testing.assert_close(grid_rows, mine, rtol=0, atol=0)


def _grid(positions: torch.Tensor) -> tuple[int, int]:
    real = positions[positions[:, 0] >= 0]
    return int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1


def test_clip_bounds_and_standardization_matter(hf: Any) -> None:
    """The test's clip bounds and standardization change the output (so the parity test
    checks them); without the options neither HF nor the encoder has those buffers."""
    state = hf.state_dict()
    if not hf.config.vision_config.use_clipped_linears:
        encoder = Gemma4VisionEncoder(hf.config)
        assert not [n for n in [*state, *encoder.state_dict()] if n.endswith(_OPTIONAL)]
        return
    inputs = _inputs(hf.config)
    encoder, _ = _encoder(hf, state.items())
    reference = _ours(encoder, inputs)[0]
    for suffix in ("_min", "_max", "std_bias"):
        assert [n for n in state if n.endswith(suffix)]
        names = [n for n in state if n.endswith(suffix)]
        neutral = -torch.inf if suffix == "_min" else torch.inf if suffix == "_max" else 0.0
        encoder, _ = _encoder(hf, [*state.items(), *((n, torch.full_like(state[n], neutral))
                                                     for n in names)])
        assert not torch.allclose(_ours(encoder, inputs)[0], reference), suffix


def test_other_tensors_ignored(hf: Any) -> None:
    encoder, loaded = _encoder(hf, [
        ("model.language_model.embed_tokens.weight", torch.zeros(3)),
        ("language_model.model.norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("model.audio_tower.layers.0.weight", torch.zeros(3)),
        ("model.embed_audio.embedding_projection.weight", torch.zeros(3))])
    assert loaded == set()


@pytest.mark.parametrize("name", [
    "model.vision_tower.encoder.layers.2.mlp.up_proj.linear.weight",
    "vision_tower.patch_embedder.input_proj.bias",
    "model.embed_vision.embedding_projection.bias",
    "model.vision_tower.encoder.rotary_emb.inv_freq",
])
def test_unknown_name_refused(hf: Any, name: str) -> None:
    encoder = Gemma4VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(32))])


def test_clip_bounds_refused_without_clipping() -> None:
    encoder = Gemma4VisionEncoder(_config(VISIONS["plain"]))
    name = "model.vision_tower.encoder.layers.0.self_attn.q_proj.input_min"
    with pytest.raises(ValueError, match=r"q_proj\.input_min"):
        encoder.load_weights([(name, torch.tensor(-1.0))])


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_tower.patch_embedder.input_proj.weight", (48, 32)),
    ("vision_tower.encoder.layers.1.self_attn.k_proj.linear.weight", (16, 16)),
    ("model.vision_tower.patch_embedder.position_embedding_table", (2, 47, 32)),
    ("embed_vision.embedding_projection.weight", (32, 64)),
])
def test_shape_mismatch_refused(hf: Any, name: str, shape: tuple[int, ...]) -> None:
    encoder = Gemma4VisionEncoder(hf.config)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


def test_bad_inputs_refused(hf: Any) -> None:
    encoder = Gemma4VisionEncoder(hf.config)
    inputs = _inputs(hf.config)
    pixels, positions = inputs["pixel_values"][0], inputs["image_position_ids"][0]
    cut = positions.clone()
    cut[0] = -1  # a hole in the grid
    for bad in [(pixels[:, :-1], positions), (pixels[:-1], positions[:-1]), (pixels, cut),
                (pixels, positions[:, :1]), (pixels, torch.full_like(positions, -1))]:
        with pytest.raises(ValueError, match="pixel_values|position_ids"):
            encoder(*bad)


@pytest.mark.parametrize(("field", "value"), [
    ("pooling_kernel_size", 1), ("hidden_activation", "relu"), ("head_dim", 18),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 100.0}),
])
def test_unsupported_config_refused(field: str, value: Any) -> None:
    config = _config(VISIONS["plain"])
    setattr(config.vision_config, field, value)
    with pytest.raises(ValueError, match=field):
        Gemma4VisionEncoder(config)


def test_bf16(hf: Any, tmp_path: Path) -> None:
    """In bf16 (HF's model loaded with ``dtype=bfloat16``, as served) the encoder is as near
    fp32 as HF's model is, near HF's output, and equal to it up to bf16 round-off on the
    image's patches without padding (HF's bf16 attention over the padded rows rounds a little
    differently)."""
    encoder, _ = _encoder(hf, hf.state_dict().items())
    inputs = _inputs(hf.config)
    ref = _ours(encoder, inputs)
    ours = _ours(encoder.to(torch.bfloat16), inputs)
    hf.save_pretrained(tmp_path)
    hf_bf16 = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.bfloat16).eval()
    padded = _reference(hf_bf16, inputs)
    for i, (mine, fp32, theirs) in enumerate(zip(ours, ref, padded, strict=True)):
        assert mine.dtype == theirs.dtype == torch.bfloat16

        def err(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a.float() - b.float()).norm() / b.float().norm()).item()

        assert err(mine, fp32) < 1.1 * err(theirs, fp32) + 1e-3 < 0.06
        assert err(mine, theirs) < 0.01
        real = (inputs["image_position_ids"][i] != -1).all(-1)
        unpadded = {"pixel_values": inputs["pixel_values"][i][real][None],
                    "image_position_ids": inputs["image_position_ids"][i][real][None]}
        (theirs,) = _reference(hf_bf16, unpadded)
        torch.testing.assert_close(mine, theirs)
