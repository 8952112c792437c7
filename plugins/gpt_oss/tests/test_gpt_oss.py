"""GptOssForCausalLM against HF transformers: prefill and decode logits through the paged cache
(attention sinks, a local layer whose window is shorter than the prompts, YaRN RoPE, biased
router and experts, the clamped swigluoai), greedy tokens through the engine, and an MXFP4
checkpoint as OpenAI publishes gpt-oss against HF on its dequantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.layers import head_dim_of
from mrv2.layers.int_model import apply_int_quant
from mrv2.layers.int_quant_config import int_quant_config_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import (
    TINY_FAMILIES,
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
    poisoned_caches,
)
from mrv2.testing_quant import mxfp4_checkpoint
from mrv2_gpt_oss.model import GptOssForCausalLM

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]


def _checkpoint(path: Path, **overrides: Any) -> Path:
    """std 0.15: attention (and so the sinks and the window) shapes the logits; the experts'
    gate / up weights 6 times that, so their outputs reach past the clamp of 7."""
    arch, tiny = TINY_FAMILIES["gpt-oss"]
    path = make_tiny_checkpoint(path, arch, std=0.15, **{**tiny, **overrides})
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith("experts.gate_up_proj"):
            tensors[name] = tensors[name] * 6
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _model(path: Path) -> tuple[GptOssForCausalLM, transformers.PretrainedConfig]:
    """The model as the engine builds it (MXFP4 experts where the config says so)."""
    config = transformers.AutoConfig.from_pretrained(path)
    model = GptOssForCausalLM(config)
    quant = int_quant_config_of(config, None)
    if quant is not None:
        apply_int_quant(model, quant)
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    return model, config


def _check_logits(path: Path, reference: Path) -> None:
    model, config = _model(path)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [4, None]
    hf = transformers.GptOssForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


def test_logits_match_hf(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "m")
    hf = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32)
    layer = hf.model.layers[0]
    with torch.no_grad():  # the random draw reaches the clamp: swigluoai's both branches run
        x = torch.randn(32, 64)
        gate_up = x @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7).any() and (gate_up.abs() < 7).any()
    assert layer.self_attn.sinks.abs().min() > 0
    _check_logits(path, path)


def test_mxfp4_checkpoint_matches_hf_on_its_dequantized_weights(tmp_path: Path) -> None:
    """The experts' blocks and e8m0 scales (gate / up rows interleaved) through the core's
    MXFP4 experts: the logits of HF on the dequantized float experts."""
    src = _checkpoint(tmp_path / "src")
    mxfp4_checkpoint(src, tmp_path / "q", tmp_path / "ref")
    names = {n for n, _ in iter_safetensors(tmp_path / "q")}
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    model, _ = _model(tmp_path / "q")
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_bias is not None  # dequantized on the CPU, the biases kept
    _check_logits(tmp_path / "q", tmp_path / "ref")


def test_greedy_tokens_match_hf_through_the_engine(tmp_path: Path) -> None:
    """Prompts and outputs past the window, chunked prefill, the prefix cache on; and an MXFP4
    checkpoint's tokens, HF's on the dequantized weights."""
    path = _checkpoint(tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for model, reference in ((path, path), (tmp_path / "q", tmp_path / "ref")):
        if model != path:
            mxfp4_checkpoint(path, model, reference)
        llm = LLM(str(model), device="cpu", dtype="float32", block_size=4,
                  max_num_batched_tokens=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [
            hf_greedy(reference, p, 10) for p in PROMPTS]
