"""GPU: Gemma 3n's text decoder (AltUp, Laurel, per-layer embeddings, KV sharing, activation
sparsity on the first layers, soft-capped logits) through the engine with CUDA graphs and the
Triton kernels: fp32 greedy tokens are HF's, graphs on and off; bf16 graphs on and off agree;
a step adds no host sync. Prompts and outputs run past the local window.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import redraw_weights, run_steps_without_sync
from mrv2.testing_engine import check_bf16_graphs_against_eager

pytestmark = pytest.mark.gpu

S, F = "sliding_attention", "full_attention"
PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 250], [1 + i % 200 for i in range(97)], [64]]
CONFIG: dict[str, Any] = {
    "vocab_size": 256, "vocab_size_per_layer_input": 256, "hidden_size": 128,
    "intermediate_size": [256, 192, 256, 192, 256, 192], "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 6,
    "layer_types": [S, S, F, S, S, F], "sliding_window": 24, "max_position_embeddings": 512,
    "hidden_size_per_layer_input": 16, "laurel_rank": 16, "altup_num_inputs": 4,
    "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
    "final_logit_softcapping": 30.0, "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}


def _checkpoint(path: Path) -> Any:
    config = transformers.Gemma3nTextConfig(**CONFIG)
    config.architectures = ["Gemma3nForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Gemma3nForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _generate(path: Path, dtype: str, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3n_with_graphs(tmp_path: Path) -> None:
    hf = _checkpoint(tmp_path)
    expected = [_hf_greedy(hf, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


def test_gemma3n_steps_never_synchronize(tmp_path: Path) -> None:
    """AltUp's copies, the sparsity cutoff and the kv-shared layers add no host sync."""
    _checkpoint(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert set(tokens[-1]) == {"0", "1", "2", "3"}
    runner.shutdown()
