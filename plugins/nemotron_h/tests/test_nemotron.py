"""NemotronForCausalLM (Nemotron-4 / Minitron) through the engine against HF transformers:
greedy tokens of several requests and every prompt position's log-probability, prompts split
over chunked-prefill steps; norm weights redrawn around 0, so a scale of ``weight`` instead of
HF's ``1 + weight`` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, redraw_weights
from mrv2.testing_engine import check_prompt_logprobs

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(21)]]
MAX_TOKENS = 8
TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


@pytest.mark.parametrize("overrides", [
    {},  # published defaults: relu2, partial_rotary_factor 0.5, no biases, untied head
    {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4,
     "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                         "partial_rotary_factor": 0.25}},
], ids=["default", "biases-quarter-rope"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    config = transformers.NemotronConfig(**{**TINY, **overrides})
    config.architectures = ["NemotronForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.NemotronForCausalLM(config).float().eval()
    redraw_weights(hf, std=0.15)
    assert not config.tie_word_embeddings
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(tmp_path, p, MAX_TOKENS) for p in PROMPTS]
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
