"""Per-row log-softmax statistics without materializing a ``[B, V]`` logprob tensor.

For each row ``b`` of ``logits`` and a chosen token ``t = tokens[b]``:

- ``lse[b] = logsumexp_v logits[b, v]`` (so ``logprob(v) = logits[b, v] - lse[b]``),
- ``rank[b] = #{v : logits[b, v] >= logits[b, t]}`` (vLLM's rank, its
  ``batched_count_greater_than``: 1 is the most likely; a token tied with others ranks after
  all of them).

The caller gathers the few logits it needs (top-k ids, the sampled id) and subtracts ``lse``.
"""

import torch
import triton
import triton.language as tl

from ._backend import default_block, use_triton

__all__ = ["logprob_stats", "logprob_stats_ref", "logprob_stats_triton"]


def logprob_stats_ref(
    logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`logprob_stats`."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    chosen = x.gather(1, tokens.long()[:, None])
    rank = (x >= chosen).sum(dim=-1)
    return lse, rank.to(torch.int64)


@triton.jit
def _logprob_stats_kernel(
    logits_ptr: tl.tensor,
    logits_stride: int,
    vocab_size: int,
    tokens_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    rank_ptr: tl.tensor,
    BLOCK_V: tl.constexpr,
) -> None:
    # One program per row: an online logsumexp and a count of logits >= the chosen one.
    b = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + b * logits_stride
    chosen = tl.load(row_ptr + tl.load(tokens_ptr + b).to(tl.int64)).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    above = tl.full([], 0, tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + offs
        valid = v < vocab_size
        x = tl.load(row_ptr + v, mask=valid, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)
        m = new_m
        above += tl.sum((valid & (x >= chosen)).to(tl.int64), axis=0)
    tl.store(lse_ptr + b, m + tl.log(s))
    tl.store(rank_ptr + b, above)


def logprob_stats_triton(
    logits: torch.Tensor, tokens: torch.Tensor, block_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`logprob_stats`: one program per row."""
    _check(logits, tokens)
    n, vocab = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    rank = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return lse, rank
    block = default_block(logits, cuda=2048, cpu=128, block=block_v)
    _logprob_stats_kernel[(n,)](logits, logits.stride(0), vocab, tokens, lse, rank,
                                BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
    return lse, rank


def _check(logits: torch.Tensor, tokens: torch.Tensor) -> None:
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError("logits must be 2-D with contiguous rows")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column")
    if tokens.shape != (logits.shape[0],):
        raise ValueError(f"tokens must have shape ({logits.shape[0]},)")


def logprob_stats(
    logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse [B] float32, rank [B] int64)`` of ``[B, V]`` logits and ``[B]`` chosen tokens.

    See the module docstring; runs the Triton kernel when :func:`use_triton` says so.
    """
    if use_triton(logits):
        return logprob_stats_triton(logits, tokens)
    _check(logits, tokens)
    return logprob_stats_ref(logits, tokens)
