"""Qwen3-VL vision tower against HF transformers' ``Qwen3VLVisionModel`` (CPU, fp32): the merged
image tokens and every deepstack feature the LLM consumes, for single, multiple, interpolated
and multi-frame inputs, plus checkpoint-name and shape handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mrv2_qwen_vl.testing import random_patches
from mrv2_qwen_vl.vision_qwen3 import CHECKPOINT_PREFIXES, Qwen3VisionTower

PATCH = 16
MERGE = 2
OUT = 48  # text hidden size


def tiny_config(deepstack: list[int] | None = None) -> transformers.Qwen3VLConfig:
    return transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=OUT, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=24, bos_token_id=0,
            eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 4, 4], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=OUT,
            patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE,
            num_position_embeddings=16,  # a 4 x 4 learned grid
            deepstack_visual_indexes=[0, 1] if deepstack is None else deepstack,
        ),
    )


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Weights far from init: norm weights uniform [0.5, 1.5), the rest normal(0, 0.1)
    (the position table: normal(0, 1), so it matters next to the patch embedding)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif name.startswith("pos_embed"):
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


class Ref:
    """A tiny HF model with redrawn vision weights, saved with ``save_pretrained``."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        self.config = tiny_config()
        self.model: Any = transformers.Qwen3VLForConditionalGeneration(self.config).eval()
        redraw(self.model.model.visual, seed=1)
        self.model.save_pretrained(root)
        self.ckpt = load_file(str(root / "model.safetensors"))

    def features(self, pixels: torch.Tensor,
                 grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What HF feeds the LLM: ``get_image_features``' per-image pooler outputs
        (concatenated, as ``Qwen3VLModel.forward`` does) and its deepstack features."""
        with torch.no_grad():
            out = self.model.model.get_image_features(pixels, image_grid_thw=grid)
        return torch.cat(list(out.pooler_output), dim=0), list(out.deepstack_features)


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Ref:
    return Ref(tmp_path_factory.mktemp("qwen3vl"))


def visual_weights(ckpt: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in ckpt.items() if k.startswith("model.visual.")]


@pytest.fixture(scope="module")
def tower(ref: Ref) -> Qwen3VisionTower:
    tower = Qwen3VisionTower(ref.config.vision_config).eval()
    loaded = tower.load_weights(ref.ckpt.items())  # text weights in the mix: ignored
    assert loaded == {name for name, _ in tower.named_parameters()}
    return tower


def pixels_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_patches(grids, PATCH, seed)


def assert_match(got: torch.Tensor, expected: torch.Tensor, n_tokens: int) -> None:
    assert got.shape == expected.shape == (n_tokens, OUT)
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


def check(tower: Qwen3VisionTower, ref: Ref, grids: list[tuple[int, int, int]],
          seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pixels, grid = pixels_for(grids, seed)
    expected, expected_deep = ref.features(pixels, grid)
    with torch.no_grad():
        got, got_deep = tower(pixels, grid)
    n_tokens = sum(t * h * w for t, h, w in grids) // MERGE**2
    assert_match(got, expected, n_tokens)
    assert len(got_deep) == len(expected_deep) == 2
    for g, e in zip(got_deep, expected_deep, strict=True):
        assert_match(g, e, n_tokens)
    return got, got_deep


def test_checkpoint_names(ref: Ref) -> None:
    """5.17's save_pretrained writes ``model.visual.*`` for Qwen3-VL (also the in-memory
    names); ``visual.*`` loads the same."""
    assert visual_weights(ref.ckpt) and not any(k.startswith("visual.") for k in ref.ckpt)
    assert set(CHECKPOINT_PREFIXES) >= {"visual.", "model.visual."}
    a = Qwen3VisionTower(ref.config.vision_config)
    b = Qwen3VisionTower(ref.config.vision_config)
    assert a.load_weights(visual_weights(ref.ckpt)) == {n for n, _ in a.named_parameters()}
    stripped = [(k[len("model."):], v) for k, v in visual_weights(ref.ckpt)]
    assert b.load_weights(stripped) == {n for n, _ in b.named_parameters()}
    conv = ref.ckpt["model.visual.patch_embed.proj.weight"]
    assert conv.dim() == 5 and "model.visual.patch_embed.proj.bias" in ref.ckpt
    torch.testing.assert_close(b.patch_embed.proj.weight, conv.reshape(conv.shape[0], -1))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_single_image(tower: Qwen3VisionTower, ref: Ref) -> None:
    """4 x 6 patches: rows hit the 4 x 4 table exactly, columns interpolate."""
    check(tower, ref, [(1, 4, 6)], seed=2)


def test_two_images(tower: Qwen3VisionTower, ref: Ref) -> None:
    check(tower, ref, [(1, 4, 4), (1, 6, 10)], seed=3)


def test_interpolation_and_frames(tower: Qwen3VisionTower, ref: Ref) -> None:
    """Grids off the learned 4 x 4 one (upsampled, downsampled to 2 rows) and a 2-frame entry
    (its frames attend separately and share the position embedding). The interpolated
    position embedding matters: a nearest-tap variant gives something else."""
    grids = [(1, 8, 6), (2, 2, 4), (1, 2, 2)]
    plan = tower.plan(torch.tensor(grids))
    assert sorted(int(g.shape[1]) for g in plan.groups) == [4, 8, 48]
    assert not torch.all((plan.pos_weight == 0) | (plan.pos_weight == 1))
    got, _ = check(tower, ref, grids, seed=4)
    nearest = plan.pos_weight.argmax(-1, keepdim=True)
    plan.pos_weight = torch.zeros_like(plan.pos_weight).scatter_(-1, nearest, 1.0)
    with torch.no_grad():
        other, _ = tower(pixels_for(grids, seed=4)[0], grids, plan=plan)
    assert (other - got).abs().max().item() > 1e-2


def test_deepstack_order_unsorted_indexes() -> None:
    """HF returns the deepstack features in block order, whatever the config order: with
    ``[2, 0]`` merger 1 (block 0) comes first."""
    cfg = tiny_config(deepstack=[2, 0]).vision_config
    torch.manual_seed(0)
    hf: Any = transformers.Qwen3VLVisionModel(cfg).eval()
    redraw(hf, seed=5)
    tower = Qwen3VisionTower(cfg).eval()
    tower.load_weights((f"visual.{k}", v) for k, v in hf.state_dict().items())
    assert tower.deepstack_layers == [0, 2]
    grids = [(1, 4, 6)]
    pixels, grid = pixels_for(grids, seed=6)
    with torch.no_grad():
        out = hf(pixels, grid_thw=grid)
        got, got_deep = tower(pixels, grid)
    assert_match(got, out.pooler_output, 6)
    assert len(got_deep) == len(out.deepstack_features) == 2
    for g, e in zip(got_deep, out.deepstack_features, strict=True):
        assert_match(g, e, 6)


def test_bad_shape_names_parameter(ref: Ref) -> None:
    tower = Qwen3VisionTower(ref.config.vision_config)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight"):
        tower.load_weights([("model.visual.blocks.1.attn.qkv.weight", torch.randn(32, 96))])
    with pytest.raises(ValueError, match=r"patch_embed\.proj\.weight"):
        tower.load_weights([("model.visual.patch_embed.proj.weight",
                             torch.randn(32, 3, 2, PATCH, PATCH - 1))])
    with pytest.raises(ValueError, match=r"deepstack_merger_list\.1\.norm\.weight"):
        tower.load_weights([("visual.deepstack_merger_list.1.norm.weight", torch.randn(32))])
    with pytest.raises(ValueError, match=r"pos_embed\.weight"):
        tower.load_weights([("model.visual.pos_embed.weight", torch.randn(25, 32))])
