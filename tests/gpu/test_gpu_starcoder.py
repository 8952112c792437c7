"""GPU: BigCode's models through the engine on the Triton kernels, at the published head size
(128): StarCoder2 (``Starcoder2ForCausalLM``: biased LayerNorms on the unfused path, the
non-gated MLP, GQA with RoPE rotated inside the attention kernel, a sliding window of 24 on
every layer: prompts and outputs past it, the layers on a block table of their own) and
StarCoder (``GPTBigCodeForCausalLM``: one key/value head for eight query heads, learned
absolute position embeddings looked up at the step's positions, no rotation). fp32 greedy
tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split across
steps, in small KV pools (StarCoder's requests preempted; StarCoder2's pool the least its
longest request is admitted with, the blocks that fall out of the window going back to it);
bf16 graphs on and off agree and start with HF's tokens; a step never synchronizes.

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
#: head_dim = hidden_size / heads = 128 (``max_position_embeddings``, GPTBigCode's
#: ``n_positions``: 256, past the longest request's 137 tokens).
SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4,
                         "num_attention_heads": 4}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "starcoder2": ("Starcoder2ForCausalLM", {**SHAPE, "num_key_value_heads": 2,
                                             "sliding_window": 24}),
    # eight query heads on the one key/value head
    "starcoder": ("GPTBigCodeForCausalLM", {**SHAPE, "hidden_size": 1024, "n_inner": 1024,
                                            "num_attention_heads": 8, "multi_query": True,
                                            "num_key_value_heads": 1}),
}
#: Small KV pools: StarCoder's preempts requests (2 on the CPU); StarCoder2's is the least
#: its longest request (137 tokens) is admitted with.
SMALL_POOL = {"starcoder2": 9, "starcoder": 12}


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
def test_starcoder_with_graphs(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    assert _generate(path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(path, "float32", num_gpu_blocks_override=SMALL_POOL[case]) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_starcoder_steps_never_synchronize(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    config = EngineConfig.from_kwargs(model=str(path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    assert runner.kv_table_windows == ((24,) if case == "starcoder2" else (None,))
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
