"""GPU: every sampler stage gives the CPU path's tokens, stays sync-free, and prompt logprobs of
a long prompt stay within a memory bound.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM",
                                hidden_size=128, intermediate_size=256, head_dim=32,
                                vocab_size=320)
    make_tiny_tokenizer(path)
    return path


def _stage_params(tokenized: bool = False) -> list[SamplingParams]:
    """One request per stage (penalties, bias/allowed ids, bad words + min_tokens, top-k/p with
    logprobs), all seeded so CPU and GPU must draw the same tokens. ``tokenized``: set the bad
    words' token ids directly (for the Runner, which gets them from the engine)."""
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=1.0, seed=12, max_tokens=16, ignore_eos=True,
                       logit_bias={7: 5.0, 9: -100.0}, allowed_token_ids=list(range(3, 120))),
        SamplingParams(temperature=0.8, seed=13, max_tokens=16, min_tokens=10,
                       bad_words=["the", "a b", "xyz"], stop_token_ids=[2], top_k=40),
        SamplingParams(temperature=0.7, seed=14, max_tokens=16, ignore_eos=True, top_p=0.9,
                       min_p=0.02, logprobs=4),
    ]
    if tokenized:
        params[2]._bad_words_token_ids = [[33], [5, 6], [40, 41, 42]]
    return params


def test_every_stage_gives_the_cpu_tokens(ckpt: Path) -> None:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(ckpt), device=device, dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3)
        runs[device] = llm.generate(prompts, _stage_params(), use_tqdm=False)
    for cpu, gpu in zip(runs["cpu"], runs["cuda"], strict=True):
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
    cpu_lps, gpu_lps = runs["cpu"][3].outputs[0].logprobs, runs["cuda"][3].outputs[0].logprobs
    assert cpu_lps is not None and gpu_lps is not None and len(gpu_lps) == 16
    for a, b in zip(cpu_lps, gpu_lps, strict=True):
        assert a.keys() == b.keys()
        for token, lp in a.items():
            assert math.isclose(lp.logprob, b[token].logprob, abs_tol=1e-4)
            assert lp.rank == b[token].rank


def test_stages_never_synchronize(ckpt: Path) -> None:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    params = _stage_params(tokenized=True)
    new = [NewRequest(str(i), p, params[i], seed=i, block_ids=[i * 8 + j for j in range(8)])
           for i, p in enumerate(PROMPTS)]
    prompt_lp = SamplingParams(temperature=0, prompt_logprobs=3, max_tokens=4)
    outputs = []
    runner.execute(SchedulerOutput({"0": 2, "1": 1, "2": 1, "3": 1}, new_requests=new)).result()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs.append(runner.execute(SchedulerOutput(
            {"0": 5, "1": 2, "2": 36, "4": 20},
            new_requests=[NewRequest("4", PROMPTS[2][:20], prompt_lp, seed=4,
                                     block_ids=list(range(40, 44)))])))
        for _ in range(6):
            outputs.append(runner.execute(SchedulerOutput({str(i): 1 for i in range(5)})))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    results = [out.result() for out in outputs]
    assert set(results[-1]) == {"0", "1", "2", "3", "4"}


def test_prompt_logprobs_of_an_8k_prompt_stay_under_the_bound(tmp_path: Path) -> None:
    vocab = 151_936
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=vocab,
                                max_position_embeddings=8448)
    prompt = [(i * 7919) % vocab for i in range(8192)]
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=8448,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.3, enforce_eager=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)  # warm up allocator and kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    peak = torch.cuda.max_memory_allocated() - base
    full = 8192 * vocab * 4  # what one [8K, vocab] fp32 logits tensor would take: 4.98 GB
    # One 1,024-row slice of fp32 logits is 622 MB; softmax temporaries at most double it.
    bound = 1_400 * 2**20
    print(f"prompt logprobs on 8K tokens: peak {peak / 2**20:.0f} MiB "
          f"(bound {bound / 2**20:.0f} MiB, a full tensor {full / 2**20:.0f} MiB)")
    assert peak < bound
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 8192
    assert out.prompt_logprobs[0] is None
    assert all(prompt[i] in out.prompt_logprobs[i] for i in (1, 1000, 8191))
