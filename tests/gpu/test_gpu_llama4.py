"""GPU: Llama 4's text model (``Llama4ForCausalLM`` and the text path of
``Llama4ForConditionalGeneration``) through the engine on the Triton kernels: RoPE layers
(llama3 scaling, the weightless q/k norm fused into the rotation, the q/k rows reordered for
the interleaved RoPE) and NoPE layers (the query temperature past ``floor_scale``), top-1
sigmoid-scored MoE with a shared expert between dense MLPs, at the published head size. fp32
greedy tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split
across steps and requests preempted; bf16 graphs on and off agree and start with HF's
tokens; a step never synchronizes.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import run_steps_without_sync
from mrv2.testing_engine import check_bf16_graphs_against_eager

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [1 + (7 * i) % 120 for i in range(97)],
           [64]]
NEW_TOKENS = 40
#: The published head size (128), GQA, 8 experts; chunks (and the context) of 256 positions;
#: the temperature growing every 8 positions.
ARCH: dict[str, Any] = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "intermediate_size": 256,
                        "intermediate_size_mlp": 512, "num_local_experts": 8,
                        "attention_chunk_size": 256, "max_position_embeddings": 256,
                        "floor_scale": 8, "attn_scale": 0.3}


def _hf_tokens(hf: Any, prompt: list[int]) -> list[int]:
    """HF ``generate``'s greedy tokens (on the CPU, fp32, no EOS stop)."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _save(path: Path, case: str) -> torch.nn.Module:
    from mrv2_llama4.testing import save_tiny_llama4, save_tiny_llama4_vl

    save = save_tiny_llama4_vl if case == "conditional" else save_tiny_llama4
    return save(path, **ARCH)


@pytest.mark.parametrize("case", ["causal", "conditional"])
def test_llama4_with_graphs(tmp_path: Path, case: str) -> None:
    hf = _save(tmp_path, case)
    expected = [_hf_tokens(hf, p) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=12) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    # bf16: graphs and eager round differently (the decode graph's fused norm + GEMV), and a
    # top-1 router turns a near tie into another expert; the first H100 run (2026-12-06) had
    # one prompt of four part at its second token. fp32 above is exact everywhere.
    check_bf16_graphs_against_eager(graphs, eager, expected)


def test_llama4_chunked_tables_with_graphs(tmp_path: Path) -> None:
    """Chunks of 32 (a context of 256): the chunked layers' block table of its own frees each
    request's earlier chunks as it runs, in a pool too small to keep them; fp32 greedy
    tokens with graphs (prompts of up to 97 tokens, 40 more: past four chunk boundaries) are
    HF's."""
    from mrv2.contract.kv_cache import AttentionChunk
    from mrv2_llama4.testing import save_tiny_llama4

    hf = save_tiny_llama4(tmp_path, **{**ARCH, "attention_chunk_size": 32})
    expected = [_hf_tokens(hf, p) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, num_gpu_blocks_override=30)
    assert llm.engine.runner.kv_table_windows == (None, AttentionChunk(32))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.tables.num_freed > 0
    assert llm.engine.block_manager.num_free_blocks == 30
    llm.shutdown()


def test_llama4_steps_never_synchronize(tmp_path: Path) -> None:
    _save(tmp_path, "causal")
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
