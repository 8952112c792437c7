"""OLMo hybrid (Gated DeltaNet and OLMo attention layers) through the engine against HF
transformers: greedy tokens of several requests (HF's full forward per token), prompts split
across steps (the convolution and recurrent states and the attention's KV cache carried
between chunks), decode steps, every prompt position's log-probability; the saved names
(``attention_layer_norm``, ``q_conv1d`` ...: transformers writes the fused convolution back in
three near-equal parts) and transformers' in-memory ones load every parameter alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.contract.kv_cache import layer_specs
from mrv2.contract.request_state import request_state_layers
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_olmo.olmo_hybrid import OlmoHybridForCausalLM
from mrv2_olmo.testing import save_tiny_olmo_hybrid

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(21)]]
MAX_TOKENS = 6
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                          "max_model_len": 256, "max_num_batched_tokens": 8}
#: name -> overrides of TINY_OLMO_HYBRID: two value heads per key head, ``beta`` up to 2, an
#: untied head; one value head per key head, ``beta`` up to 1, tied embeddings.
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa-neg-eigval": {},
    "tied-no-neg-eigval": {"linear_num_value_heads": 2, "linear_allow_neg_eigval": False,
                           "tie_word_embeddings": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_logprobs_match_hf(tmp_path: Path, variant: str) -> None:
    hf = save_tiny_olmo_hybrid(tmp_path, **VARIANTS[variant])
    want = [hf_greedy(tmp_path, p, MAX_TOKENS) for p in PROMPTS]

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = OlmoHybridForCausalLM(config)
    assert sorted(layer_specs(model)) == [0] and len(request_state_layers(model)) == 3
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(tmp_path)) == every
    again = OlmoHybridForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.engine.runner.keeps_request_state
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = PROMPTS[2]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
