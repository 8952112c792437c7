"""The CPU weight layout: column-major fp32 weights, applied once the weights are loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from mrv2.config import EngineConfig
from mrv2.layers.linear import cpu_weight_layout
from mrv2.model_loader.build import build_model, load_hf_config
from mrv2.plugins import get_plugin_manager
from mrv2.testing import make_tiny_checkpoint


def test_layout_keeps_values_and_shape() -> None:
    weight = torch.randn(24, 16)
    out = cpu_weight_layout(weight)
    assert out.shape == weight.shape and out.stride() == (1, 24) and torch.equal(out, weight)
    wide = torch.randn(8, 16)
    assert cpu_weight_layout(wide).stride() in ((1, 8), (16, 1))  # (16, 1) without oneDNN
    for same in (weight.bfloat16(), weight.t(), torch.randn(4)):  # not fp32 / strided / 1-D
        assert cpu_weight_layout(same) is same


def test_cpu_model_gets_the_layout_and_the_same_logits(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cpu", dtype="float32")
    hf_config = load_hf_config(ckpt)
    model, _ = build_model(config, str(ckpt), hf_config, get_plugin_manager().registries,
                           torch.device("cpu"), torch.float32)
    layer = model.model.layers[0]
    for weight in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight,
                   model.lm_head.weight):
        assert weight.stride(0) == 1  # column-major
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    hidden = torch.randn(3, hf_config.hidden_size)
    want = torch.nn.functional.linear(hidden, model.lm_head.weight.contiguous())
    torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([3, 1, 4])
    assert torch.equal(model.model.embed_tokens(ids), model.lm_head.weight.contiguous()[ids])
