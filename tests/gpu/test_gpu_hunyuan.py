"""GPU: Hunyuan (``HunYuanDenseV1ForCausalLM``, ``HunYuanMoEV1ForCausalLM``) through the engine
on the Triton kernels at the published head size (128): NTK-alpha RoPE, the per-head q/k norms
after the rotation (the rotary kernel, then the norm kernel, then attention: not the fused
RoPE-in-attention path), the softmax top-k router in fp32 on the fused MoE kernels with a
shared MLP beside them. fp32 greedy tokens are HF's with CUDA graphs (decode and mixed steps)
and without, prompts split across steps and requests preempted; bf16 graphs on and off agree
and start with HF's tokens; a step never synchronizes.

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
NEW_TOKENS = 32
#: Hunyuan-A13B's RoPE (alpha 1000, factor 1) and head size, GQA; 16 experts, top-4 (the
#: published top-8 of 64 at a tiny size), a shared MLP; std 0.15 so attention, positions and
#: the routing shape the tokens.
ALPHA: dict[str, Any] = {"rope_type": "dynamic", "factor": 1.0, "alpha": 1000.0,
                         "rope_theta": 10000.0}
COMMON: dict[str, Any] = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "num_hidden_layers": 3,
                          "max_position_embeddings": 256, "rope_parameters": ALPHA}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("HunYuanDenseV1ForCausalLM", {**COMMON, "intermediate_size": 512}),
    "moe": ("HunYuanMoEV1ForCausalLM", {**COMMON, "intermediate_size": 96, "num_experts": 16,
                                        "moe_topk": 4, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    architecture, overrides = CASES[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hunyuan"), architecture, std=0.15,
                                **overrides)


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_hunyuan_with_graphs(ckpt: Path) -> None:
    expected = [hf_greedy(ckpt, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(ckpt, "float32") == expected
    assert _generate(ckpt, "float32", enforce_eager=True) == expected
    assert _generate(ckpt, "float32", max_num_batched_tokens=32) == expected
    assert _generate(ckpt, "float32", num_gpu_blocks_override=12) == expected
    graphs = _generate(ckpt, "bfloat16")
    eager = _generate(ckpt, "bfloat16", enforce_eager=True)
    # bf16: graphs and eager round differently (the decode graph's fused norm + GEMV) and a
    # near tie of two experts' probabilities may pick another; fp32 above is exact.
    check_bf16_graphs_against_eager(graphs, eager, expected)


def test_hunyuan_steps_never_synchronize(ckpt: Path) -> None:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()
