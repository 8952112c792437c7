"""GPU: ``kv_cache_dtype="fp8"`` through the compiled kernels: the caches are float8 and hold
twice the blocks of bf16 ones, prefill logits stay near HF's, async / graphs on-off agree,
steps never synchronize.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_gpu_engine import ARCH, PROMPTS

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import make_tiny_checkpoint, prefill_logits, run_steps_without_sync

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", **ARCH)


def _runner(ckpt: Path, **kwargs: Any) -> Runner:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3,
                                      **kwargs)
    return Runner.from_config(config)


def _greedy(ckpt: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3,
              kv_cache_dtype="fp8", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_caches_hold_twice_the_bf16_blocks(ckpt: Path) -> None:
    plain = _runner(ckpt)
    per_block = plain.kv.bytes_per_block(16, torch.bfloat16)
    del plain
    fp8 = _runner(ckpt, kv_cache_dtype="fp8")
    assert all(t.dtype == torch.float8_e4m3fn for t in fp8.kv.tensors)
    assert fp8.kv.bytes_per_block(16, torch.bfloat16) * 2 == per_block


def test_fp8_prefill_logits_close_to_hf(ckpt: Path) -> None:
    import transformers

    got = prefill_logits(_runner(ckpt, kv_cache_dtype="fp8"), PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            err = (got[i] - ref).norm() / ref.norm()
            assert err < 6e-2, f"prompt {i}: relative error {err:.4f}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_async_and_graphs_on_off_agree(ckpt: Path, dtype: str) -> None:
    default = _greedy(ckpt, dtype=dtype)
    assert _greedy(ckpt, dtype=dtype, async_scheduling=False) == default
    eager = _greedy(ckpt, dtype=dtype, enforce_eager=True)
    for a, b in zip(default, eager, strict=True):  # (see test_gpu_engine's bf16 case)
        assert a[:8] == b[:8]


def test_fp8_steps_never_synchronize(ckpt: Path) -> None:
    runner = _runner(ckpt, kv_cache_dtype="fp8")
    assert runner.graphs is not None and runner.graphs.graphs
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert set(tokens[-1]) == {"0", "1", "2", "3"}
