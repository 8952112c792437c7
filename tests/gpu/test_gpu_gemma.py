"""GPU: Gemma 3 (sliding-window local layers, a scaled-RoPE global layer) through the engine
with CUDA graphs: fp32 greedy tokens are HF's, graphs on and off; bf16 graphs on and off agree
and start with HF's tokens. Prompts and outputs run past the window (decode attention then
reads the window only).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

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


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
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
