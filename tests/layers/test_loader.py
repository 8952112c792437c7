"""Checkpoint loading: safetensors discovery, weight loaders, strictness, dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mrv2.layers import (
    LayerNorm,
    LMHead,
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RowLinear,
    VocabEmbedding,
)
from mrv2.model_loader import (
    default_weight_loader,
    init_dummy_weights,
    iter_safetensors,
    load_model_weights,
    load_stacked_weights,
)

STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class ToyLayer(nn.Module):
    """The fused projections of a decoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
        self.gate_up_proj = MergedColumnLinear(8, [6, 6])
        self.down_proj = RowLinear(6, 8, bias=True)


class ToyBlock(nn.Module):
    """A toy model whose checkpoint uses HF's separate q/k/v and gate/up names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabEmbedding(16, 8)
        self.layer = ToyLayer()
        self.norm = RMSNorm(8)
        self.lm_head = LMHead(16, 8)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, weights, STACKED)


def hf_block_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (16, 8),
        "layer.q_proj.weight": (8, 8),
        "layer.q_proj.bias": (8,),
        "layer.k_proj.weight": (4, 8),
        "layer.k_proj.bias": (4,),
        "layer.v_proj.weight": (4, 8),
        "layer.v_proj.bias": (4,),
        "layer.gate_proj.weight": (6, 8),
        "layer.up_proj.weight": (6, 8),
        "layer.down_proj.weight": (8, 6),
        "layer.down_proj.bias": (8,),
        "norm.weight": (8,),
        "lm_head.weight": (16, 8),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def load_toy(weights: dict[str, torch.Tensor], strict: bool = True) -> ToyBlock:
    block = ToyBlock()
    load_model_weights(block, weights.items(), strict=strict)
    return block


def test_fused_layers_equal_separate_projections() -> None:
    w = hf_block_weights()
    block = load_toy(w)
    x = torch.randn(5, 8)
    q, k, v = block.layer.qkv_proj.split(block.layer.qkv_proj(x))
    torch.testing.assert_close(q, x @ w["layer.q_proj.weight"].T + w["layer.q_proj.bias"])
    torch.testing.assert_close(k, x @ w["layer.k_proj.weight"].T + w["layer.k_proj.bias"])
    torch.testing.assert_close(v, x @ w["layer.v_proj.weight"].T + w["layer.v_proj.bias"])
    gate_up = block.layer.gate_up_proj(x)
    torch.testing.assert_close(gate_up[:, :6], x @ w["layer.gate_proj.weight"].T)
    torch.testing.assert_close(gate_up[:, 6:], x @ w["layer.up_proj.weight"].T)


def test_rmsnorm_fused_residual() -> None:
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    summed = x + residual
    expected = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(norm(summed), expected)


def test_single_file(tmp_path: Path) -> None:
    w = hf_block_weights()
    save_file(w, tmp_path / "model.safetensors")
    loaded = dict(iter_safetensors(tmp_path))
    assert loaded.keys() == w.keys()
    assert all(torch.equal(loaded[n], w[n]) for n in w)


def test_index_is_honoured(tmp_path: Path) -> None:
    w = hf_block_weights()
    names = sorted(w)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    for file, shard_names in shards.items():
        save_file({n: w[n] for n in shard_names}, tmp_path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"stray.weight": torch.ones(2)}, tmp_path / "consolidated.safetensors")
    assert sorted(name for name, _ in iter_safetensors(tmp_path)) == names

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        iter_safetensors(tmp_path)
    for bad in ("{", '{"metadata": {}}', '{"weight_map": ["a.safetensors"]}'):
        (tmp_path / "model.safetensors.index.json").write_text(bad)  # (was a KeyError...)
        with pytest.raises(ValueError, match=r"index\.json is not a safetensors index"):
            iter_safetensors(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path.name}.*model\.safetensors"):
        iter_safetensors(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_safetensors(tmp_path / "absent")


def test_missing_parameters_are_listed() -> None:
    w = hf_block_weights()
    del w["layer.down_proj.bias"], w["norm.weight"]
    with pytest.raises(ValueError, match=r"2 parameter.*layer\.down_proj\.bias, norm\.weight"):
        load_toy(w)
    block = load_toy(w, strict=False)
    assert torch.equal(block.lm_head.weight, w["lm_head.weight"])


def test_wrong_shape_and_unknown_name() -> None:
    w = hf_block_weights()
    w["layer.down_proj.weight"] = torch.randn(8, 7)
    with pytest.raises(ValueError, match=r"'layer\.down_proj\.weight'.*\(8, 6\).*\(8, 7\)"):
        load_toy(w)
    w = hf_block_weights()
    w["extra.weight"] = torch.randn(2)
    with pytest.raises(ValueError, match=r"'extra\.weight' matches no parameter of ToyBlock"):
        load_toy(w)


def test_default_weight_loader_converts_dtype() -> None:
    param = nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    loaded = torch.randn(2, 3)
    default_weight_loader(param, loaded)
    assert param.dtype == torch.bfloat16
    torch.testing.assert_close(param.float(), loaded, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        default_weight_loader(param, loaded.T)


def test_dummy_weights() -> None:
    a, b, c = ToyBlock(), ToyBlock(), ToyBlock()
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    init_dummy_weights(c, seed=4)
    assert torch.equal(a.norm.weight, torch.ones(8))
    assert torch.equal(a.layer.down_proj.bias, torch.zeros(8))
    w = a.layer.qkv_proj.weight
    assert torch.isfinite(w).all() and 0 < w.std() < 0.1
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.layer.qkv_proj.weight, c.layer.qkv_proj.weight)
    ln = nn.ModuleDict({"ln": LayerNorm(8), "plain": LayerNorm(8, affine=False)})
    init_dummy_weights(ln, seed=3)  # a LayerNorm's weight is a norm's: ones; its bias zeros
    assert torch.equal(ln["ln"].weight, torch.ones(8)) and torch.equal(ln["ln"].bias,
                                                                        torch.zeros(8))


def test_a_missing_part_of_a_fused_parameter_is_an_error() -> None:
    """A checkpoint lacking ``k_proj`` (or ``up_proj``) while its fused ``qkv_proj``
    (``gate_up_proj``) gets the other parts is refused, naming the part: those rows were left
    uninitialized and the model loaded."""
    for dropped, part in (("layer.k_proj.weight", r"layer\.qkv_proj\.weight \(k_proj\)"),
                          ("layer.up_proj.weight", r"layer\.gate_up_proj\.weight \(up_proj\)")):
        w = hf_block_weights()
        del w[dropped]
        with pytest.raises(ValueError, match=f"1 part.*: {part}"):
            load_toy(w)
    w = hf_block_weights()
    del w["layer.v_proj.bias"]
    load_toy(w, strict=False)  # (not strict: a partial load, as update_weights gives)


def test_tied_lm_head_does_not_overwrite_the_embedding(tmp_path: Path) -> None:
    """A tied checkpoint that also holds an ``lm_head.weight`` of other values: the embedding
    keeps the checkpoint's embedding (as vLLM, which skips the head) whichever shard holds
    which; it was overwritten by the head when that came later. A head alone fills it."""
    from mrv2.config import EngineConfig
    from mrv2.model_loader.build import build_model, load_hf_config
    from mrv2.plugins import get_plugin_manager
    from mrv2.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    tensors = dict(iter_safetensors(path))
    embed = tensors["model.embed_tokens.weight"].clone()
    head = torch.randn_like(embed)
    (path / "model.safetensors").unlink()
    save_file({n: t.clone() for n, t in tensors.items()}, path / "a.safetensors")
    save_file({"lm_head.weight": head}, path / "b.safetensors")  # (read after the embedding)
    config = EngineConfig.from_kwargs(model=str(path), device="cpu")
    hf_config = load_hf_config(path)
    registries = get_plugin_manager().registries

    def built_embedding() -> torch.Tensor:
        model, _ = build_model(config, str(path), hf_config, registries, torch.device("cpu"),
                               torch.float32)
        return model.model.embed_tokens.weight  # type: ignore[union-attr]

    assert torch.equal(built_embedding(), embed)
    del tensors["model.embed_tokens.weight"]
    save_file({n: t.clone() for n, t in tensors.items()}, path / "a.safetensors")
    assert torch.equal(built_embedding(), head)
