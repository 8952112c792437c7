"""ExaoneMoeForCausalLM (K-EXAONE) against HF transformers on tiny random checkpoints saved by
transformers itself: every logit of a prefill and a decode step through the paged KV cache,
then greedy tokens through the engine with prompts split over steps of 8 tokens (chunked
prefill). Pre-norm blocks with per-head q/k norms; a dense first layer, then DeepSeek-V3's
routed experts (sigmoid scores steered by a correction bias, group-limited) beside a shared
expert; sliding-window RoPE layers and global NoPE layers.
Checkpoints as transformers saves them (per-expert tensors, the router bias as
``mlp.e_score_correction_bias``) and as it holds them (stacked experts, the bias under
``mlp.gate``)."""

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
from mrv2_exaone.exaone_moe import ExaoneMoeForCausalLM

MOE: dict[str, Any] = {"num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 3,
                       "num_hidden_layers": 4, "head_dim": 16, "routed_scaling_factor": 2.5,
                       "first_k_dense_replace": 1}
CASES: dict[str, dict[str, Any]] = {
    # 3 local layers (window 4, RoPE) then a global NoPE one; 4 groups of 2 experts, 2 kept;
    # per-expert checkpoint tensors, as transformers saves them
    "windowed-groups": {**MOE, "sliding_window": 4, "sliding_window_pattern": 4,
                        "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                        "num_shared_experts": 1},
    # local and global layers alternating (window 6), one group, raw weights, a shared expert
    # twice as wide; stacked experts (transformers' in-memory names)
    "alternating-stacked": {**MOE, "sliding_window": 6,
                            "layer_types": ["sliding_attention", "full_attention"] * 2,
                       "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                       "num_shared_experts": 2},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def _checkpoint(path: Path, case: str) -> Path:
    path = make_tiny_checkpoint(path, "ExaoneMoeForCausalLM", std=0.15, **CASES[case])
    if case.endswith("stacked"):  # rewrite with transformers' in-memory (stacked) names
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in state
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    config = transformers.AutoConfig.from_pretrained(path)
    model = ExaoneMoeForCausalLM(config)
    loaded = load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    model.eval()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in loaded
    layers = model.model.layers
    windows = [4, 4, 4, None] if case == "windowed-groups" else [6, None, 6, None]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    assert [layer.self_attn.rotary_emb is None for layer in layers] == \
        [w is None for w in windows]
    assert not hasattr(layers[0].mlp, "gate")
    for layer in layers[1:]:
        assert isinstance(layer.mlp.gate, GroupedTopKRouter)
        assert layer.mlp.gate.e_score_correction_bias is not None
        assert bool(layer.mlp.gate.e_score_correction_bias.abs().sum() > 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, [9, 3, 13], vocab=config.vocab_size, max_len=16)

    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp_sizes = (1, 2) if case == "windowed-groups" else (1,)
    for tp, got in tokens_at_tp(path, PROMPTS, params, tp_sizes=tp_sizes,
                                max_num_batched_tokens=8).items():
        assert got == want, tp
