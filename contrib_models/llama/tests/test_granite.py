"""GraniteForCausalLM against HF transformers: greedy tokens through the engine with every
multiplier away from 1 (embedding, attention, residual, logits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

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
