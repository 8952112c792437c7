"""Logprob entries as vLLM builds them (``append_logprobs_for_next_position``)."""

from __future__ import annotations

from mrv2.engine.sampling_outputs import LogprobState, add_prompt_logprobs, add_sample_logprobs


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
