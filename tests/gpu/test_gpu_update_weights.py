"""GPU: ``LLM.update_weights`` with CUDA graphs (bf16): an engine built on checkpoint A and
given B's tensors generates what a fresh engine on B does (the graphs replay the new values;
the device's processing of the weights, MoE's and MLA's included, runs again).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.model_loader.loader import iter_safetensors
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", SHAPE),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 128}),
    # MLA derives per-head up-projections at load: updated in place, where the graphs read
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {
        "vocab_size": 320, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "q_lora_rank": None, "topk_method": "greedy", "tie_word_embeddings": False}),
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 250 for i in range(70)], [64, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_updated_weights_generate_as_a_fresh_engine(
        family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    architecture, overrides = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    a = make_tiny_checkpoint(root / "a", architecture, seed=1, **overrides)
    b = make_tiny_checkpoint(root / "b", architecture, seed=2, **overrides)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    kwargs: dict[str, Any] = dict(device="cuda", dtype="bfloat16", block_size=16,
                                  gpu_memory_utilization=0.3)
    fresh = LLM(str(b), **kwargs)
    want = run(fresh)
    fresh.shutdown()
    del fresh  # (its KV cache counts as in use for the next engine's budget until freed)
    llm = LLM(str(a), **kwargs)
    assert run(llm) != want
    llm.update_weights(iter_safetensors(str(b)))
    assert run(llm) == want
