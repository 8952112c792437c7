"""Logprob entries as vLLM builds them (``append_logprobs_for_next_position``)."""

from __future__ import annotations

from typing import cast

import pytest

import mrv2.engine.sampling_outputs as sampling_outputs
from mrv2.contract.params import SamplingParams
from mrv2.engine.sampling_outputs import (
    LogprobState,
    add_prompt_logprobs,
    add_sample_logprobs,
    bad_words_token_ids,
)
from mrv2.engine.tokenizer import Tokenizer


def test_a_sampled_token_in_the_top_k_takes_its_top_k_rank() -> None:
    """vLLM writes the sampled token first, then the top k with ranks 1..k: a sampled token
    that is among them ends with its top-k position as rank (at a tie that is not its count
    rank), and keeps its place first in the entry."""
    state = LogprobState()
    # Token 7 tied with 4 for the top: its count rank is 2, the top-k lists it first.
    add_sample_logprobs(state, 2, ([7, 7, 4], [-0.7, -0.7, -0.7], 2), None)
    # Token 4 tied with 7 at the top, listed second: rank 2 either way.
    add_sample_logprobs(state, 2, ([4, 7, 4], [-0.7, -0.7, -0.7], 2), None)
    # Not in the top k: its count rank.
    add_sample_logprobs(state, 1, ([9, 7], [-3.0, -0.7], 5), None)
    first, second, third = state.logprobs
    assert list(first) == [7, 4] and (first[7].rank, first[4].rank) == (1, 2)
    assert list(second) == [4, 7] and (second[4].rank, second[7].rank) == (2, 1)
    assert list(third) == [9, 7] and (third[9].rank, third[7].rank) == (5, 1)
    add_prompt_logprobs(state, 1, 1, [[3, 3, 8]], [[-1.0, -1.0, -1.0]], [2], None, 4)
    assert list(state.prompt[1]) == [3] and state.prompt[1][3].rank == 1


class _WordTokenizer:
    """A tokenizer of fixed encodings, for ``bad_words_token_ids``."""

    max_token_id = 20

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.table[text])


def _bad_words(words: list[str], table: dict[str, list[int]],
               vocab_size: int | None = None) -> list[list[int]]:
    params = SamplingParams(bad_words=words)
    tok = cast(Tokenizer, _WordTokenizer(table))
    return bad_words_token_ids(params, tok, vocab_size)


def test_bad_words_add_the_spaced_variant_only_as_vllm_does() -> None:
    """vLLM's ``update_from_tokenizer``: the word without its leading whitespace, and the
    space-prefixed variant only when it has as many tokens and another first token."""
    table = {"foo": [1, 2], " foo": [3],          # fewer tokens: not banned
             "bar": [5], " bar": [6],              # a word token of its own: banned
             "baz": [7, 8], " baz": [7, 9],        # the same first token: not banned
             "qux": [10, 11], " qux": [12, 11]}    # same length, another first token
    assert _bad_words(["foo", " bar", "baz", "qux"], table) == [
        [1, 2], [5], [6], [7, 8], [10, 11], [12, 11]]
    # the model's vocabulary (not the tokenizer's) still drops a variant past its logits
    assert _bad_words(["bar", "qux"], {**table, " bar": [16]}, vocab_size=15) == [
        [5], [10, 11], [12, 11]]


@pytest.mark.parametrize("table", [
    {"x": [], " x": [4]},              # no tokens
    {"x": [4], " x": []},
    {"x": [21], " x": [4]},            # past the tokenizer's max token id
    {"x": [4], " x": [21]},
])
def test_bad_words_that_tokenize_to_nothing_or_unknown_ids_are_refused(
        table: dict[str, list[int]]) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words"):
        _bad_words(["x"], table)


def test_bad_words_spaced_variant_left_out_is_not_checked() -> None:
    """vLLM checks only the variants it bans: a spaced variant of more tokens is ignored."""
    assert _bad_words(["x"], {"x": [4], " x": [21, 5]}) == [[4]]


def test_bad_words_keeps_the_newest_lists_and_never_a_refused_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """:class:`BadWords` tokenizes a word list once while it is among the
    ``BAD_WORDS_KEPT`` newest asked for; a refused list raises its error each time."""
    monkeypatch.setattr(sampling_outputs, "BAD_WORDS_KEPT", 2)
    table = {"a": [1], " a": [2], "b": [3], " b": [3], "c": [4], " c": [5, 6],
             "bad": [], " bad": [7]}
    tok = _WordTokenizer(table)
    asked: list[str] = []

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        asked.append(text)
        return list(table[text])

    monkeypatch.setattr(tok, "encode", encode)
    words = sampling_outputs.BadWords(cast(Tokenizer, tok), vocab_size=10)
    assert words.token_ids(SamplingParams()) == [] and asked == []
    for _ in range(2):
        assert words.token_ids(SamplingParams(bad_words=["a", "b"])) == [[1], [2], [3]]
    assert asked == ["a", " a", "b", " b"]  # (once)
    words.token_ids(SamplingParams(bad_words=["c"]))
    words.token_ids(SamplingParams(bad_words=["a", "b"]))  # (the newest again)
    words.token_ids(SamplingParams(bad_words=["b"]))  # ["c"] goes: two kept
    asked.clear()
    words.token_ids(SamplingParams(bad_words=["a", "b"]))
    words.token_ids(SamplingParams(bad_words=["c"]))
    assert asked == ["c", " c"]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"'bad' is no tokens"):
            words.token_ids(SamplingParams(bad_words=["bad"]))
