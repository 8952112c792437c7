"""Zamba2 (Mamba-2 layers and shared transformer blocks) through the engine against HF
transformers: greedy tokens of several requests (HF's full forward per token), prompts split
across steps (the SSM, conv and each invocation's KV cache carried between chunks), decode
steps, every prompt position's log-probability; a KV cache layer per invocation of a shared
block, the block's weights held once, HF's names (saved: the first copy of each block; in
memory: every layer's) load every parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.contract.kv_cache import layer_specs
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_mamba.testing import save_tiny_zamba2
from mrv2_mamba.zamba2 import HybridLayer, Zamba2ForCausalLM

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(21)]]
MAX_TOKENS = 6
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                          "max_model_len": 256, "max_num_batched_tokens": 8}
#: name -> overrides of TINY_ZAMBA2: two shared blocks (block 0 invoked twice) with q/k/v
#: and MLP adapters and RoPE; one block invoked three times, no attention adapters, no RoPE,
#: biased projections, one B/C group; an untied LM head (transformers then unties the blocks
#: too: each invocation its own copy).
VARIANTS: dict[str, dict[str, Any]] = {
    "two-blocks-adapters-rope": {},
    "one-block-biased": {"num_mem_blocks": 1, "use_shared_attention_adapter": False,
                         "use_mem_rope": False, "add_bias_linear": True,
                         "mamba_ngroups": 1},
    "untied": {"tie_word_embeddings": False},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_logprobs_match_hf(tmp_path: Path, variant: str) -> None:
    overrides = VARIANTS[variant]
    hf = save_tiny_zamba2(tmp_path, **overrides)
    want = [hf_greedy(tmp_path, p, MAX_TOKENS) for p in PROMPTS]

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = Zamba2ForCausalLM(config)
    hybrids = [m for m in model.model.layers if isinstance(m, HybridLayer)]
    blocks = int(overrides.get("num_mem_blocks", 2)) if config.tie_word_embeddings else 3
    shared = cast(torch.nn.ModuleList, model.model.shared_blocks)
    assert len(hybrids) == 3 and len(shared) == blocks
    assert [h.block is shared[j % blocks] for j, h in enumerate(hybrids)] == [True] * 3
    assert sorted(layer_specs(model)) == [0, 1, 2]  # (one KV cache layer per invocation)
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(tmp_path)) == every
    # HF's in-memory names: every hybrid layer's copy of its block, into the one block
    again = Zamba2ForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    llm = LLM(str(tmp_path), **ENGINE)
    assert len(llm.engine.runner.kv.specs) == 3 and llm.engine.runner.keeps_request_state
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = PROMPTS[2]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
