"""GPU: Gemma 4 with audio (``Gemma4ForConditionalGeneration`` with an ``audio_config``: the
conformer tower and the audio embedder in plain torch on the device, each clip's soft tokens
between ``<boa>`` and ``<eoa>``) through the engine with CUDA graphs and the Triton kernels:
fp32 greedy tokens are HF's with graphs on and off (HF fed its own feature extractor's
``input_features`` / ``input_features_mask``; two clips in a prompt, one longer than a step's
budget and the sliding window, one shared between requests, a clip at 22.05 kHz resampled
beside an image, a text prompt), a second round runs no encoder, every position of the
two-clip prompt has HF's log-probability; bf16 graphs on and off agree and start with HF's
tokens; a step with a clip split across it never synchronizes.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import random_image, run_media_steps_without_sync
from mrv2.testing_engine import check_bf16_graphs_against_eager
from mrv2_gemma.audio_inputs import resample
from mrv2_gemma.gemma4_inputs import Gemma4InputProcessor
from mrv2_gemma.testing import (
    AUDIO_RATE,
    TinyGemma4Audio,
    audio_noise,
    check_audio_against_hf,
)

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24
#: The CPU tests' model made wider (as ``test_gpu_gemma4.py``'s: hidden 128, head sizes 32 and
#: 64, a window of 24, soft-capped logits) and its audio tower too; the LM head untied (with
#: the embedding as the head, this model's greedy tokens repeat the prompt's last token).
TEXT: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
                        "global_head_dim": 64, "sliding_window": 24,
                        "hidden_size_per_layer_input": 16, "final_logit_softcapping": 30.0}
AUDIO: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
Prompt = tuple[list[int], dict[str, Any], list[np.ndarray]]


def _checkpoint(path: Path) -> TinyGemma4Audio:
    return TinyGemma4Audio(path, text=TEXT, audio=AUDIO, tied=False)


def _prompts(tiny: TinyGemma4Audio) -> list[Prompt]:
    """``(prompt ids, multi_modal_data, the clips at 16 kHz for HF)``: clip ``b`` (3.3 s: 83
    soft tokens) is longer than a step's 64 tokens. Each prompt's first token leads by more
    than 0.4 in fp32 and in bf16 (the CPU engine's): graphs on and off must agree on it."""
    a, b = audio_noise(0.23, 1), audio_noise(3.3, 2)
    slow = audio_noise(0.3, 3, rate=22050)
    au, im = tiny.audio, tiny.image
    return [([5, 17, au, 42, 33], {"audio": (a, AUDIO_RATE)}, [a]),
            ([au, 64, 8, au, 50, 45], {"audio": [(b, AUDIO_RATE), (a, AUDIO_RATE)]}, [b, a]),
            ([im, 33, au, 13], {"image": [random_image(32, 32, seed=4)],
                                "audio": [(slow, 22050)]}, [resample(slow, 22050, AUDIO_RATE)]),
            ([1 + (i + 45) % 200 for i in range(97)], {}, [])]


def _engine(path: Path, dtype: str, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cuda", dtype=dtype, block_size=16, gpu_memory_utilization=0.3,
               max_num_batched_tokens=64, limit_mm_per_prompt=2, **kwargs)


def _tokens(llm: LLM, prompts: list[Prompt]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": d} for p, d, _ in prompts],
                        params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _generate(path: Path, dtype: str, prompts: list[Prompt], **kwargs: Any
              ) -> list[list[int]]:
    llm = _engine(path, dtype, **kwargs)
    tokens = _tokens(llm, prompts)
    llm.shutdown()
    return tokens


def test_gemma4_audio_with_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 against HF's on the CPU: cuDNN runs the audio tower's convolutions in TF32 unless
    # told not to (torch's default), 2e-3 apart in log-probability (the first GPU run)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    tiny = _checkpoint(tmp_path)
    prompts = _prompts(tiny)
    expected: list[list[int]] = []
    for no_graphs in (False, True):
        llm = _engine(tmp_path, "float32", enforce_eager=no_graphs)
        # (encoder runs: clips a, b, the resampled one and the image)
        expanded = check_audio_against_hf(llm, tiny, prompts, encoder_runs=4, logprobs_of=1,
                                          max_tokens=NEW_TOKENS, atol=2e-3)
        expected = expected or _tokens(llm, prompts)  # (HF's: checked just above)
        llm.shutdown()
    assert max(item.length for item in expanded[1][1]) > 64  # (b: split across steps)
    graphs = _generate(tmp_path, "bfloat16", prompts)
    eager = _generate(tmp_path, "bfloat16", prompts, enforce_eager=True)
    # bf16: graphs and eager round differently (near ties part after the first tokens)
    check_bf16_graphs_against_eager(graphs, eager, expected)


def test_gemma4_audio_steps_never_synchronize(tmp_path: Path) -> None:
    """A clip split across two steps beside a text request, then decode steps (graphs): no
    step reads the device from the host; the audio encoder runs once."""
    tiny = _checkpoint(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      block_size=16, gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    processor = Gemma4InputProcessor(str(tmp_path), runner.hf_config, None, config)
    ids, items = processor.process([5, tiny.audio, 9],
                                   {"audio": (audio_noise(3.3, 2), AUDIO_RATE)})
    assert items[0].offset < 40 < items[0].offset + items[0].length
    run_media_steps_without_sync(runner, "clip", ids, items, split=40)
    assert runner.model_state.encoder_runs == 1
    runner.shutdown()
