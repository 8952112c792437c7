"""Families whose configs set a sliding window get it as HF applies it (``sliding_window_of``):
Mistral on every layer, Qwen2 with ``use_sliding_window`` on the layers past
``max_window_layers``; greedy tokens through the engine (prompts and outputs past the window,
chunked prefill) are HF's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

CASES: dict[str, tuple[str, dict[str, Any], list[int | None]]] = {
    "mistral": ("MistralForCausalLM", {"sliding_window": 5}, [5, 5]),
    "qwen2": ("Qwen2ForCausalLM", {"sliding_window": 6, "use_sliding_window": True,
                                   "max_window_layers": 1}, [None, 6]),
    "mistral-no-window": ("MistralForCausalLM", {"sliding_window": None}, [None, None]),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf(case: str, tmp_path: Path) -> None:
    arch, overrides, windows = CASES[case]
    path = make_tiny_checkpoint(tmp_path / "m", arch, std=0.15, **overrides)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
