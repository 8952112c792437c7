"""Penalty and logprob kernels: Triton (interpreter) vs the torch reference vs direct torch."""

from __future__ import annotations

import pytest
import torch

from mrv2_kernels.logprobs import logprob_stats, logprob_stats_ref, logprob_stats_triton
from mrv2_kernels.penalties import apply_penalties, apply_penalties_ref, apply_penalties_triton


def _penalty_inputs(seed: int, n: int = 5, rows: int = 7, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    idx = torch.randperm(rows, generator=g)[:n].to(torch.int32)
    counts = (torch.rand(rows, vocab, generator=g) < 0.1).int() * torch.randint(
        1, 4, (rows, vocab), generator=g, dtype=torch.int32)
    mask = torch.rand(rows, vocab, generator=g) < 0.1
    rep = torch.rand(rows, generator=g) * 1.5 + 0.5
    freq = torch.rand(rows, generator=g) * 2 - 1
    pres = torch.rand(rows, generator=g) * 2 - 1
    return logits, idx, counts, mask, rep, freq, pres


def _direct(logits, idx, counts, mask, rep, freq, pres) -> torch.Tensor:
    """Loop-per-element statement of vLLM's penalties."""
    out = logits.clone()
    for b in range(logits.shape[0]):
        r = int(idx[b])
        for v in range(logits.shape[1]):
            x, c = float(out[b, v]), int(counts[r, v])
            if c > 0 or bool(mask[r, v]):
                x = x / float(rep[r]) if x > 0 else x * float(rep[r])
            x -= float(freq[r]) * c
            if c > 0:
                x -= float(pres[r])
            out[b, v] = x
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_penalties_ref_matches_direct(seed: int) -> None:
    logits, *rest = _penalty_inputs(seed, n=3, vocab=50)
    expected = _direct(logits, *rest)
    apply_penalties_ref(logits, *rest)
    torch.testing.assert_close(logits, expected)
    assert not torch.equal(expected, _penalty_inputs(seed, n=3, vocab=50)[0])


@pytest.mark.parametrize(("seed", "block"), [(0, 32), (1, 128), (2, 64)])
def test_penalties_triton_matches_ref(seed: int, block: int) -> None:
    logits, *rest = _penalty_inputs(seed)
    expected = logits.clone()
    apply_penalties_ref(expected, *rest)
    apply_penalties_triton(logits, *rest, block_v=block)
    torch.testing.assert_close(logits, expected)


def test_penalties_dispatch_and_checks() -> None:
    logits, *rest = _penalty_inputs(3)
    expected = logits.clone()
    apply_penalties_ref(expected, *rest)
    apply_penalties(logits, *rest)
    torch.testing.assert_close(logits, expected)
    with pytest.raises(ValueError, match="float32"):
        apply_penalties(logits.half(), *rest)


@pytest.mark.parametrize(("dtype", "block"), [(torch.float32, 32), (torch.bfloat16, 128)])
def test_logprob_stats(dtype: torch.dtype, block: int) -> None:
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 333, generator=g) * 4).to(dtype)
    logits[2, 10:] = float("-inf")  # a mostly-masked row
    tokens = torch.randint(0, 333, (6,), generator=g)
    tokens[2] = 3
    lse_r, rank_r = logprob_stats_ref(logits, tokens)
    lse_t, rank_t = logprob_stats_triton(logits, tokens, block_v=block)
    torch.testing.assert_close(lse_t, lse_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(rank_t, rank_r)
    full = torch.log_softmax(logits.float(), dim=-1)
    chosen = full.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logits.float().gather(1, tokens[:, None]).squeeze(1) - lse_t,
                               chosen, rtol=1e-5, atol=1e-5)
    expected_rank = (full >= chosen[:, None]).sum(-1)
    assert torch.equal(rank_t, expected_rank)
    lse_d, rank_d = logprob_stats(logits, tokens)
    torch.testing.assert_close(lse_d, lse_r)


@pytest.mark.parametrize("block", [4, 128])
def test_logprob_stats_rank_at_ties_counts_the_ties(block: int) -> None:
    """vLLM's rank is the number of entries whose logprob is >= the chosen one's
    (``batched_count_greater_than``): a token tied with others ranks after all of them
    (ties are common in bf16 logits)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 1.0, 0.5]])
    for token, want in ((1, 3), (3, 3), (2, 5), (6, 5), (5, 8), (7, 6)):
        tokens = torch.tensor([token])
        for rank in (logprob_stats_ref(logits, tokens)[1],
                     logprob_stats_triton(logits, tokens, block_v=block)[1]):
            assert rank.tolist() == [want]
