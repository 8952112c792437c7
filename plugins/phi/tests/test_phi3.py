"""Phi3ForCausalLM against HF transformers: greedy tokens through the engine from fused
``qkv_proj`` / ``gate_up_proj`` checkpoints (LongRoPE with partial rotary dimensions; a
sliding window with tied embeddings), the LongRoPE table's long-factor rows against HF's
long frequencies, and a fused tensor of the wrong size named."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.layers.rotary import get_rope
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]
HALF = 8  # rotary frequencies of a 32-dim head at partial_rotary_factor 0.5
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
            "long_factor": [1.5 + 0.3 * i for i in range(HALF)],
            "original_max_position_embeddings": 32}
CASES: dict[str, dict[str, Any]] = {
    "longrope-partial": {"head_dim": 32, "num_attention_heads": 2, "max_position_embeddings": 128,
                         "original_max_position_embeddings": 32, "rope_parameters": LONGROPE,
                         "tie_word_embeddings": False},
    "window-tied": {"sliding_window": 6, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf(case: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Phi3ForCausalLM", std=0.15, pad_token_id=0,
                                **CASES[case])
    names = load_file(path / "model.safetensors")
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in names)
    assert any(n.endswith("mlp.gate_up_proj.weight") for n in names)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    # every sequence stays within original_max_position_embeddings: short factors in both
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]


def test_longrope_table_takes_the_long_factors_past_the_original_length() -> None:
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=2, head_dim=32,
                                     num_key_value_heads=2, max_position_embeddings=128,
                                     original_max_position_embeddings=32,
                                     rope_parameters=dict(LONGROPE))
    rope = get_rope(config, 32)
    table = rope._table(torch.device("cpu"))
    fn = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
    for seq_len, rows in ((None, slice(0, 32)), (33, slice(32, 128))):
        inv_freq, factor = fn(config, torch.device("cpu"), seq_len=seq_len)
        assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
        pos = torch.arange(128, dtype=torch.float32)[rows]
        freqs = torch.outer(pos, inv_freq.float())
        want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
        torch.testing.assert_close(table[rows], want, rtol=1e-5, atol=1e-5)


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Phi3ForCausalLM", pad_token_id=0)
    file = path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-4]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.qkv_proj.weight' has 124 "
                                         r"rows; the config's q_proj/k_proj/v_proj need 128"):
        LLM(str(path), device="cpu", dtype="float32")
