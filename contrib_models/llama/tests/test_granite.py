"""GraniteForCausalLM against HF transformers: greedy tokens through the engine with every
multiplier away from 1 (embedding, attention, residual, logits); GraniteSWAForCausalLM's
greedy tokens and prompt log-probabilities with windows shorter than the prompts, sinks far
from HF's zeros and a RoPE base per layer (one NoPE), prompts split over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, redraw_weights
from mrv2.testing_engine import check_prompt_logprobs

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def test_greedy_tokens_match_hf(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "GraniteForCausalLM", std=0.15,
                                embedding_multiplier=6.0, attention_multiplier=0.4,
                                residual_multiplier=0.3, logits_scaling=4.0, pad_token_id=0)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    assert llm.engine.runner.model.model.layers[0].self_attn.attn.scale == 0.4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
    # the first token's logprob (the logits' scaling shows there, not in the argmax)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].log_softmax(-1)
    token = outs[0].outputs[0].token_ids[0]
    got = outs[0].outputs[0].logprobs[0][token].logprob
    assert got == pytest.approx(float(want[token]), abs=1e-4)


SWA_TINY: dict[str, Any] = {
    "vocab_size": 260, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "embedding_multiplier": 0.5, "attention_multiplier": 0.2, "residual_multiplier": 1.2,
    "logits_scaling": 1.7, "layer_types": ["sliding_attention", "full_attention",
                                           "sliding_attention"],
    "sliding_window": 5, "layer_rope_theta": [10000.0, 0, 500.0],
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


@pytest.mark.parametrize("overrides", [
    {},  # tied head (as published), every layer's own RoPE base, the middle one NoPE
    {"sliding_window": 3, "tie_word_embeddings": False, "attention_bias": True,
     "layer_rope_theta": None, "rope_parameters": {"rope_type": "default",
                                                   "rope_theta": 1000.0}},
], ids=["tied-nope", "untied-bias-one-theta"])
def test_granite_swa_matches_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    config = transformers.GraniteSWAConfig(**{**SWA_TINY, **overrides})
    config.architectures = ["GraniteSWAForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.GraniteSWAForCausalLM(config).float().eval()
    redraw_weights(hf, std=0.15)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.uniform_(-1.0, 2.0)  # (HF's init: zeros)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    assert type(llm.engine.runner.model).__name__ == "GraniteSWAForCausalLM"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tmp_path, p, 8)
                                                      for p in PROMPTS]
    ids = PROMPTS[1]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
