"""Upstage's Solar Open (``SolarOpenForCausalLM``) against HF transformers on tiny random
checkpoints saved by transformers itself: every logit of a prefill and a decode step through the
paged KV cache, then greedy tokens through the engine with prompts split over steps of 8 tokens
(chunked prefill). GLM-4.5's MoE on every layer (sigmoid router steered by its correction bias,
group-limited, shared experts) under Llama's attention (q/k/v biases in one case); a partial
RoPE, which transformers cannot run either, refused; per-expert checkpoint tensors as
transformers saves them, or stacked as it holds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mrv2 import SamplingParams
from mrv2.layers import GroupedTopKRouter, head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_engine import tokens_at_tp
from mrv2_glm.solar_open import SolarOpenForCausalLM

MOE: dict[str, Any] = {"n_routed_experts": 8, "moe_intermediate_size": 32,
                       "num_experts_per_tok": 3, "num_hidden_layers": 3, "head_dim": 16}
CASES: dict[str, dict[str, Any]] = {
    # 4 groups of 2 experts with 2 kept, renormalized and scaled, q/k/v biases; per-expert
    # checkpoint tensors
    "groups-biased": {**MOE, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                      "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                      "attention_bias": True},
    # one group, raw weights, a shared expert twice as wide; stacked experts
    "stacked": {**MOE, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                "routed_scaling_factor": 1.5, "n_shared_experts": 2},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def _checkpoint(path: Path, case: str) -> Path:
    path = make_tiny_checkpoint(path, "SolarOpenForCausalLM", std=0.15, **CASES[case])
    if case == "stacked":  # rewrite with transformers' in-memory (stacked) names
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    config = transformers.AutoConfig.from_pretrained(path)
    partial = transformers.AutoConfig.from_pretrained(path)
    partial.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"config.partial_rotary_factor = 0.5"):
        SolarOpenForCausalLM(partial)
    model = SolarOpenForCausalLM(config)
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    model.eval()
    for layer in model.model.layers:  # every layer routed, its bias loaded
        assert isinstance(layer.mlp.gate, GroupedTopKRouter)
        bias = layer.mlp.gate.e_score_correction_bias
        assert bias is not None and bool(bias.abs().sum() > 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, [9, 3, 13], vocab=config.vocab_size, max_len=16)

    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp_sizes = (1, 2) if case == "stacked" else (1,)
    for tp, got in tokens_at_tp(path, PROMPTS, params, tp_sizes=tp_sizes,
                                max_num_batched_tokens=8).items():
        assert got == want, tp
