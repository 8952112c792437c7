"""PhiForCausalLM (phi-1 / phi-1.5 / phi-2) against HF transformers on tiny random checkpoints
saved with ``save_pretrained``: greedy tokens and every prompt position's log-probability
through the engine, prompts split over chunked-prefill steps and decoded beside each other.

The config is phi-2's shape in small: head_dim 80 (hidden 160 over 2 heads: not a power of
two, so the Triton paged attention pads it), 32 of its 80 dims rotated
(``partial_rotary_factor`` 0.4), the parallel block off one biased LayerNorm, biased q/k/v,
``dense``, ``fc1`` / ``fc2`` (``gelu_new``) and LM head, untied. The second case turns on
``qk_layernorm`` (one biased LayerNorm over head_dim shared by the heads) with one key/value
head. Each case runs on the torch attention backend and on the Triton one (interpreted on the
CPU, ``TRITON_INTERPRET=1``: the root conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2.testing_engine import check_prompt_logprobs

pytestmark = pytest.mark.filterwarnings(  # the Triton interpreter, harmlessly
    "ignore:Conversion of an array with ndim:DeprecationWarning",
    "ignore:overflow encountered:RuntimeWarning",
)

PHI2: dict[str, Any] = {"hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 2,
                        "partial_rotary_factor": 0.4, "hidden_act": "gelu_new",
                        "tie_word_embeddings": False}
CASES: dict[str, dict[str, Any]] = {
    "phi-2": PHI2,
    "qk-layernorm-gqa": {**PHI2, "qk_layernorm": True, "num_key_value_heads": 1},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11, 64, 2, 31, 7, 199, 45, 6, 90],
           [3 + i for i in range(13)], [64]]
NEW_TOKENS = 6


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str, backend: str) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "PhiForCausalLM", std=0.15, **CASES[case])
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.hidden_size // config.num_attention_heads == 80
    assert config.qk_layernorm == (case == "qk-layernorm-gqa")
    want = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4, attention_backend=backend,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits,
                              atol=2e-4)
