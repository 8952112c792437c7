"""GPU: Cohere's Command models through the engine on the Triton kernels, at the published
head size (128): Command R+ (``CohereForCausalLM``: parallel blocks off one bias-free
LayerNorm, the interleaved RoPE's q/k rows reordered as they load and rotated inside the
attention kernel, per-head q/k LayerNorms, biased projections, the logit scale) and Command
R7B (``Cohere2ForCausalLM``: three sliding-window RoPE layers in four, a global NoPE layer;
prompts and outputs past the window, the sliding layers on block tables of their own). fp32
greedy tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split
across steps, in small KV pools (Command R+'s requests preempted); bf16 graphs on and off
agree and start with HF's tokens; a step never synchronizes.

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
#: head_dim = hidden_size / heads = 128; GQA.
SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "command-r-plus": ("CohereForCausalLM", {**SHAPE, "use_qk_norm": True,
                                             "attention_bias": True}),
    "command-r7b": ("Cohere2ForCausalLM", {**SHAPE, "sliding_window": 24, "layer_types": [
        "sliding_attention"] * 3 + ["full_attention"]}),
}
#: Small KV pools: Command R+'s preempts requests (2 on the CPU); Command R7B's is the least
#: its longest request (137 tokens, a table per sliding layer besides the full layers' one)
#: is admitted with, the blocks that fall out of the window going back to the pool.
PREEMPTING_BLOCKS = {"command-r-plus": 12, "command-r7b": 36}


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
def test_cohere_with_graphs(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    assert _generate(path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(path, "float32", num_gpu_blocks_override=PREEMPTING_BLOCKS[case]) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_cohere_steps_never_synchronize(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    config = EngineConfig.from_kwargs(model=str(path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    if case == "command-r7b":
        assert set(runner.kv_table_windows) == {None, 24}
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
