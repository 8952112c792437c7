"""A context longer than ``max_position_embeddings`` through RoPE scaling, as vLLM allows it
(``--hf-overrides '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}}' --max-model-len 131072``, Qwen's recipe): the
limit is derived from the scaling, and positions past ``max_position_embeddings`` rotate as
HF transformers' (which has no table) rotates them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint, prefill_logits

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}
#: ``(rope_parameters, the derived limit)``, max_position_embeddings 64 each.
CASES = {"yarn": (YARN, 256), "linear": (LINEAR, 128), "none": (PLAIN, 64)}
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(100)]  # positions well past 64
NEW_TOKENS = 6


_MADE: dict[str, Path] = {}


def _checkpoint(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, int]:
    """The tiny Qwen3 of case ``name`` (made once), and its derived limit."""
    params, limit = CASES[name]
    if name not in _MADE:
        _MADE[name] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), "Qwen3ForCausalLM",
                                           std=0.15, max_position_embeddings=64,
                                           rope_parameters=params)
    return name, _MADE[name], limit


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Path, int]:
    return _checkpoint(request.param, tmp_path_factory)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=8,
               **kwargs)


def test_max_model_len_up_to_the_derived_limit(case: tuple[str, Path, int]) -> None:
    """The default is the derived limit; one past it is refused, naming the limit and (with
    scaling) why; without scaling ``max_position_embeddings`` stays the limit."""
    name, path, limit = case
    assert _llm(path).engine.runner.max_model_len == limit
    assert _llm(path, max_model_len=limit).engine.runner.max_model_len == limit
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} exceeds") as info:
        _llm(path, max_model_len=limit + 1)
    assert "max_position_embeddings=64" in str(info.value)
    if name != "none":
        assert f"the limit {limit} its rope scaling derives" in str(info.value)
        assert f"rope_type {CASES[name][0]['rope_type']!r}" in str(info.value)


@pytest.mark.parametrize("name", ["yarn", "linear"])  # (unscaled: the limit is 64)
def test_positions_past_max_position_embeddings_match_hf(
        name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Greedy tokens and prefill logits of a 100-token prompt (positions up to ~106) equal
    HF's, whose RoPE has no table to run out of."""
    import transformers

    _, path, limit = _checkpoint(name, tmp_path_factory)
    llm = _llm(path, max_model_len=limit)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert out == hf_greedy(path, PROMPT, NEW_TOKENS)
    got = prefill_logits(llm.engine.runner, [PROMPT])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=1e-4)
