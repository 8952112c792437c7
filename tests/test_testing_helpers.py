"""The test helpers that GPU tests lean on, checked on the CPU (a GPU test whose check cannot
fail would pass whatever the engine did)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mrv2.testing_engine import check_greedy_up_to_ties


def _reference(table: dict[int, torch.Tensor], vocab: int = 8
               ) -> Callable[[list[int]], torch.Tensor]:
    """A reference whose log-probabilities after position ``i`` are ``table[i]``."""
    def logprobs(ids: list[int]) -> torch.Tensor:
        out = torch.log_softmax(torch.randn(len(ids), vocab, generator=torch.Generator()
                                            .manual_seed(len(ids))), dim=-1)
        for i, row in table.items():
            out[i] = row
        return out
    return logprobs


def test_greedy_up_to_ties_takes_a_near_tie_and_refuses_a_wrong_token() -> None:
    prompt = [1, 2, 3]
    tie = torch.tensor([-0.70, -0.75, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0])
    sure = torch.tensor([-0.01, -5.0, -6.0, -7.0, -8.0, -9.0, -9.5, -9.9])
    ref = _reference({2: tie, 3: sure, 4: sure})
    # token 0 is a near tie (0.05 below the best), then the best twice
    assert check_greedy_up_to_ties([1, 0, 0], prompt, ref, tol=0.25) == pytest.approx(0.05)
    assert check_greedy_up_to_ties([0, 0, 0], prompt, ref, tol=0.25) == 0.0
    with pytest.raises(AssertionError, match=r"token 1 \(3\) is 6.990 below"):
        check_greedy_up_to_ties([0, 3, 0], prompt, ref, tol=0.25)
    with pytest.raises(AssertionError, match="more than 0.01"):
        check_greedy_up_to_ties([1, 0, 0], prompt, ref, tol=0.01)
    # a reference that scored a different sequence length is refused, not misread
    with pytest.raises(AssertionError):
        check_greedy_up_to_ties([0, 0], prompt, lambda ids: ref(ids + [0]), tol=0.25)
