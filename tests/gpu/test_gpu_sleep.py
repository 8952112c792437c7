"""GPU: sleep mode gives the device memory back and takes it again (vLLM's ``LLM.sleep`` /
``wake_up``): after ``sleep()`` the engine holds almost nothing on the device, another user
can allocate what it held, and after ``wake_up()`` it answers as before through CUDA graphs
captured again; level 2 answers again once the weights are reloaded.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import time

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu


def test_sleep_returns_the_memory_and_wakes_to_the_same_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM",
                                vocab_size=320, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [8, 8, 250, 1, 2]}]
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    held = torch.cuda.memory_allocated()
    assert held > 10 * 2**30 and runner.graphs is not None
    for level in (1, 2):
        started = time.perf_counter()
        llm.sleep(level)
        asleep_s = time.perf_counter() - started
        assert torch.cuda.memory_allocated() < held - 10 * 2**30  # the KV cache, the weights
        # another user takes what the engine gave back, then lets it go
        other = torch.empty(int(held * 0.9), dtype=torch.uint8, device="cuda")
        del other
        torch.cuda.empty_cache()
        started = time.perf_counter()
        llm.wake_up()
        print(f"level {level}: sleep {asleep_s:.2f} s, wake_up "
              f"{time.perf_counter() - started:.2f} s")
        assert runner.graphs is not None  # captured again
        if level == 2:
            llm.reload_weights()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == want
    llm.shutdown()
