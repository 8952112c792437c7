"""GPU: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (``mrv2-plugin-qwen-vl``) and Qwen3.5-MoE's
vision-language checkpoint (``mrv2-plugin-qwen`` on it: the hybrid text model) with images:
fp32 tokens equal the CPU engine's (which equals HF, ``plugins/qwen_vl/tests``,
``plugins/qwen/tests/test_qwen3_5_vl.py``), bf16 graphs on/off agree, and neither text-only
nor image steps synchronize with the host.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import run_media_steps_without_sync

pytestmark = pytest.mark.gpu
testing = pytest.importorskip("mrv2_qwen_vl.testing")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _qwen3_5_vl(path: Path) -> Path:
    from mrv2_qwen.testing import save_tiny_qwen3_5_vl

    save_tiny_qwen3_5_vl(path, moe=True)
    return path


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5-moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = {"qwen2-vl": testing.make_tiny_qwen2_vl, "qwen2.5-vl": testing.make_tiny_qwen_vl,
            "qwen3-vl": testing.make_tiny_qwen3_vl, "qwen3.5-moe": _qwen3_5_vl}[request.param]
    return Path(make(tmp_path_factory.mktemp("qwen_vl")))


def _prompts(llm: LLM) -> list[dict[str, Any]]:
    marks = [testing.START, testing.IMAGE, testing.END]
    images = [testing.random_image(56, 84, 0), testing.random_image(112, 56, 1)]
    return [
        {"prompt_token_ids": [5, 17, *marks, 42, 9], "multi_modal_data": {"image": images[:1]}},
        {"prompt_token_ids": [3, *marks, 8, 8, *marks, 33],
         "multi_modal_data": {"image": images}},
        {"prompt_token_ids": [5, 17, 42, 9, 100, 3, 77]},
    ]


def _run(ckpt: Path, device: str, dtype: str, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(ckpt), device=device, dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    outs = llm.generate(_prompts(llm), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_equals_cpu_with_graphs(ckpt: Path) -> None:
    cpu = _run(ckpt, "cpu", "float32")
    assert _run(ckpt, "cuda", "float32") == cpu
    assert _run(ckpt, "cuda", "float32", enforce_eager=True) == cpu


def test_bf16_graphs_on_off_agree(ckpt: Path) -> None:
    graphs = _run(ckpt, "cuda", "bfloat16")
    eager = _run(ckpt, "cuda", "bfloat16", enforce_eager=True)
    for a, b in zip(graphs, eager, strict=True):
        assert a[:8] == b[:8]


def test_steps_never_synchronize(ckpt: Path) -> None:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    from mrv2_qwen_vl.processor import QwenVLInputProcessor

    processor = QwenVLInputProcessor(str(ckpt), runner.hf_config, None, config)
    image = testing.random_image(56, 84, 0)
    ids, items = processor.process([5, 17, testing.START, testing.IMAGE, testing.END, 42],
                                   {"image": [image]})
    run_media_steps_without_sync(runner, "img", ids, items, split=5, seeds=(1, 2))
    assert getattr(runner.model_state, "encoder_runs", None) == 1  # one image, two chunks


def test_the_memory_profile_counts_the_vision_tower(ckpt: Path) -> None:
    """The KV cache is sized after a profile that ran the tower on the largest image a prompt
    may carry, and reserved the encoder cache's budget."""
    # (256: the Qwen3.5 checkpoint's max_position_embeddings, which bounds max_model_len)
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=256)
    facts = llm.engine.runner.startup.facts
    state = llm.engine.runner.model_state
    assert facts["encoder_peak_bytes"] > 0
    assert facts["encoder_kept_bytes"] == state.encoder_cache_bytes
    assert state.encoder_runs == 0  # the profile's image is not a cached one
