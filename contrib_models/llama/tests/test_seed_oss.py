"""SeedOssForCausalLM (ByteDance Seed-OSS-36B) against HF transformers: greedy tokens through
the engine, with biased q/k/v projections and an unbiased output projection as released."""

from __future__ import annotations

from pathlib import Path

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def test_greedy_tokens_match_hf(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "SeedOssForCausalLM", std=0.15,
                                attention_bias=True, attention_out_bias=False, pad_token_id=0)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
