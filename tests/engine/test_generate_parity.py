"""End to end on CPU: greedy tokens equal HF transformers', for batched prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, prefill_logits

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return [hf_greedy(checkpoint, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _generate(checkpoint: Path, **kwargs: object) -> list[list[int]]:
    engine_kwargs = {"device": "cpu", "dtype": "float32", "block_size": 4, **kwargs}
    llm = LLM(str(checkpoint), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].finish_reason == "length"
    return [output.outputs[0].token_ids for output in outputs]


def test_greedy_matches_hf(checkpoint: Path, expected: list[list[int]]) -> None:
    assert _generate(checkpoint) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"async_scheduling": False},
        {"max_num_batched_tokens": 8},  # chunked prefill: every long prompt in pieces
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 64},
        {"num_gpu_blocks_override": 14},  # tiny cache: requests wait, get preempted
        {"max_num_seqs": 1},
    ],
    ids=["sync", "chunked", "no-chunking", "tiny-cache", "one-at-a-time"],
)
def test_scheduling_does_not_change_greedy_output(
    checkpoint: Path, expected: list[list[int]], kwargs: dict[str, object]
) -> None:
    assert _generate(checkpoint, **kwargs) == expected


def test_tiny_cache_really_preempts(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4,
              num_gpu_blocks_override=14)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 14


def test_logits_match_hf_for_prefill(checkpoint: Path) -> None:
    """The runner's last-position logits equal HF's, for a mixed batch, in fp32."""
    import transformers

    from mrv2.config import EngineConfig
    from mrv2.runner.runner import Runner

    config = EngineConfig.from_kwargs(model=str(checkpoint), device="cpu", dtype="float32",
                                      block_size=4)
    got = prefill_logits(Runner.from_config(config), PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=1e-4)
