"""GPU: LFM2 (gated short convolutions beside attention layers with per-head q/k norms)
through the engine on the Triton causal-conv kernel (decode and prefill paths, the state rows
and prefix caching's snapshots) and the fused norm + GEMV of decode steps: fp32 greedy tokens
are HF's with CUDA graphs (decode and mixed steps) and without, prompts split across steps,
requests preempted and prefixes resumed from state snapshots; bf16 graphs on and off agree and
start with HF's tokens; a step never synchronizes. LFM2-MoE alike: dense layers, then sparse
MoE blocks (the sigmoid router with its expert bias, the fused experts' Triton kernels).

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
#: Real head sizes (64-dim attention heads, 256 convolution channels, LFM2's width-3
#: convolution) and a feed-forward width rounded up to ``block_multiple_of``.
ARCH: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 768, "block_multiple_of": 64,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3,
                        "num_hidden_layers": 6,
                        "layer_types": ["conv", "conv", "full_attention", "conv",
                                        "full_attention", "conv"]}
#: LFM2-MoE of the same shape: two dense layers (a convolution and an attention layer), then
#: MoE blocks of 16 experts of 128, 4 a token (LFM2-8B-A1B: 32 of 1792, 4 a token).
MOE_ARCH: dict[str, Any] = {**ARCH, "moe_intermediate_size": 128, "num_experts": 16,
                            "num_experts_per_tok": 4, "num_dense_layers": 2,
                            "layer_types": ["conv", "full_attention", "conv", "conv",
                                            "full_attention", "conv"]}
MOE_ARCH.pop("block_multiple_of")


def _save(tmp_path: Path, moe: bool, **overrides: Any) -> None:
    from mrv2_lfm2.testing import save_tiny_lfm2, save_tiny_lfm2_moe

    if moe:
        save_tiny_lfm2_moe(tmp_path, **{**MOE_ARCH, **overrides})
    else:
        save_tiny_lfm2(tmp_path, **{**ARCH, **overrides})


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if kwargs.get("enable_prefix_caching"):  # the same prompts again, resuming from snapshots
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert any(o.num_cached_tokens for o in outs)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("moe,overrides", [
    (False, {}),
    (False, {"conv_bias": False, "tie_word_embeddings": True, "conv_L_cache": 4}),
    (True, {}),
], ids=["biased-untied", "tied-width4", "moe"])
def test_lfm2_with_graphs(tmp_path: Path, moe: bool, overrides: dict[str, Any]) -> None:
    _save(tmp_path, moe, **overrides)
    expected = [hf_greedy(tmp_path, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=12) == expected
    assert _generate(tmp_path, "float32", enable_prefix_caching=True) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_lfm2_steps_never_synchronize(tmp_path: Path, moe: bool) -> None:
    _save(tmp_path, moe)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
