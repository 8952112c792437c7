"""GPU: the Llama-like variants of ``mrv2-contrib-llama`` through the engine on the Triton
kernels, at the published head size (128): Arcee AFM (squared-ReLU dense MLPs, their norm fused
with ``up_proj`` in decode steps; YaRN), Jais 2 (the same MLPs under biased LayerNorms, every
attention projection biased), Apertus (xIELU dense MLPs, per-head q/k RMSNorms fused
into the rotation; Llama 3 RoPE), Helium (interleaved RoPE: q/k rows reordered as they load,
rotated inside the attention kernel; biased q/k/v), Ministral 8B (sliding layers on block
tables of their own beside full ones; prompts and outputs past the window), Ministral 3
(queries scaled by position past ``original_max_position_embeddings``; YaRN), nanochat
(weightless norms fused as ones, reversed RoPE inside the attention kernel, soft-capped
logits), Granite SWA (sliding layers with learned attention sinks, a RoPE base per layer, one
NoPE) and, from
``mrv2-plugin-nemotron-h``, Nemotron-4 (``1 + weight`` LayerNorms on the unfused norm path,
squared-ReLU dense MLPs, half of each head rotated). fp32 greedy
tokens are HF's with CUDA graphs (decode and mixed steps) and without, prompts split across
steps; bf16 graphs on and off agree and start with HF's tokens; a step never synchronizes.

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
NEW_TOKENS = 40
#: head_dim = hidden_size / heads = 128; GQA.
SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
SLIDING, FULL = "sliding_attention", "full_attention"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "arcee": ("ArceeForCausalLM", {**SHAPE, "hidden_act": "relu2", "rope_parameters": YARN}),
    "jais2": ("Jais2ForCausalLM", {**SHAPE, "hidden_act": "relu2", "attention_bias": True,
                                   "mlp_bias": True}),
    "apertus": ("ApertusForCausalLM", {**SHAPE, "hidden_act": "xielu",
                                       "rope_parameters": LLAMA3}),
    "helium": ("HeliumForCausalLM", {**SHAPE, "attention_bias": True}),
    "ministral": ("MinistralForCausalLM", {**SHAPE, "sliding_window": 24,
                                           "layer_types": [SLIDING, FULL] * 2}),
    "nanochat": ("NanoChatForCausalLM", {**SHAPE, "attention_bias": True}),
    "ministral3": ("Ministral3ForCausalLM", {
        **SHAPE, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "llama_4_scaling_beta": 0.5}}),
    "granite-swa": ("GraniteSWAForCausalLM", {
        **SHAPE, "sliding_window": 24, "layer_types": [FULL, SLIDING] * 2,
        "layer_rope_theta": [1e4, 0, 5e5, 1e4], "embedding_multiplier": 0.5,
        "attention_multiplier": 0.05, "residual_multiplier": 1.2, "logits_scaling": 1.7}),
    "nemotron": ("NemotronForCausalLM", {**SHAPE, "hidden_act": "relu2",
                                         "tie_word_embeddings": False}),
}


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _save(path: Path, case: str) -> Path:
    architecture, overrides = CASES[case]
    return make_tiny_checkpoint(path, architecture, std=0.15, pad_token_id=0, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_llama_variant_with_graphs(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    assert _generate(path, "float32", max_num_batched_tokens=32) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    check_bf16_graphs_against_eager(graphs, eager, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_llama_variant_steps_never_synchronize(tmp_path: Path, case: str) -> None:
    path = _save(tmp_path / "m", case)
    config = EngineConfig.from_kwargs(model=str(path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    if case == "ministral":
        assert set(runner.kv_table_windows) == {None, 24}
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()
