"""GPU: Gemma 4's text decoder (per-layer embeddings, KV sharing, keys as values, proportional
RoPE, soft-capped logits; and the MoE block on the fused kernels' GeGLU) through the engine
with CUDA graphs and the Triton kernels: fp32 greedy tokens are HF's, graphs on and off; bf16
graphs on and off agree. Prompts and outputs run past the local window.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import redraw_weights

pytestmark = pytest.mark.gpu

S, F = "sliding_attention", "full_attention"
PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 250], [1 + i % 200 for i in range(97)], [64]]
BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64, "num_hidden_layers": 6,
    "layer_types": [S, S, F, S, S, F], "sliding_window": 24, "max_position_embeddings": 512,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "num_kv_shared_layers": 2, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "use_double_wide_mlp": True, "final_logit_softcapping": 30.0, "eos_token_id": 1,
    "bos_token_id": 2}
MOE: dict[str, Any] = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                       "moe_intermediate_size": 64}


def _checkpoint(path: Path, **extra: Any) -> Any:
    config = transformers.Gemma4TextConfig(**{**BASE, **extra})
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).eval()
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


@pytest.mark.parametrize("moe", [False, True])
def test_gemma4_with_graphs(tmp_path: Path, moe: bool) -> None:
    hf = _checkpoint(tmp_path, **(MOE if moe else {}))
    expected = [_hf_greedy(hf, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
