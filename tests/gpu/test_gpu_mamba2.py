"""GPU: Mamba-2 (state-space layers only: no KV cache layer, no attention backend) through the
engine on the Triton state kernels (the causal conv and the delta-free gated delta rule): fp32
greedy tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split
across steps, under a small block budget, and with prefix caching resuming from state
snapshots; bf16 (an fp32 residual stream, as the published configs) with graphs on and off
agree and start with HF's tokens; a step never synchronizes. Zamba2 (Mamba-2 layers and two
shared attention blocks, three invocations each with its own KV cache layer and adapters): the
same checks against HF, and dummy weights load.

The two-group checkpoint's references are HF's with its gated norm made per group (the
original Mamba-2's, which the plugin runs: :func:`mrv2_mamba.testing.hf_gated_norm_per_group`).

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
#: Real head sizes (64-dim heads, a 128-wide SSM state, 8 heads over ``expand`` 2 x 256) and
#: HF's chunked scan in several chunks per long prompt.
ARCH: dict[str, Any] = {"hidden_size": 256, "expand": 2, "num_heads": 8, "head_dim": 64,
                        "state_size": 128, "chunk_size": 32, "num_hidden_layers": 4}
#: Mamba-2 configs carry no ``max_position_embeddings``.
MAX_MODEL_LEN = 512


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_model_len=MAX_MODEL_LEN, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _check(path: Path, groups: int) -> None:
    from mrv2_mamba.testing import hf_gated_norm_per_group

    with hf_gated_norm_per_group(groups):
        expected = [hf_greedy(path, p, 40) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    assert _generate(path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(path, "float32", num_gpu_blocks_override=12) == expected
    assert _generate(path, "float32", enable_prefix_caching=True,
                     prompts=PROMPTS + PROMPTS[:2]) == expected + expected[:2]
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("overrides", [{}, {"n_groups": 1, "tie_word_embeddings": True,
                                            "use_bias": False}],
                         ids=["groups2", "one-group-tied"])
def test_mamba2_with_graphs(tmp_path: Path, overrides: dict[str, Any]) -> None:
    from mrv2_mamba.testing import save_tiny_mamba2

    save_tiny_mamba2(tmp_path, **{**ARCH, **overrides})
    _check(tmp_path, int(overrides.get("n_groups", 2)))


def test_mamba2_steps_never_synchronize(tmp_path: Path) -> None:
    from mrv2_mamba.testing import save_tiny_mamba2

    save_tiny_mamba2(tmp_path, **ARCH)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3, max_model_len=MAX_MODEL_LEN)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    assert runner.kv.specs == {} and runner.kv.tensors == []
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()


#: Zamba2 at real head sizes: 8 Mamba heads of 64 over ``mamba_expand`` 2 x 256, a 64-wide
#: state, attention over 512 channels in 8 heads of 64, adapters of rank 16; hybrid layers
#: 1, 3, 4 on two shared blocks (TINY_ZAMBA2's layout).
ZAMBA2: dict[str, Any] = {"hidden_size": 256, "n_mamba_heads": 8, "mamba_d_state": 64,
                          "chunk_size": 32, "num_attention_heads": 8, "num_key_value_heads": 8,
                          "intermediate_size": 512, "adapter_rank": 16,
                          "max_position_embeddings": MAX_MODEL_LEN}


def test_zamba2_with_graphs(tmp_path: Path) -> None:
    from mrv2_mamba.testing import save_tiny_zamba2

    save_tiny_zamba2(tmp_path, **ZAMBA2)
    _check(tmp_path, 1)  # (HF's Zamba2 norms per group already: the patch changes nothing)
    dummy = _generate(tmp_path, "bfloat16", load_format="dummy")
    assert [len(d) for d in dummy] == [40] * len(PROMPTS)
