"""GPU: Cohere2-MoE (``Cohere2MoeForCausalLM``) through the engine on the Triton kernels (the
fused MoE, the softmax and the one-group sigmoid router kernels), at the published head size
(128): a dense prefix layer with RoPE on a global layer (HF's ``force_rope``), sliding RoPE
layers and a global NoPE one (prompts past the window), shared experts averaged or summed,
LayerNorms or RMSNorms. fp32 greedy tokens are HF's with CUDA graphs and without, prompts
split across steps; bf16 graphs on and off agree; a step never synchronizes; a block-FP8
checkpoint (experts per expert, as published) runs with graphs on and off.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, run_steps_without_sync, save_tiny_model
from mrv2.testing_engine import check_bf16_graphs_against_eager

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [1 + (7 * i) % 120 for i in range(61)],
           [64]]
NEW_TOKENS = 24
SLIDING, FULL = "sliding_attention", "full_attention"
SHAPE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 512, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "max_position_embeddings": 256, "sliding_window": 24, "num_experts": 16,
    "num_experts_per_tok": 4, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1,
    # (untied: a block-FP8 checkpoint with a tied LM head does not load yet, any family)
    "tie_word_embeddings": False}
CASES: dict[str, dict[str, Any]] = {
    "softmax-dense-average": {
        **SHAPE, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "prefix_dense_intermediate_size": 256, "num_shared_experts": 1,
        "layer_types": [FULL, SLIDING, SLIDING, FULL]},
    "sigmoid-sum-rms": {
        **SHAPE, "expert_selection_fn": "sigmoid", "norm_topk_prob": True,
        "num_shared_experts": 2, "shared_expert_combination_strategy": "sum",
        "rms_norm_eps": 1e-5, "layer_types": [SLIDING, SLIDING, SLIDING, FULL]},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cohere2_moe")
    save_tiny_model(path, "Cohere2MoeForCausalLM",
                    transformers.Cohere2MoeConfig(**CASES[request.param]), std=0.15)
    return path


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    with LLM(str(path), device="cuda", dtype=dtype, block_size=16,
             gpu_memory_utilization=0.3, **kwargs) as llm:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fp32_greedy_matches_hf_graphs_on_and_off(ckpt: Path) -> None:
    expected = [hf_greedy(ckpt, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(ckpt, "float32") == expected
    assert _generate(ckpt, "float32", enforce_eager=True) == expected
    assert _generate(ckpt, "float32", max_num_batched_tokens=32) == expected
    graphs = _generate(ckpt, "bfloat16")
    eager = _generate(ckpt, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


def test_steps_never_synchronize(ckpt: Path) -> None:
    """No step (the routers included) reads the device from the host."""
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    assert set(runner.kv_table_windows) == {None, 24}
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()


def test_fp8_checkpoint_graphs_on_and_off(ckpt: Path, tmp_path: Path) -> None:
    """Block-FP8 projections and experts (128 x 128 blocks: one head's rows a block, so the
    q/k rows reorder within their blocks): graphs on and off agree on the first tokens."""
    from mrv2.testing_checkpoints import fp8_checkpoint

    fp8_checkpoint(ckpt, tmp_path / "fp8", tmp_path / "ref")
    graphs = _generate(tmp_path / "fp8", "bfloat16")
    eager = _generate(tmp_path / "fp8", "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
