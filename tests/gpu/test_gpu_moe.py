"""GPU: the MoE families through the engine on the Triton fused MoE, CUDA graphs on and off.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, run_steps_without_sync

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]
COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "num_experts_per_tok": 4,
          "moe_intermediate_size": 96, "num_hidden_layers": 3}
FAMILIES: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": {**COMMON, "num_experts": 16, "norm_topk_prob": True},
    "Glm4MoeForCausalLM": {**COMMON, "n_routed_experts": 16, "n_shared_experts": 1,
                           "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                           "partial_rotary_factor": 0.5, "attention_bias": True,
                           "routed_scaling_factor": 2.0},
    # DeepSeek-V3's MoE under GQA with per-head q/k norms: the fused rotary + norm kernel,
    # the grouped router kernel, a shared expert, a dense layer
    "Dots1ForCausalLM": {**COMMON, "n_routed_experts": 16, "n_shared_experts": 1,
                         "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                         "norm_topk_prob": True, "routed_scaling_factor": 2.5, "std": 0.15},
    # K-EXAONE: pre-norm blocks, per-head q/k norms, sliding RoPE layers (window shorter
    # than the long prompt) and a global NoPE one, V3's grouped router and a shared expert
    "ExaoneMoeForCausalLM": {**COMMON, "num_experts": 16, "num_shared_experts": 1,
                             "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                             "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                             "sliding_window": 8, "std": 0.15,
                             "layer_types": ["sliding_attention", "sliding_attention",
                                             "full_attention"]},
    # AFMoE: sandwich norms around gated attention (sliding RoPE layers, a global NoPE one)
    # and V3's one-group sigmoid router with its expert bias, shared experts, muP embeddings
    "AfmoeForCausalLM": {**COMMON, "num_experts": 16, "num_shared_experts": 1,
                         "num_dense_layers": 1, "route_scale": 2.5, "mup_enabled": True,
                         "sliding_window": 8, "global_attn_every_n_layers": 3, "std": 0.15},
    # Solar Open: GLM-4.5's MoE on every layer under Llama's attention (q/k/v biases)
    "SolarOpenForCausalLM": {**COMMON, "n_routed_experts": 16, "n_shared_experts": 1,
                             "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                             "routed_scaling_factor": 2.5, "attention_bias": True,
                             "std": 0.15},
    # SparseMixer's top-2 (torch ops in the graphs), biased LayerNorms (the unfused norm path
    # in decode graphs), biased attention and LM head, LongRoPE with its mscales
    "PhimoeForCausalLM": {**COMMON, "num_local_experts": 16, "num_experts_per_tok": 2,
                          "intermediate_size": 96, "attention_bias": True,
                          "lm_head_bias": True, "std": 0.15,
                          "rope_parameters": {
                              "rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": [1.0 + 0.05 * i for i in range(32)],
                              "long_factor": [1.5 + 0.1 * i for i in range(32)],
                              "short_mscale": 1.25, "long_mscale": 1.2,
                              "original_max_position_embeddings": 64}},
    # OLMo 2's post-norm layers (whole-projection q/k norms) around OLMoE's experts
    "FlexOlmoForCausalLM": {**COMMON, "num_experts": 16, "intermediate_size": 96,
                            "std": 0.15, "pad_token_id": 0},
    # Granite's MoE with sliding layers (window shorter than the long prompt), learned sinks,
    # a RoPE base per layer (one NoPE) and its multipliers
    "GraniteMoeSWAForCausalLM": {**COMMON, "num_local_experts": 16, "intermediate_size": 96,
                                 "sliding_window": 8, "std": 0.15,
                                 "layer_types": ["sliding_attention", "full_attention",
                                                 "sliding_attention"],
                                 "layer_rope_theta": [1e4, 0, 5e5],
                                 "attention_multiplier": 0.1, "embedding_multiplier": 0.5,
                                 "residual_multiplier": 1.2, "logits_scaling": 1.7},
    # LongCat-Flash: two MLA sublayers a layer (KV cache layers 2i, 2i+1) on the latent-cache
    # kernels, a shortcut MoE whose softmax router also picks zero-computation experts
    "LongcatFlashForCausalLM": {**COMMON, "num_layers": 2, "num_hidden_layers": 4,
                                "num_key_value_heads": 4, "n_routed_experts": 16,
                                "zero_expert_num": 8, "expert_ffn_hidden_size": 96,
                                "routed_scaling_factor": 2.0, "q_lora_rank": 96,
                                "kv_lora_rank": 128, "qk_nope_head_dim": 32,
                                "qk_rope_head_dim": 64, "v_head_dim": 32, "std": 0.15},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), request.param,
                                **FAMILIES[request.param])


def _greedy(ckpt: Path, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_greedy_matches_hf_graphs_on_and_off(ckpt: Path) -> None:
    expected = [hf_greedy(ckpt, p, 24) for p in PROMPTS]
    assert _greedy(ckpt, dtype="float32") == expected
    assert _greedy(ckpt, dtype="float32", enforce_eager=True) == expected


def test_steps_never_synchronize(ckpt: Path) -> None:
    """No step of the family (its router included) reads the device from the host."""
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()


def test_bf16_graphs_on_off_agree(ckpt: Path) -> None:
    default = _greedy(ckpt, dtype="bfloat16")
    eager = _greedy(ckpt, dtype="bfloat16", enforce_eager=True)
    for a, b in zip(default, eager, strict=True):  # near-ties may flip late in bf16
        assert a[:8] == b[:8]
