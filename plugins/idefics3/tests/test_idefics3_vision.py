"""Idefics3's image encoder (:class:`~mrv2_idefics3.vision.Idefics3VisionEncoder`: the
SigLIP-style tower, the pixel shuffle, the modality projection) against HF's
``get_image_features(...).pooler_output``, one image's tiles at a time: fp32 parity for
Idefics3's (``scale_factor`` 2) and SmolVLM's (4) configs and for tiles smaller than the
tower's ``image_size`` (position buckets); the position ids equal HF's in fp32 and bf16 (where
bf16 rounding repeats buckets); the weights from HF's state dict, ``save_pretrained``'s files
and without the ``model.`` wrapper; bad checkpoints, configs and pixels refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2.model_loader import iter_safetensors
from mrv2.testing import redraw_weights
from mrv2_idefics3.vision import (
    VISION_CHECKPOINT_PREFIXES,
    Idefics3VisionEncoder,
    position_ids,
    tokens_per_tile,
)

TEXT: dict[str, Any] = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 1,
                        "num_attention_heads": 4, "num_key_value_heads": 2}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
#: name -> (config class, vision overrides, scale_factor, tile side, tokens per tile)
VARIANTS: dict[str, tuple[Any, dict[str, Any], int, int, int]] = {
    "idefics3": (transformers.Idefics3Config, {}, 2, 16, 4),
    "smolvlm": (transformers.SmolVLMConfig, {"image_size": 32, "hidden_act": "gelu"}, 4, 32, 4),
    "bucketed": (transformers.Idefics3Config, {"image_size": 24}, 2, 16, 4),  # (4 of 6 sides)
    "floored": (transformers.Idefics3Config, {"image_size": 18}, 2, 18, 4),  # (2 pixels over)
}


def _config(kind: str) -> Any:
    cls, vision, scale, _, _ = VARIANTS[kind]
    return cls(text_config=dict(TEXT), vision_config={**VISION, **vision}, scale_factor=scale,
               image_token_id=300)


def _hf(kind: str) -> Any:
    config = _config(kind)
    torch.manual_seed(0)
    name = ("SmolVLMForConditionalGeneration" if kind == "smolvlm"
            else "Idefics3ForConditionalGeneration")
    model = getattr(transformers, name)(config).eval()
    redraw_weights(model)
    return model


def _reference(hf: Any, tiles: torch.Tensor) -> torch.Tensor:
    """HF's features of one image's tiles ``[T, tokens, text_hidden]``."""
    mask = torch.ones(1, tiles.shape[0], *tiles.shape[-2:], dtype=torch.long)
    with torch.no_grad():
        return hf.model.get_image_features(pixel_values=tiles[None].to(hf.dtype),
                                           pixel_attention_mask=mask).pooler_output.float()


def _tiles(count: int, side: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(count, 3, side, side, generator=gen) * 2 - 1


def _encoder(hf: Any, weights: Any) -> tuple[Idefics3VisionEncoder, set[str]]:
    encoder = Idefics3VisionEncoder(hf.config).eval()
    return encoder, encoder.load_weights(weights)


def _bare(weights: Any) -> Any:
    """The names without transformers' ``model.`` wrapper."""
    for name, tensor in weights:
        yield name.removeprefix("model."), tensor


def test_prefixes_and_tokens() -> None:
    assert set(VISION_CHECKPOINT_PREFIXES) == {"model.vision_model.", "model.connector.",
                                               "vision_model.", "connector."}
    assert tokens_per_tile(364, 14, 2) == 169 and tokens_per_tile(512, 16, 4) == 64
    assert tokens_per_tile(384, 14, 3) == 81
    for side in (30, 4):
        with pytest.raises(ValueError, match="not a positive multiple of scale_factor 2"):
            tokens_per_tile(side, 4, 2)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
@pytest.mark.parametrize("layout", ["in_memory", "saved", "bare"])
def test_matches_hf_fp32(kind: str, layout: str, tmp_path: Path) -> None:
    """Every parameter loaded (the text tensors passed over); an image's tiles together and
    each tile alone equal HF's features to fp32 round-off."""
    hf = _hf(kind)
    weights: Any = hf.state_dict().items()
    if layout == "saved":
        hf.save_pretrained(tmp_path)
        weights = iter_safetensors(tmp_path)
    elif layout == "bare":
        weights = _bare(weights)
    encoder, loaded = _encoder(hf, weights)
    assert loaded == {name for name, _ in encoder.named_parameters()}
    _, _, _, side, tokens = VARIANTS[kind]
    tiles = _tiles(3, side, seed=1)
    ref = _reference(hf, tiles)
    assert ref.shape == (3, tokens, 64) and encoder.tokens_per_tile(side) == tokens
    with torch.no_grad():
        together = encoder(tiles)
        alone = torch.cat([encoder(tiles[n:n + 1]) for n in range(3)])
    scale = ref.abs().max().item()
    for ours in (together, alone):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * scale)


