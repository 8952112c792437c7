"""Models whose head size is not a power of two (Phi-3-mini's 96, Pythia-2.8B's and
StableLM-3B's 80, StableLM-2-12B's 160) on the Triton attention backend: the paged kernels pad
their tiles and mask every head to its real width, the RoPE runs before attention for such
heads (the kernel's own rotation takes power-of-2 heads only). Greedy tokens and prompt
logprobs against HF, over a prompt split into chunked-prefill steps and decode steps beside
another request.

The Triton kernels run interpreted on CPU tensors (``TRITON_INTERPRET=1``, root conftest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

pytestmark = pytest.mark.filterwarnings(  # the Triton interpreter, harmlessly
    "ignore:Conversion of an array with ndim:DeprecationWarning",
    "ignore:overflow encountered:RuntimeWarning",
)

PROMPTS = [[1 + (7 * i) % 200 for i in range(37)], [5, 17, 42, 9, 100, 3, 77]]
NEW_TOKENS = 5


def _hf_prompt_logprobs(path: Path, prompt: list[int]) -> list[float]:
    """HF's logprob of each prompt token after the first, given the ones before it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


@pytest.mark.parametrize(("architecture", "config"), [
    # head_dim 80 (hidden 160 over 2 query heads), one kv head: GQA
    ("LlamaForCausalLM", {"hidden_size": 160, "num_attention_heads": 2,
                          "num_key_value_heads": 1}),
    # head_dim 96 (Phi-3-mini's), its fused qkv and gate_up projections
    ("Phi3ForCausalLM", {"hidden_size": 192, "num_attention_heads": 2,
                         "num_key_value_heads": 2, "pad_token_id": 0}),
    # half the head rotated (as Phi-4-mini rotates 3/4): the RoPE kernel rotates 48 of the 96
    # dims before attention and the cache-write kernel stores the keys
    ("Phi3ForCausalLM", {"hidden_size": 192, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "pad_token_id": 0,
                         "partial_rotary_factor": 0.5}),
    # Pythia-2.8B's 80 (a quarter rotated, parallel blocks), StableLM-2-12B's 160 (per-head
    # q/k LayerNorms over 160, GQA)
    ("GPTNeoXForCausalLM", {"hidden_size": 160, "num_attention_heads": 2,
                            "num_key_value_heads": 2}),
    ("StableLmForCausalLM", {"hidden_size": 320, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "qk_layernorm": True,
                             "use_parallel_residual": True}),
])
def test_triton_backend_matches_hf(tmp_path: Path, architecture: str,
                                   config: dict[str, Any]) -> None:
    path = make_tiny_checkpoint(tmp_path, architecture, std=0.15, **config)
    head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
    assert head_dim & (head_dim - 1), "the case is a head_dim that is not a power of two"
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              attention_backend="triton", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(path, prompt, NEW_TOKENS)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = []
        for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
            assert entry is not None
            got.append(entry[token].logprob)
        assert got == pytest.approx(_hf_prompt_logprobs(path, prompt), abs=2e-4)
