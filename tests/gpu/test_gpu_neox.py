"""GPU: GPT-NeoX, StableLM, GPT-J and phi-2 through the engine on the Triton kernels, at
published head sizes (128; Pythia-2.8B's 80 and StableLM-2-12B's 160, which the paged attention
pads to 128 and 256 and masks): a Pythia-shaped ``GPTNeoXForCausalLM`` (parallel blocks,
LayerNorms with biases, the fused per-head q/k/v split as it loads, a quarter of each head
rotated by the RoPE kernel before attention, a biased gelu MLP, an untied head), a
StableLM-2-12B-shaped ``StableLmForCausalLM`` (per-head q/k LayerNorms, q/k/v biases, GQA, the
parallel block off the input norm, a SwiGLU MLP), a GPT-J-6B-shaped ``GPTJForCausalLM`` (a
quarter of each head rotated in interleaved pairs, its q/k rows reordered as they load; a
biased head) and a phi-2-shaped ``PhiForCausalLM`` (head_dim 80, 32 dims rotated, the parallel
block off one biased LayerNorm, biased projections, a gelu_new MLP, a biased untied head). fp32
greedy tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split
across steps, in a small KV pool (requests preempted); bf16 graphs on and off agree and start
with HF's tokens; a step never synchronizes.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, run_steps_without_sync
from mrv2.testing_engine import check_bf16_graphs_against_eager

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [1 + (7 * i) % 120 for i in range(97)],
           [64]]
NEW_TOKENS = 40
#: head_dim = hidden_size / heads = 128 (32 rotated dims at partial_rotary_factor 0.25).
SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "pythia": ("GPTNeoXForCausalLM", {**SHAPE, "num_key_value_heads": 4}),
    "stablelm-12b": ("StableLmForCausalLM", {**SHAPE, "qk_layernorm": True,
                                             "use_qkv_bias": True,
                                             "use_parallel_residual": True}),
    # GPT-J-6B's quarter of each head (64 of 256) rotated in interleaved pairs: 32 of 128
    "gptj": ("GPTJForCausalLM", {**SHAPE, "num_key_value_heads": 4, "rotary_dim": 32}),
    # head sizes that are not powers of two: Pythia-2.8B's 80 (20 rotated dims), StableLM-2-12B's
    # own 160 (GQA, per-head q/k LayerNorms over 160)
    "pythia-2.8b": ("GPTNeoXForCausalLM", {**SHAPE, "hidden_size": 320,
                                           "num_key_value_heads": 4}),
    "stablelm-12b-160": ("StableLmForCausalLM", {**SHAPE, "hidden_size": 640,
                                                 "qk_layernorm": True, "use_qkv_bias": True,
                                                 "use_parallel_residual": True}),
    # phi-2's head size 80 (partial_rotary_factor 0.4: 32 rotated dims)
    "phi-2": ("PhiForCausalLM", {**SHAPE, "hidden_size": 320, "num_key_value_heads": 4,
                                 "partial_rotary_factor": 0.4, "hidden_act": "gelu_new"}),
}
#: A small KV pool: the longest request (137 tokens, 9 blocks) fits, not all four at once.
PREEMPTING_BLOCKS = 12


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _save(path: Path, case: str) -> Path:
    architecture, overrides = CASES[case]
    return make_tiny_checkpoint(path, architecture, std=0.15, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_neox_with_graphs(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    assert _generate(path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(path, "float32", num_gpu_blocks_override=PREEMPTING_BLOCKS) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_neox_steps_never_synchronize(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    config = EngineConfig.from_kwargs(model=str(path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
