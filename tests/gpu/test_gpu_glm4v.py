"""GPU: GLM-4.1V and GLM-4.5V (``mrv2-plugin-glm``) with images: fp32 tokens equal the CPU
engine's (which equals HF, ``plugins/glm/tests/test_glm4v.py``) with graphs on and off, bf16
graphs on/off agree, neither text-only nor image steps synchronize with the host, and the
memory profile runs the vision tower.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import random_image, run_media_steps_without_sync

pytestmark = pytest.mark.gpu
testing = pytest.importorskip("mrv2_glm.testing_glm4v")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["glm4v", "glm4v_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(testing.make_tiny_glm4v(tmp_path_factory.mktemp(request.param),
                                        moe=request.param == "glm4v_moe"))


def _marks() -> list[int]:
    return [testing.BEGIN_IMAGE, testing.IMAGE, testing.END_IMAGE]


def _prompts() -> list[dict[str, Any]]:
    images = [random_image(56, 84, 0), random_image(112, 56, 1)]
    return [
        {"prompt_token_ids": [5, 17, *_marks(), 42, 9],
         "multi_modal_data": {"image": images[:1]}},
        {"prompt_token_ids": [3, *_marks(), 8, 8, *_marks(), 33],
         "multi_modal_data": {"image": images}},
        {"prompt_token_ids": [5, 17, 42, 9, 100, 3, 77]},
    ]


def _run(ckpt: Path, device: str, dtype: str, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(ckpt), device=device, dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
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
    from mrv2_glm.glm4v_inputs import Glm4vInputProcessor

    processor = Glm4vInputProcessor(str(ckpt), runner.hf_config, None, config)
    ids, items = processor.process([5, 17, *_marks(), 42], {"image": [random_image(56, 84, 0)]})
    run_media_steps_without_sync(runner, "img", ids, items, split=5, seeds=(1, 2))
    assert getattr(runner.model_state, "encoder_runs", None) == 1  # one image, two chunks


def test_the_memory_profile_counts_the_vision_tower(ckpt: Path) -> None:
    """The KV cache is sized after a profile that ran the tower on the largest image a prompt
    may carry, and reserved the encoder cache's budget."""
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=512)
    facts = llm.engine.runner.startup.facts
    state = llm.engine.runner.model_state
    assert facts["encoder_peak_bytes"] > 0
    assert facts["encoder_kept_bytes"] == state.encoder_cache_bytes
    assert state.encoder_runs == 0  # the profile's image is not a cached one
