"""GPU: Gemma 3 (sliding-window local layers, a scaled-RoPE global layer) through the engine
with CUDA graphs: fp32 greedy tokens are HF's, graphs on and off; bf16 graphs on and off agree
and start with HF's tokens. Prompts and outputs run past the window (decode attention then
reads the window only).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, run_steps_without_sync

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 250], [1 + i % 200 for i in range(97)], [64]]
ARCH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "sliding_window": 24,
        "query_pre_attn_scalar": 48,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1e6}}}


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3_with_graphs(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Gemma3ForCausalLM", **ARCH)
    expected = [hf_greedy(path, p, 40) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


def test_gemma3_sliding_blocks_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sliding layers' block tables (:mod:`mrv2.runner.kv_tables`: the full layer's table
    and three of one sliding layer each) in a cache of 40 blocks: blocks that fell out of the
    window go back to the pool and are written again by other requests while the first ones
    still run, through the Triton kernels and the CUDA graphs, with the prefix cache on. fp32
    greedy tokens are HF's, and the same with one table (``MRV2_SLIDING_KV_TABLES=0``)."""
    path = make_tiny_checkpoint(tmp_path / "m", "Gemma3ForCausalLM", **ARCH)
    prompts = [[(13 * i + 7 * j) % 250 + 2 for j in range(60 + 9 * i)] for i in range(6)]
    expected = [hf_greedy(path, p, 40) for p in prompts]
    assert _generate(path, "float32", prompts, num_gpu_blocks_override=40,
                     max_num_batched_tokens=64) == expected
    monkeypatch.setenv("MRV2_SLIDING_KV_TABLES", "0")
    assert _generate(path, "float32", prompts, num_gpu_blocks_override=80,
                     max_num_batched_tokens=64) == expected


def test_gemma3_steps_with_sliding_tables_never_synchronize(tmp_path: Path) -> None:
    """The other block tables' prep launches and metadata add no host sync to a step."""
    path = make_tiny_checkpoint(tmp_path / "m", "Gemma3ForCausalLM", **ARCH)
    config = EngineConfig.from_kwargs(model=str(path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.kv_table_windows == (None, 24, 24, 24)
    assert runner.graphs is not None and runner.graphs.graphs
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert set(tokens[-1]) == {"0", "1", "2", "3"}
    runner.shutdown()
