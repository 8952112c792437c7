"""Qwen3MoeForCausalLM and Qwen2MoeForCausalLM against HF transformers: logits at every
position (prefill and decode through the paged cache) and greedy tokens through ``LLM``, with
dense layers between sparse ones, renormalized or raw top-k weights, Qwen2-MoE's gated shared
expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_qwen3_forward import check_against_hf, save_hf_model

from mrv2 import LLM, SamplingParams
from mrv2.layers import FusedMoE, GatedMLP
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2_qwen.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MOE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_experts": 8, "num_experts_per_tok": 3, "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def save_hf_moe(path: Path, **overrides: object) -> torch.nn.Module:
    """A random HF Qwen3-MoE (weights far from their init, so routing is decisive) saved."""
    config = transformers.Qwen3MoeConfig(**{**MOE, **overrides})
    config.architectures = ["Qwen3MoeForCausalLM"]
    return save_hf_model(config, path)


@pytest.mark.parametrize(
    "overrides",
    [{"mlp_only_layers": [1], "norm_topk_prob": True},
     {"decoder_sparse_step": 2, "norm_topk_prob": False, "tie_word_embeddings": True}],
    ids=["dense-layer-1-renorm", "every-2nd-raw-tied"],
)
def test_logits_match_hf(tmp_path: Path, overrides: dict[str, object]) -> None:
    hf = save_hf_moe(tmp_path, **overrides)
    check_against_hf(Qwen3MoeForCausalLM, hf, tmp_path)


def test_layers_are_sparse_where_the_config_says(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 4,
                                            "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    model = Qwen3MoeForCausalLM(config)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "MoEBlock", "GatedMLP", "GatedMLP"]
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE) and isinstance(model.model.layers[0].mlp, GatedMLP)
    assert experts.w13_weight.shape == (8, 64, 64) and experts.w2_weight.shape == (8, 64, 32)


def test_missing_expert_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from mrv2.model_loader import iter_safetensors, load_model_weights

    save_hf_moe(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    model = Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match=r"experts\.9\.up_proj.*expert index must be in \[0, 8\)"):
        load_model_weights(model, iter_safetensors(tmp_path))


PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + i % 120 for i in range(29)]]


@pytest.mark.parametrize("kwargs", [{}, {"num_gpu_blocks_override": 12}], ids=["plain", "preempt"])
def test_greedy_matches_hf(tmp_path: Path, kwargs: dict[str, object]) -> None:
    path = make_tiny_checkpoint(tmp_path, "Qwen3MoeForCausalLM", num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True)
    expected = [hf_greedy(path, p, 10) for p in PROMPTS]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if kwargs:
        assert llm.engine.scheduler.num_preemptions > 0


def test_qwen2_moe_matches_hf(tmp_path: Path) -> None:
    """Qwen2-MoE: q/k/v biases, the shared expert scaled by its sigmoid gate, a dense layer;
    logits per position, then greedy tokens through the engine."""
    config = transformers.Qwen2MoeConfig(**{**MOE, "shared_expert_intermediate_size": 48,
                                            "mlp_only_layers": [1], "norm_topk_prob": False})
    config.architectures = ["Qwen2MoeForCausalLM"]
    hf = save_hf_model(config, tmp_path)
    model = Qwen2MoeForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    assert model.model.layers[0].mlp.shared_expert_gate is not None
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    check_against_hf(Qwen2MoeForCausalLM, hf, tmp_path)
    expected = [hf_greedy(tmp_path, p, 8) for p in PROMPTS[:2]]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params,
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
