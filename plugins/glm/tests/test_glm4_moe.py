"""Glm4MoeForCausalLM against HF transformers: logits at every position (prefill with padding,
then decode, through the paged cache), greedy tokens through ``LLM`` (plain, and with prefix
caching and a cache small enough to preempt), the layer layout and config validation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from glm_common import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    VOCAB,
    glm_config,
    new_caches,
    run_step,
    save_hf_glm,
)
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.layers import FusedMoE, GatedMLP, GroupedTopKRouter, MoEBlock
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2_glm.model import Glm4MoeForCausalLM


def check_against_hf(hf: torch.nn.Module, path: Path) -> Glm4MoeForCausalLM:
    """Prefill three prompts (two padding tokens) then decode one token each; every logit row
    must match HF's full forward. Returns the loaded model."""
    config = transformers.AutoConfig.from_pretrained(path)
    model = Glm4MoeForCausalLM(config)
    load_model_weights(model, iter_safetensors(path))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 3, 10)]
    max_blocks = math.ceil(12 / BLOCK_SIZE)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[i * max_blocks:(i + 1) * max_blocks] for i in range(len(prompts))]
    caches = new_caches(config, config.num_hidden_layers)

    prefill, _ = run_step(model, caches, tables, [0] * len(prompts), prompts, num_pad=2)
    with torch.no_grad():
        for prompt, logits in zip(prompts, prefill, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    next_tokens = torch.randint(0, VOCAB, (len(prompts),), generator=gen).tolist()
    decode, _ = run_step(model, caches, tables, [len(p) for p in prompts],
                         [[t] for t in next_tokens])
    with torch.no_grad():
        for prompt, token, logits in zip(prompts, next_tokens, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0, -1:]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    return model


@pytest.mark.parametrize(
    "overrides",
    [{"use_qk_norm": True},
     {"use_qk_norm": False, "norm_topk_prob": False, "n_shared_experts": 1,
      "first_k_dense_replace": 2}],
    ids=["qk-norm", "no-qk-norm-raw-weights"],
)
def test_logits_match_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = save_hf_glm(tmp_path, **overrides)
    model = check_against_hf(hf, tmp_path)
    attn = model.model.layers[0].self_attn
    assert (attn.q_norm is not None) == overrides["use_qk_norm"]
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert attn.rotary_emb.rotary_dim == 12 and attn.rotary_emb.head_dim == 24


def test_layer_layout() -> None:
    model = Glm4MoeForCausalLM(glm_config(num_hidden_layers=4, first_k_dense_replace=2))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "GatedMLP", "MoEBlock", "MoEBlock"]
    dense, block = model.model.layers[0].mlp, model.model.layers[2].mlp
    assert isinstance(dense, GatedMLP) and dense.down_proj.input_size == 96
    assert isinstance(block, MoEBlock) and isinstance(block.experts, FusedMoE)
    assert block.experts.w13_weight.shape == (8, 64, 64)
    assert block.experts.w2_weight.shape == (8, 64, 32)
    assert isinstance(block.shared_experts, GatedMLP)
    assert block.shared_experts.down_proj.input_size == 64  # 32 x 2 shared experts
    router = block.gate
    assert isinstance(router, GroupedTopKRouter)
    assert (router.n_group, router.topk_group, router.top_k) == (4, 2, 3)
    assert router.routed_scaling_factor == 2.5 and router.renormalize
    assert router.e_score_correction_bias is not None
    no_shared = Glm4MoeForCausalLM(glm_config(n_shared_experts=0)).model.layers[1].mlp
    assert isinstance(no_shared, MoEBlock) and no_shared.shared_experts is None


@pytest.mark.parametrize(
    "overrides,field",
    [({"hidden_act": "gelu"}, "hidden_act"),
     ({"n_routed_experts": 6, "n_group": 4}, "n_group"),
     ({"topk_group": 5}, "topk_group"),
     ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
     ({"partial_rotary_factor": 0.25, "head_dim": 20}, "partial_rotary_factor")],
)
def test_config_errors_name_the_field(overrides: dict[str, Any], field: str) -> None:
    config = glm_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    if "partial_rotary_factor" in overrides:
        config.rope_parameters = {**dict(config.rope_parameters or {}),
                                  "partial_rotary_factor": 0.25}
    with pytest.raises(ValueError, match=rf"config\.{field} = "):
        Glm4MoeForCausalLM(config)


def test_checkpoint_tensor_names_the_parameter(tmp_path: Path) -> None:
    save_hf_glm(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.9.up_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    model = Glm4MoeForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match=r"experts\.9\.up_proj.*expert index must be in \[0, 8\)"):
        load_model_weights(model, iter_safetensors(tmp_path))


TINY_GLM = {
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
    "topk_group": 1, "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True,
    "routed_scaling_factor": 2.0, "num_nextn_predict_layers": 0,
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + i % 120 for i in range(29)]]


def tiny_checkpoint(path: Path) -> Path:
    """``make_tiny_checkpoint``'s GLM, with nonzero router correction biases written in."""
    make_tiny_checkpoint(path, "Glm4MoeForCausalLM", **TINY_GLM)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = (torch.rand(tensors[name].shape, generator=gen) - 0.5) * 0.02
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("kwargs", [{}, {"enable_prefix_caching": True,
                                         "num_gpu_blocks_override": 12}],
                         ids=["plain", "prefix-cache-preempt"])
def test_greedy_matches_hf(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    path = tiny_checkpoint(tmp_path)
    expected = [hf_greedy(path, p, 10) for p in PROMPTS]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
        again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)
        assert again[0].outputs[0].token_ids == expected[2]
        assert llm.engine.stats()["prefix_cache_hits"] > 0
