"""Qwen2.5-VL vision tower against HF transformers' ``Qwen2_5_VisionTransformerPretrainedModel``
(CPU, fp32): the merged image tokens the LLM consumes, for single, multiple, multi-window
(uneven windows) and multi-frame inputs, plus checkpoint-name and shape handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mrv2_qwen_vl.testing import random_patches
from mrv2_qwen_vl.vision import CHECKPOINT_PREFIXES, Qwen25VisionTower

PATCH = 14
MERGE = 2
WINDOW = 56  # 2 x 2 merge blocks = 4 x 4 patches per window


def tiny_config(fullatt: list[int] | None = None) -> transformers.Qwen2_5_VLConfig:
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 5, 5]},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=48,
            patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE,
            window_size=WINDOW, fullatt_block_indexes=[1] if fullatt is None else fullatt,
        ),
    )


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Weights far from init: norms uniform [0.5, 1.5), everything else normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


class Ref:
    """A tiny HF model with redrawn weights, saved with ``save_pretrained``."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        self.config = tiny_config()
        self.model: Any = transformers.Qwen2_5_VLForConditionalGeneration(self.config).eval()
        redraw(self.model.model.visual, seed=1)
        self.model.save_pretrained(root)
        self.ckpt = load_file(str(root / "model.safetensors"))

    def image_tokens(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """What HF feeds the LLM: ``get_image_features``' per-image pooler outputs."""
        with torch.no_grad():
            out = self.model.model.get_image_features(pixels, image_grid_thw=grid)
        return torch.cat(list(out.pooler_output), dim=0)


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Ref:
    return Ref(tmp_path_factory.mktemp("qwen25vl"))


def visual_weights(ckpt: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in ckpt.items() if k.startswith("visual.")]


@pytest.fixture(scope="module")
def tower(ref: Ref) -> Qwen25VisionTower:
    tower = Qwen25VisionTower(ref.config.vision_config).eval()
    loaded = tower.load_weights(ref.ckpt.items())  # text weights in the mix: ignored
    assert loaded == {name for name, _ in tower.named_parameters()}
    return tower


def pixels_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_patches(grids, PATCH, seed)


def check(tower: Qwen25VisionTower, ref: Ref, grids: list[tuple[int, int, int]],
          seed: int) -> torch.Tensor:
    pixels, grid = pixels_for(grids, seed)
    expected = ref.image_tokens(pixels, grid)
    with torch.no_grad():
        got = tower(pixels, grid)
    n_tokens = sum(t * h * w for t, h, w in grids) // MERGE**2
    assert got.shape == expected.shape == (n_tokens, 48)
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    return got


def test_checkpoint_names(ref: Ref) -> None:
    """5.17's save_pretrained writes ``visual.*``; its in-memory state dict says
    ``model.visual.*``. Both load to the same tensors."""
    assert visual_weights(ref.ckpt) and not any(k.startswith("model.visual.") for k in ref.ckpt)
    assert set(CHECKPOINT_PREFIXES) >= {"visual.", "model.visual."}
    a = Qwen25VisionTower(ref.config.vision_config)
    b = Qwen25VisionTower(ref.config.vision_config)
    a.load_weights(visual_weights(ref.ckpt))
    mem = ref.model.state_dict()
    assert b.load_weights(mem.items()) == {name for name, _ in b.named_parameters()}
    conv = mem["model.visual.patch_embed.proj.weight"]
    assert conv.dim() == 5
    torch.testing.assert_close(b.patch_embed.proj.weight, conv.reshape(conv.shape[0], -1))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_single_image(tower: Qwen25VisionTower, ref: Ref) -> None:
    check(tower, ref, [(1, 4, 8)], seed=2)


def test_two_images(tower: Qwen25VisionTower, ref: Ref) -> None:
    check(tower, ref, [(1, 4, 4), (1, 8, 12)], seed=3)


def test_uneven_windows_and_frames(tower: Qwen25VisionTower, ref: Ref) -> None:
    """6 x 10 patches = 3 x 5 merge blocks -> 2 x 3 windows of 2x2, 2x1, 1x2 and 1x1 blocks
    (HF pads the grid); then a 2-frame entry (its frames attend separately even in the
    full-attention block) and a one-block image."""
    grids = [(1, 6, 10), (2, 4, 6), (1, 2, 2)]
    plan = tower.plan(torch.tensor(grids))
    window_lens = sorted({int(g.shape[1]) for g in plan.window_groups})
    assert window_lens == [4, 8, 16]  # full, half and quarter windows (in patches)
    assert sum(int(g.numel()) for g in plan.window_groups) == plan.num_patches
    got = check(tower, ref, grids, seed=4)
    # The window scheme matters: all-full attention gives something else.
    full = Qwen25VisionTower(tiny_config(fullatt=[0, 1, 2]).vision_config).eval()
    full.load_weights(visual_weights(ref.ckpt))
    with torch.no_grad():
        other = full(*pixels_for(grids, seed=4))
    assert (other - got).abs().max().item() > 1e-2


def test_bad_shape_names_parameter(ref: Ref) -> None:
    tower = Qwen25VisionTower(ref.config.vision_config)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight"):
        tower.load_weights([("visual.blocks.1.attn.qkv.weight", torch.randn(32, 96))])
    with pytest.raises(ValueError, match=r"patch_embed\.proj\.weight"):
        tower.load_weights([("model.visual.patch_embed.proj.weight",
                             torch.randn(32, 3, 2, PATCH, PATCH - 1))])
    with pytest.raises(ValueError, match=r"merger\.mlp\.2\.bias"):
        tower.load_weights([("visual.merger.mlp.2.bias", torch.randn(47))])
