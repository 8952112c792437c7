"""Thousands of seeded draws (one per position) follow the exact post-filter distribution."""

from __future__ import annotations

import math

import pytest
import torch
from sample_helpers import make_batch

from mrv2.contract.params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.5, -1.5])
DRAWS = 6000


def _exact(temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target distribution, stated directly: temperature, then min-p, then top-k (ties at
    the k-th value kept), then top-p over the renormalized top-k survivors (a token stays when
    the mass of the tokens strictly more likely than it is below ``top_p``)."""
    p = torch.softmax(LOGITS.double() / temperature, -1)
    p = torch.where(p >= p.max() * min_p, p, 0.0)
    if top_k > 0:
        kth = p.sort(descending=True).values[min(top_k, len(p)) - 1]
        p = torch.where(p >= kth, p, 0.0)
    q = p / p.sum()
    if top_p < 1.0:
        above = torch.stack([q[q > v].sum() for v in q])
        q = torch.where((q > 0) & (above < top_p), q, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
     (1.0, 0, 1.0, 0.3), (0.9, 6, 0.9, 0.1)],
)
def test_draws_match_exact_probabilities(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch, table, sampler = make_batch([params] * DRAWS, [([1], [])] * DRAWS, len(LOGITS),
                              seeds=[1234] * DRAWS, positions=list(range(DRAWS)))
    tokens = sampler(LOGITS.repeat(DRAWS, 1), batch, table).tokens
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    expected = _exact(temperature, top_k, top_p, min_p) * DRAWS
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    # 99.9% quantile of chi-square (Wilson-Hilferty); fixed seed, so the test is not flaky.
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof else 0.0
    assert chi2 < bound, (chi2, bound, counts.tolist(), expected.tolist())


def test_chi_square_detects_a_wrong_temperature() -> None:
    params = SamplingParams(temperature=1.0)
    batch, table, sampler = make_batch([params] * DRAWS, [([1], [])] * DRAWS, len(LOGITS),
                              seeds=[99] * DRAWS, positions=list(range(DRAWS)))
    tokens = sampler(LOGITS.repeat(DRAWS, 1), batch, table).tokens
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    wrong = _exact(0.8, 0, 1.0, 0.0) * DRAWS
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 30
