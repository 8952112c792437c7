"""GPU: Step-3.7's text decoder (``Step3p7ForConditionalGeneration``: gated grouped-query
attention, sliding layers with their own head count and full RoPE beside full layers with
partial RoPE, sigmoid-routed and clamped experts with a shared expert) through the engine on
the Triton kernels: fp32 greedy tokens are HF's with CUDA graphs and without, prompts split
across steps and requests preempted; bf16 graphs on and off agree and mostly start with HF's
tokens; a step never synchronizes.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import run_steps_without_sync

pytestmark = pytest.mark.gpu

#: Two prompts longer than the sliding window (32), one of several windows.
PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [2 + (7 * i) % 120 for i in range(97)],
           [64], [2 + (11 * i + 3) % 120 for i in range(130)]]
#: The published head size (128), half of it rotated on the full layers; few heads, a window
#: short enough for the prompts to cross it; every MoE layer's experts clamped.
ARCH = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "share_expert_dim": 128, "head_dim": 128, "num_attention_heads": 2,
        "num_sliding_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 32,
        "query_pre_attn_scalar": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "swiglu_limits": [0, 3.0, 3.0, 3.0], "swiglu_limits_shared": [0, 0, 0, 4.0]}


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    from mrv2.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")


def _save(path: Path) -> None:
    from mrv2_step.testing import save_tiny_step3p7

    save_tiny_step3p7(path, **ARCH)


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_step3p7_with_graphs(tmp_path: Path) -> None:
    """fp32: HF's greedy tokens in graphs, eager, with prompts split across steps and with
    preemption; bf16: graphs and eager agree on the first tokens, which mostly equal HF's."""
    from mrv2_step.testing import hf_greedy_step3p7

    _save(tmp_path)
    expected = hf_greedy_step3p7(tmp_path, PROMPTS, 40, device="cuda")
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=24) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


def test_step3p7_steps_never_synchronize(tmp_path: Path) -> None:
    _save(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()
