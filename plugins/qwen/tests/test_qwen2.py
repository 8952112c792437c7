"""Qwen2ForCausalLM (Qwen2 / Qwen2.5; q/k/v biased, no q/k norm) against HF transformers:
greedy tokens and the top-3 logprobs at every prompt and generated position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint, redraw_weights

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + i % 100 for i in range(21)]]


@pytest.mark.parametrize("tie", [False, True])
def test_matches_hf(tmp_path: Path, tie: bool) -> None:
    path = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=tie)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path).eval()
    redraw_weights(hf)  # biases and all: every part matters
    hf.save_pretrained(path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                 params, use_tqdm=False), strict=True):
        tokens = out.outputs[0].token_ids
        sequence = torch.tensor([prompt + tokens])
        with torch.no_grad():
            want = hf.generate(sequence[:, :len(prompt)], max_new_tokens=6, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            ref = torch.log_softmax(hf(sequence).logits[0].float(), dim=-1)
        assert tokens == want[0, len(prompt):].tolist()
        assert out.prompt_logprobs is not None and out.outputs[0].logprobs is not None
        for j, logprobs in enumerate([*out.prompt_logprobs[1:], *out.outputs[0].logprobs], 1):
            assert logprobs is not None
            for token, lp in logprobs.items():
                assert lp.logprob == pytest.approx(float(ref[j - 1, token]), abs=2e-4)
