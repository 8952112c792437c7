"""GPU: Qwen2-VL, Qwen2.5-VL and Qwen3-VL with videos (``mrv2-plugin-qwen-vl``): fp32 tokens
with graphs and eager equal the CPU engine's (which equals HF,
``plugins/qwen_vl/tests/test_qwen_vl_video.py``) for a video, a video beside an image and an
odd frame count; bf16 graphs on/off agree; a step with a video split across it never
synchronizes with the host.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import run_media_steps_without_sync

pytestmark = pytest.mark.gpu
testing = pytest.importorskip("mrv2_qwen_vl.testing")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FAMILIES = {"qwen2-vl": "make_tiny_qwen2_vl", "qwen2.5-vl": "make_tiny_qwen_vl",
            "qwen3-vl": "make_tiny_qwen3_vl"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(getattr(testing, FAMILIES[request.param])(tmp_path_factory.mktemp("vl")))


def _frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3),
                                                dtype=np.uint8)


def _prompts() -> list[dict[str, Any]]:
    video = [testing.START, testing.VIDEO, testing.END]
    image = [testing.START, testing.IMAGE, testing.END]
    return [
        {"prompt_token_ids": [5, 17, *video, 42, 9],
         "multi_modal_data": {"video": _frames(4, 84, 84, 0)}},
        {"prompt_token_ids": [3, *video, 8, *image, 33],
         "multi_modal_data": {"video": [_frames(4, 56, 112, 1)],
                              "image": [testing.random_image(56, 84, 2)]}},
        {"prompt_token_ids": [7, *video, 5],
         "multi_modal_data": {"video": (_frames(3, 84, 56, 3), {"fps": 1.0})}},
    ]


def _run(ckpt: Path, device: str, dtype: str, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(ckpt), device=device, dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_video_equals_cpu_with_graphs(ckpt: Path) -> None:
    cpu = _run(ckpt, "cpu", "float32")
    assert _run(ckpt, "cuda", "float32") == cpu
    assert _run(ckpt, "cuda", "float32", enforce_eager=True) == cpu


def test_bf16_video_graphs_on_off_agree(ckpt: Path) -> None:
    graphs = _run(ckpt, "cuda", "bfloat16")
    eager = _run(ckpt, "cuda", "bfloat16", enforce_eager=True)
    for a, b in zip(graphs, eager, strict=True):
        assert a[:8] == b[:8]


def test_video_steps_never_synchronize(ckpt: Path) -> None:
    from transformers import AutoTokenizer

    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    from mrv2_qwen_vl.processor import QwenVLInputProcessor

    # (Qwen3-VL's timestamps between frame groups are text: its processor needs the tokenizer)
    processor = QwenVLInputProcessor(str(ckpt), runner.hf_config,
                                     AutoTokenizer.from_pretrained(str(ckpt)), config)
    ids, items = processor.process([5, 17, testing.START, testing.VIDEO, testing.END, 42],
                                   {"video": _frames(4, 84, 84, 4)})
    split = items[0].offset + 2  # (the first video item split across the two steps)
    run_media_steps_without_sync(runner, "vid", ids, items, split=split, seeds=(1, 2))
    # one encoder run an item (Qwen3-VL: an item a frame group), two chunks for the first
    assert getattr(runner.model_state, "encoder_runs", None) == len(items)
    runner.shutdown()
