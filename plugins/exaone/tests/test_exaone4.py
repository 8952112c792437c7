"""Exaone4ForCausalLM against HF transformers: prefill and decode logits through the paged
cache (post-norms, per-head q/k norms, local layers past their window, a global NoPE layer
whose q/k norms run without a rotation), greedy tokens through the engine with and without a
window, and tensor parallelism equal to one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import SamplingParams
from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_engine import tokens_at_tp
from mrv2_exaone.model import Exaone4ForCausalLM

LAYERS = ["sliding_attention"] * 3 + ["full_attention"]
WINDOWED: dict[str, Any] = {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 4,
                            "layer_types": LAYERS}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]


def test_logits_match_hf(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Exaone4ForCausalLM", std=0.15, **WINDOWED)
    config = transformers.AutoConfig.from_pretrained(path)
    model = Exaone4ForCausalLM(config)
    load_model_weights(model, iter_safetensors(path))
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, 4, 4, None]
    assert [layer.self_attn.rotary_emb is None for layer in layers] == [False] * 3 + [True]
    hf = transformers.Exaone4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


@pytest.mark.parametrize("windowed", [True, False], ids=["32b-like", "1.2b-like"])
def test_greedy_tokens_match_hf_at_tp1_and_tp2(tmp_path: Path, windowed: bool) -> None:
    overrides = WINDOWED if windowed else {"head_dim": 16, "sliding_window": None,
                                           "layer_types": ["full_attention"] * 2}
    path = make_tiny_checkpoint(tmp_path / "m", "Exaone4ForCausalLM", std=0.15, **overrides)
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for tp, got in tokens_at_tp(path, PROMPTS, params, max_num_batched_tokens=8).items():
        assert got == want, tp
