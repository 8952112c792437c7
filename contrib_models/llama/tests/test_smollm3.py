"""SmolLM3ForCausalLM against HF transformers: greedy tokens through the engine with its NoPE
layers (every fourth here), as SmolLM3-3B ships (no window) and with ``use_sliding_window``
on alternate layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CASES: dict[str, tuple[dict[str, Any], list[int | None]]] = {
    # SmolLM3-3B's own config: no window, every layer full
    "nope": ({"sliding_window": None, "use_sliding_window": False,
              "layer_types": ["full_attention"] * 4}, [None] * 4),
    "nope-window": ({"sliding_window": 5, "use_sliding_window": True, "layer_types": LAYERS},
                    [5, None, 5, None]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf(case: str, tmp_path: Path) -> None:
    overrides, windows = CASES[case]
    path = make_tiny_checkpoint(tmp_path / "m", "SmolLM3ForCausalLM", std=0.15,
                                num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                                pad_token_id=0, **overrides)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    assert [layer.self_attn.rotary_emb is None for layer in layers] == [False] * 3 + [True]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
