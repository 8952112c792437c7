"""Structured outputs under the reasoning parsers whose blocks are not ``<think>``: Magistral's
``[THINK]`` / ``[/THINK]`` (``mistral``: the model opens the block itself, whatever tags its
system prompt holds) and Seed-OSS's ``<seed:think>`` / ``</seed:think>`` (``seed_oss``:
DeepSeek-R1's convention), as :data:`mrv2.engine.structured_outputs.THINK_BLOCKS` says."""

from __future__ import annotations

import pytest
from test_structured_outputs import CHOICES, _think

from mrv2 import LLM
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

TAGS = ["[THINK]", "[/THINK]", "<seed:think>", "</seed:think>"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, dict[str, int]]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tags"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=TAGS)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, async_scheduling=True)
    tokenizer = llm.get_tokenizer()
    ids = {t: tokenizer.encode(t, add_special_tokens=False) for t in TAGS}
    assert all(len(i) == 1 for i in ids.values())
    return llm, {t: i[0] for t, i in ids.items()}


@pytest.mark.parametrize("seed", range(2))
def test_magistrals_first_token_may_open_the_block(llm: tuple[LLM, dict[str, int]],
                                                   seed: int) -> None:
    """``[THINK]`` first (biased +60; ``[/THINK]`` +100 is not allowed there), then the
    tokens are free until ``[/THINK]``, then a choice: also after a prompt whose system
    prompt wrote both tags (Magistral's), which would tell ``qwen3``'s convention that the
    block was closed. Without the mark neither tag is ever allowed."""
    model, ids = llm
    start, end = ids["[THINK]"], ids["[/THINK]"]
    bias = {start: 60.0, end: 100.0}
    for prompt in ([5, 6, 7], [5, start, 6, end, 7]):
        text, out = _think(model, prompt, "mistral", bias, seed)
        assert out[:2] == [start, end] and text in CHOICES, (prompt, out)
    text, out = _think(model, [5, 6, 7], None, bias, seed)
    assert start not in out and end not in out and text in CHOICES


def test_seed_oss_holds_after_its_own_end_tag(llm: tuple[LLM, dict[str, int]]) -> None:
    """A prompt that opened ``<seed:think>`` (or none: the answer opens in the block, as
    DeepSeek-R1's): free until ``</seed:think>``; one that closed it: held from the first
    token, so the biased end tag never comes."""
    model, ids = llm
    start, end = ids["<seed:think>"], ids["</seed:think>"]
    for prompt in ([5, 6, start], [5, 6]):
        text, out = _think(model, prompt, "seed_oss", {end: 100.0})
        assert out[0] == end and text in CHOICES, (prompt, out)
    text, out = _think(model, [5, start, end], "seed_oss", {end: 100.0})
    assert end not in out and text in CHOICES
