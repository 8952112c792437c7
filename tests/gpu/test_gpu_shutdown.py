"""GPU: ``LLM.shutdown`` returns the engine's device memory while the object is still
referenced: a second engine asking for the same share of the device then starts (before,
the first one's KV cache counted as in use and the second found no memory for its own).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu


def test_a_shut_down_engine_leaves_its_memory_to_the_next(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM",
                                vocab_size=320, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}]
    before = torch.cuda.memory_allocated()
    first = LLM(str(ckpt), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    want = first.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert torch.cuda.memory_allocated() - before > 10 * 2**30  # its KV cache
    first.shutdown()
    assert torch.cuda.memory_allocated() - before < 2**28
    second = LLM(str(ckpt), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    assert second.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    second.shutdown()
    assert first is not None
