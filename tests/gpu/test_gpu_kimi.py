"""GPU: Kimi-Linear (Kimi Delta Attention layers with per-request state and a per-channel
decay, MLA without RoPE over the latent KV cache, the DeepSeek-style MoE) through the engine on
the Triton kernels: fp32 greedy tokens are HF's with CUDA graphs and without, prompts split
across steps and requests preempted, and with n-gram speculation (rejected drafts leave no
trace in the state); bf16 graphs on and off agree and mostly start with HF's tokens; a step
never synchronizes.

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
           [64], [1 + (11 * i + 3) % 120 for i in range(130)]]
#: The published head sizes (KDA's 128, MLA's 128 + 64 with a 512 latent), few heads and layers.
ARCH = {"hidden_size": 256, "intermediate_size": 512, "linear_head_dim": 128,
        "linear_num_heads": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "moe_intermediate_size": 128}


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    from mrv2.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if not manager.pm.has_plugin("kimi"):
        import mrv2_kimi.plugin

        manager.register(mrv2_kimi.plugin, name="kimi")


def _save(path: Path) -> None:
    from mrv2_kimi.testing import save_tiny_kimi_linear

    save_tiny_kimi_linear(path, **ARCH)


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_kimi_linear_with_graphs(tmp_path: Path) -> None:
    """fp32: HF's greedy tokens in graphs, eager, with prompts split across steps and with
    preemption (a request computed again from a zero state); bf16: graphs and eager agree on
    the first tokens, which mostly equal HF's."""
    _save(tmp_path)
    expected = [hf_greedy(tmp_path, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=12) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


def test_kimi_linear_steps_never_synchronize(tmp_path: Path) -> None:
    _save(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()


def test_kimi_linear_speculative_decoding_and_prefix_cache(tmp_path: Path) -> None:
    """n-gram drafts (3 a step) verified through the KDA layers (``row_slots`` 4), in CUDA
    graphs and eager, then beside prefix caching's state snapshots: fp32 greedy tokens are
    HF's, drafts both kept and rejected."""
    _save(tmp_path)
    prompts = [[5, 9, 13, 17, 21] * 4, [40, 3] * 9 + [7], PROMPTS[2][:40]]
    expected = [hf_greedy(tmp_path, p, 40) for p in prompts]
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    for kwargs in ({}, {"enforce_eager": True}, {"enable_prefix_caching": True,
                                                  "max_num_batched_tokens": 32}):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, **spec, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.stats()
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


def test_kimi_linear_long_prompts_run_chunked(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of 300 and 200 tokens (past ``CHUNKED_MIN_QUERY_LEN_DELTA``, several chunks of
    64 and a remainder) through KDA's chunked kernels (the per-channel decay's), beside a short
    one: fp32 greedy tokens are HF's eager, in CUDA graphs and with the prompts split into
    steps of 128 tokens (each resuming from the state the last left)."""
    from mrv2_kernels import chunk_delta_rule as cdr

    dims: list[int] = []
    chunked = cdr.chunk_gated_delta_rule

    def spy(*args: Any, **kw: Any) -> Any:
        dims.append(args[3].dim())  # g: [T, H, K]
        return chunked(*args, **kw)

    monkeypatch.delenv(cdr.CHUNKED_ENV_VAR, raising=False)
    monkeypatch.setattr(cdr, "chunk_gated_delta_rule", spy)
    _save(tmp_path)
    prompts = [[1 + (13 * i + 5) % 120 for i in range(300)],
               [1 + (7 * i) % 120 for i in range(200)], [8, 8, 120]]
    expected = [hf_greedy(tmp_path, p, 40) for p in prompts]
    assert _generate(tmp_path, "float32", prompts, enforce_eager=True) == expected
    assert dims and set(dims) == {3}
    assert _generate(tmp_path, "float32", prompts) == expected
    assert _generate(tmp_path, "float32", prompts, max_num_batched_tokens=128) == expected
