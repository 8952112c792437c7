"""Olmo2ForCausalLM against HF transformers: greedy tokens through the engine (post-norms,
whole-projection q/k norms), on one rank and under tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def test_greedy_tokens_match_hf(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Olmo2ForCausalLM", std=0.15, pad_token_id=0)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("tp", [2, 4], ids=["kv-split", "kv-replicated"])
def test_tensor_parallel_equals_one_gpu(tmp_path: Path, tp: int) -> None:
    """The whole-projection q/k norms under tensor parallelism: each rank's heads normalized
    by the mean square of every rank's (TP=4 over 2 key heads: each held by two ranks, its
    squares counted once)."""
    path = make_tiny_checkpoint(tmp_path / "m", "Olmo2ForCausalLM", std=0.15, pad_token_id=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    runs = []
    for size in (1, tp):
        with LLM(str(path), device="cpu", dtype="float32", block_size=4,
                 tensor_parallel_size=size) as llm:
            runs.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                     use_tqdm=False))
    assert [o.outputs[0].token_ids for o in runs[1]] == [hf_greedy(path, p, 8) for p in PROMPTS]
    for one, two in zip(*runs, strict=True):  # the prompt tokens' log-probabilities too
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert [round(x.logprob, 4) for x in a.values()] == [
                round(x.logprob, 4) for x in b.values()]
