"""Qwen2-VL vision tower against HF transformers' ``Qwen2VisionTransformerPretrainedModel``
(CPU, fp32): the merged image tokens the LLM consumes, for single, multiple and multi-frame
inputs, plus the config's field names, checkpoint names and shape handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mrv2_qwen_vl.testing import random_patches
from mrv2_qwen_vl.vision import _group_segments
from mrv2_qwen_vl.vision_qwen2 import CHECKPOINT_PREFIXES, Qwen2VisionTower

PATCH = 14
MERGE = 2
WIDTH = 32  # vision embed_dim
OUT = 48  # vision hidden_size == text hidden size


def tiny_config() -> transformers.Qwen2VLConfig:
    return transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=OUT, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 5, 5]},
        ),
        vision_config=dict(
            depth=2, embed_dim=WIDTH, num_heads=2, hidden_size=OUT, mlp_ratio=2,
            patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE,
        ),
    )


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Weights far from init: LayerNorm weights uniform [0.5, 1.5), everything else (LayerNorm
    biases included) normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


class Ref:
    """A tiny HF model with redrawn vision weights, saved with ``save_pretrained``."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        self.config = tiny_config()
        self.model: Any = transformers.Qwen2VLForConditionalGeneration(self.config).eval()
        redraw(self.model.model.visual, seed=1)
        self.model.save_pretrained(root)
        self.ckpt = load_file(str(root / "model.safetensors"))

    def image_tokens(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """What HF feeds the LLM: ``get_image_features``' per-image pooler outputs
        (concatenated, as ``Qwen2VLModel.forward`` does)."""
        with torch.no_grad():
            out = self.model.model.get_image_features(pixels, image_grid_thw=grid)
        return torch.cat(list(out.pooler_output), dim=0)


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Ref:
    return Ref(tmp_path_factory.mktemp("qwen2vl"))


def visual_weights(ckpt: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in ckpt.items() if k.startswith("visual.")]


def all_params(tower: torch.nn.Module) -> set[str]:
    return {name for name, _ in tower.named_parameters()}


@pytest.fixture(scope="module")
def tower(ref: Ref) -> Qwen2VisionTower:
    tower = Qwen2VisionTower(ref.config.vision_config).eval()
    loaded = tower.load_weights(ref.ckpt.items())  # text weights in the mix: ignored
    assert loaded == all_params(tower)
    return tower


def pixels_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_patches(grids, PATCH, seed)


def check(tower: Qwen2VisionTower, ref: Ref, grids: list[tuple[int, int, int]],
          seed: int) -> torch.Tensor:
    pixels, grid = pixels_for(grids, seed)
    expected = ref.image_tokens(pixels, grid)
    with torch.no_grad():
        got = tower(pixels, grid)
    n_tokens = sum(t * h * w for t, h, w in grids) // MERGE**2
    assert got.shape == expected.shape == (n_tokens, OUT)
    scale = expected.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    return got


def test_config_fields(tower: Qwen2VisionTower) -> None:
    """``embed_dim`` is the tower width, ``hidden_size`` the output; the MLP is
    ``embed_dim * mlp_ratio`` wide, ungated, quick_gelu; LayerNorms everywhere."""
    assert (tower.hidden_size, tower.out_hidden_size, tower.depth) == (WIDTH, OUT, 2)
    assert tower.patch_dim == 3 * 2 * PATCH * PATCH
    assert tower.patch_embed.proj.weight.shape == (WIDTH, tower.patch_dim)
    assert tower.patch_embed.proj.bias is None
    block: Any = tower.blocks[0]
    assert block.mlp.fc1.weight.shape == (2 * WIDTH, WIDTH)
    assert isinstance(block.norm1, torch.nn.LayerNorm) and block.norm1.eps == 1e-6
    assert isinstance(tower.merger.ln_q, torch.nn.LayerNorm)
    assert block.attn.qkv.bias is not None
    x = torch.randn(5)
    torch.testing.assert_close(block.mlp.act(x), x * torch.sigmoid(1.702 * x))


def test_checkpoint_names(ref: Ref) -> None:
    """5.17's save_pretrained writes ``visual.*`` (as the Qwen2-VL release); its in-memory
    state dict says ``model.visual.*``. Both load to the same tensors."""
    assert visual_weights(ref.ckpt) and not any(k.startswith("model.visual.") for k in ref.ckpt)
    assert set(CHECKPOINT_PREFIXES) >= {"visual.", "model.visual."}
    a = Qwen2VisionTower(ref.config.vision_config)
    b = Qwen2VisionTower(ref.config.vision_config)
    assert a.load_weights(visual_weights(ref.ckpt)) == all_params(a)
    mem = ref.model.state_dict()
    assert any(k.startswith("model.visual.") for k in mem)
    assert b.load_weights(mem.items()) == all_params(b)
    conv = mem["model.visual.patch_embed.proj.weight"]
    assert conv.dim() == 5
    torch.testing.assert_close(b.patch_embed.proj.weight, conv.reshape(conv.shape[0], -1))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_standalone_hf_tower() -> None:
    """The bare ``Qwen2VisionTransformerPretrainedModel`` (its own names, given a prefix)."""
    cfg = tiny_config().vision_config
    torch.manual_seed(0)
    hf: Any = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
        cfg).eval()
    redraw(hf, seed=5)
    tower = Qwen2VisionTower(cfg).eval()
    assert tower.load_weights((f"model.visual.{k}", v) for k, v in hf.state_dict().items()) \
        == all_params(tower)
    pixels, grid = pixels_for([(1, 6, 4)], seed=6)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid).pooler_output
        got = tower(pixels, grid)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_single_image(tower: Qwen2VisionTower, ref: Ref) -> None:
    check(tower, ref, [(1, 4, 8)], seed=2)