def _hf_position_ids(hf: Any, side: int) -> torch.Tensor:
    """The position ids HF's embeddings pick for a full tile of ``side`` pixels (a hook on
    the position table)."""
    seen: list[torch.Tensor] = []
    table = hf.model.vision_model.embeddings.position_embedding
    handle = table.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        _reference(hf, _tiles(1, side, seed=0))
    finally:
        handle.remove()
    return seen[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_position_ids_as_hf(dtype: torch.dtype) -> None:
    """A 6-bucket table (``image_size`` 24, patch 4): tiles of 16 and 24 pixels, in fp32 and
    in bf16, where HF's rounded fractions repeat a bucket (``[..., 4, 4]``) and ours do too."""
    hf = _hf("bucketed").to(dtype)
    for side in (16, 24):
        ours = position_ids(side // 4, side // 4, 6, dtype, torch.device("cpu"))
        assert torch.equal(ours, _hf_position_ids(hf, side)), side
    rows = position_ids(6, 6, 6, dtype, torch.device("cpu")).view(6, 6)[0]
    assert rows.tolist() == ([0, 1, 2, 3, 4, 4] if dtype == torch.bfloat16
                             else list(range(6)))


def test_bf16_near_hf() -> None:
    """bf16 weights compute in bf16, near HF's own bf16 model (both with bf16's repeated
    buckets, which move them both away from the fp32 output)."""
    hf = _hf("bucketed")
    encoder, _ = _encoder(hf, hf.state_dict().items())
    encoder = encoder.to(torch.bfloat16)
    tiles = _tiles(2, 24, seed=2)
    ref, ref_half = _reference(hf, tiles), _reference(hf.to(torch.bfloat16), tiles)
    with torch.no_grad():
        ours = encoder(tiles)
    assert ours.dtype == torch.bfloat16
    err = ((ours.float() - ref_half).norm() / ref_half.norm()).item()
    assert err < 0.01, err
    assert ((ref_half - ref).norm() / ref.norm()) > 3 * err  # (the buckets, not round-off)


def test_text_tensors_ignored() -> None:
    encoder = Idefics3VisionEncoder(_config("idefics3"))
    assert encoder.load_weights([
        ("model.text_model.embed_tokens.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(3)),
        ("model.vision_model.embeddings.position_ids", torch.zeros(3))]) == set()


@pytest.mark.parametrize(("name", "shape"), [
    ("model.vision_model.encoder.layers.2.mlp.fc1.weight", (48, 32)),  # (2 layers)
    ("model.connector.modality_projection.proj.bias", (64,)),  # (no bias)
    ("model.vision_model.head.probe", (1, 1, 32)),
    ("model.connector.modality_projection.proj.weight", (64, 64)),  # (32 * 2**2 = 128 in)
    ("vision_model.embeddings.position_embedding.weight", (36, 32)),
])
def test_bad_tensor_refused(name: str, shape: tuple[int, ...]) -> None:
    encoder = Idefics3VisionEncoder(_config("idefics3"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        encoder.load_weights([(name, torch.zeros(shape))])


@pytest.mark.parametrize(("field", "vision", "top"), [
    ("vision_config.model_type", {"model_type": "siglip_vision_model"}, {}),
    ("vision_config.hidden_act", {"hidden_act": "swish_x"}, {}),
    ("vision_config.image_size", {"image_size": 2}, {}),
    ("vision_config.patch_size", {"patch_size": [4, 2]}, {}),
    ("scale_factor", {}, {"scale_factor": 0}),
])
def test_unsupported_config_refused(field: str, vision: dict[str, Any],
                                    top: dict[str, Any]) -> None:
    config = _config("idefics3")  # (set past the config's validation, as an edited file could)
    for key, value in vision.items():
        object.__setattr__(config.vision_config, key, value)
    for key, value in top.items():
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=field):
        Idefics3VisionEncoder(config)


@pytest.mark.parametrize("shape", [(3, 16, 16), (1, 3, 16, 12), (1, 1, 16, 16), (1, 3, 12, 12),
                                   (1, 3, 4, 4)])
def test_bad_pixels_refused(shape: tuple[int, ...]) -> None:
    encoder = Idefics3VisionEncoder(_config("idefics3"))
    with pytest.raises(ValueError, match="pixel_values"):
        encoder(torch.zeros(shape))
