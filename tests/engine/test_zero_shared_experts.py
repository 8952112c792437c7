"""MoE configs that size their shared experts 0 (DeepSeek's and GLM's ``n_shared_experts: 0``,
Qwen2-MoE's ``shared_expert_intermediate_size: 0``): transformers 5.17 builds a zero-width
shared MLP (and Qwen2-MoE its gate) that adds nothing, and saves its empty tensors; mrv2
builds no shared expert, loads such a checkpoint and gives HF's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2.testing import TINY_FAMILIES, TINY_MLA, make_tiny_checkpoint, prefill_logits

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250]]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v2": ("DeepseekV2ForCausalLM", {**TINY_MLA, "q_lora_rank": None,
                                              "topk_method": "greedy", "n_shared_experts": 0}),
    "deepseek-v3": ("DeepseekV3ForCausalLM", {**TINY_MLA, "q_lora_rank": None, "n_group": 1,
                                              "topk_group": 1, "n_shared_experts": 0}),
    "glm4-moe": ("Glm4MoeForCausalLM", {**TINY_FAMILIES["glm4-moe"][1],
                                        "n_shared_experts": 0}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_size_shared_experts_load_and_match_hf(tmp_path: Path, case: str) -> None:
    import transformers

    from mrv2.config import EngineConfig
    from mrv2.layers.moe import MoEBlock
    from mrv2.runner.runner import Runner

    architecture, overrides = CASES[case]
    path = make_tiny_checkpoint(tmp_path / case, architecture, std=0.15, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    empty = [n for n, p in hf.named_parameters() if "shared_expert" in n and p.numel() == 0]
    assert empty  # (HF's zero-width shared MLP, saved: what failed to load)
    config = EngineConfig.from_kwargs(model=str(path), device="cpu", dtype="float32",
                                      block_size=4)
    runner = Runner.from_config(config)
    blocks = [m for m in runner.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.shared_experts is None and b.shared_expert_gate is None
                          for b in blocks)
    got = prefill_logits(runner, PROMPTS)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=1e-4)


def test_an_unmatched_tensor_with_values_is_still_refused(tmp_path: Path) -> None:
    """Only empty tensors are passed over: a shared expert's tensor holding values, in a
    model without shared experts, is a mismatch and is named."""
    from mrv2 import LLM

    architecture, overrides = CASES["deepseek-v3"]
    path = make_tiny_checkpoint(tmp_path / "m", architecture, **overrides)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64)
    name = "model.layers.1.mlp.shared_experts.gate_proj.weight"
    with pytest.raises(ValueError, match=rf"{name}.*matches no parameter"):
        llm.update_weights([(name, torch.zeros(32, 64))])
    llm.update_weights([(name, torch.zeros(0, 64))])  # (nothing: no values)