def test_two_images(tower: Qwen2VisionTower, ref: Ref) -> None:
    check(tower, ref, [(1, 4, 4), (1, 8, 12)], seed=3)


def test_frames(tower: Qwen2VisionTower, ref: Ref) -> None:
    """A 2-frame entry between images: every frame is one attention segment (no windows, no
    reordering); attending across frames gives something else."""
    grids = [(1, 6, 10), (2, 4, 6), (1, 2, 2)]
    plan = tower.plan(torch.tensor(grids))
    n = plan.num_patches
    assert torch.equal(plan.patch_order, torch.arange(n))
    assert torch.equal(plan.token_restore, torch.arange(n // MERGE**2))
    assert sorted(int(g.shape[1]) for g in plan.full_groups) == [4, 24, 60]
    assert sorted(int(g.numel()) for g in plan.full_groups) == [4, 48, 60]
    got = check(tower, ref, grids, seed=4)
    pixels = pixels_for(grids, seed=4)[0]
    plan.full_groups = _group_segments([60, 48, 4], torch.device("cpu"))  # frames joined
    with torch.no_grad():
        other = tower(pixels, grids, plan=plan)
    assert (other[15:27] - got[15:27]).abs().max().item() > 1e-2
    torch.testing.assert_close(other[:15], got[:15])


def test_bad_names_and_shapes(ref: Ref) -> None:
    tower = Qwen2VisionTower(ref.config.vision_config)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight"):
        tower.load_weights([("visual.blocks.1.attn.qkv.weight", torch.randn(WIDTH, 3 * WIDTH))])
    with pytest.raises(ValueError, match=r"patch_embed\.proj\.weight"):
        tower.load_weights([("model.visual.patch_embed.proj.weight",
                             torch.randn(WIDTH, 3, 2, PATCH, PATCH - 1))])
    with pytest.raises(ValueError, match=r"merger\.mlp\.2\.bias"):
        tower.load_weights([("visual.merger.mlp.2.bias", torch.randn(OUT - 1))])
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.fc1\.weight"):  # mlp_ratio 2, not 4
        tower.load_weights([("visual.blocks.0.mlp.fc1.weight", torch.randn(4 * WIDTH, WIDTH))])
    # Qwen2.5-VL's gated MLP names and a block past the depth are not the tower's.
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.gate_proj\.weight"):
        tower.load_weights([("visual.blocks.0.mlp.gate_proj.weight",
                             torch.randn(2 * WIDTH, WIDTH))])
    with pytest.raises(ValueError, match=r"blocks\.2\.norm1\.weight"):
        tower.load_weights([("model.visual.blocks.2.norm1.weight", torch.randn(WIDTH))])
