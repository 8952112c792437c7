"""GPU: Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer, muP multipliers
folded into the weights; the mixer's gated norm before the gate, after it, or none) through
the engine on the Triton state kernels (the causal conv and the delta-free gated delta rule)
and the fused norm + GEMV of decode steps (one per projection after the shared input norm):
fp32 greedy tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts
split across steps and requests preempted; bf16 graphs on and off agree and start with HF's
tokens; a step never synchronizes.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, run_steps_without_sync

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [1 + (7 * i) % 120 for i in range(97)],
           [64]]
#: Real head sizes (64-dim mixer heads, a 128-wide SSM state, 8 heads in 2 groups; 64-dim
#: attention heads) and HF's chunked scan in several chunks per long prompt.
ARCH: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                        "mamba_d_ssm": 512, "mamba_n_heads": 8, "mamba_n_groups": 2,
                        "mamba_d_state": 128, "mamba_chunk_size": 32}


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("overrides", [
    {},
    {"mamba_rms_norm": False, "mamba_n_groups": 1},
    {"mamba_norm_before_gate": False, "attention_bias": True, "mamba_proj_bias": True,
     "projectors_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
], ids=["norm-gate", "no-norm", "gate-norm-biased-tied"])
def test_falcon_h1_with_graphs(tmp_path: Path, overrides: dict[str, Any]) -> None:
    from mrv2_falcon_h1.testing import save_tiny_falcon_h1

    save_tiny_falcon_h1(tmp_path, **{**ARCH, **overrides})
    expected = [hf_greedy(tmp_path, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=12) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


def test_falcon_h1_steps_never_synchronize(tmp_path: Path) -> None:
    from mrv2_falcon_h1.testing import save_tiny_falcon_h1

    save_tiny_falcon_h1(tmp_path, **ARCH)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
