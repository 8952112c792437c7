"""GPU: Mamba-1 mixers (the core's ``Mamba1Mixer``: the causal conv and the selective scan on
their Triton kernels) through the engine: state-spaces Mamba and FalconMamba (no KV cache
layer) and Jamba (Mamba-1 layers, an attention layer, MoE layers). fp32 greedy tokens are
HF's with CUDA graphs (decode and mixed steps) and without, prompts split across steps,
under a small block budget, with prefix caching resuming from state snapshots; bf16 graphs on
and off agree and start with HF's tokens; dummy weights load; a step never synchronizes.

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
#: Mamba configs carry no ``max_position_embeddings`` (Jamba's attention layers do: as long).
MAX_MODEL_LEN = 512
#: Real mixer sizes (512 channels, a 16-wide state per channel, a time step of rank 16).
ARCH: dict[str, dict[str, Any]] = {
    "Mamba": {"hidden_size": 256, "expand": 2, "state_size": 16, "time_step_rank": 16,
              "num_hidden_layers": 4},
    "FalconMamba": {"hidden_size": 256, "expand": 2, "state_size": 16, "time_step_rank": 16,
                    "num_hidden_layers": 4, "use_bias": False, "tie_word_embeddings": True},
    "Jamba": {"hidden_size": 256, "intermediate_size": 512, "mamba_dt_rank": 16,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": MAX_MODEL_LEN},
}


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_model_len=MAX_MODEL_LEN, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", list(ARCH))
def test_mamba1_families_with_graphs(tmp_path: Path, family: str) -> None:
    from mrv2_mamba.testing import save_tiny_mamba1

    save_tiny_mamba1(tmp_path, family, **ARCH[family])
    expected = [hf_greedy(tmp_path, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=12) == expected
    assert _generate(tmp_path, "float32", enable_prefix_caching=True,
                     prompts=PROMPTS + PROMPTS[:2]) == expected + expected[:2]
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1
    dummy = _generate(tmp_path, "bfloat16", load_format="dummy")
    assert [len(d) for d in dummy] == [40] * len(PROMPTS)


@pytest.mark.parametrize("family", ["Mamba", "Jamba"])
def test_mamba1_steps_never_synchronize(tmp_path: Path, family: str) -> None:
    from mrv2_mamba.testing import save_tiny_mamba1

    save_tiny_mamba1(tmp_path, family, **ARCH[family])
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3, max_model_len=MAX_MODEL_LEN)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
