"""Top-k / top-p (nucleus) filtering of logits without sorting the vocabulary.

Semantics (:func:`top_k_top_p_ref` is the specification), per row of ``logits [B, V]``:

1. Top-k, ``k = top_k[b]`` (``k <= 0`` or ``k >= V``: disabled): keep the tokens whose value is
   ``>=`` the k-th largest value, so every token tied with the k-th one is kept.
2. Top-p, ``p = top_p[b]`` (``p >= 1``: disabled): with ``q`` the softmax over the tokens kept
   by step 1, a kept token ``v`` stays iff the probability of the tokens *strictly greater*
   than it is ``< p``. This is the sort-based rule "drop a token when the probability mass
   before it in descending order (exclusive cumsum) is ``>= p``", except at ties: a tie group
   straddling the boundary is kept whole (the sort would keep the members it happened to put
   first), like ties at the k-th value. The most likely token always stays (for ``p > 0``);
   ``p <= 0`` drops everything.
3. The result is a new float32 tensor with the dropped tokens set to ``-inf``.

``-inf`` logits stay ``-inf``; logits must not hold NaN or ``+inf``. Probability sums taken in
another order than torch's ``cumsum`` may flip a token whose mass-before lies within float
rounding (~1e-6) of ``p``.

The kernel (:func:`top_k_top_p_triton`) finds each row's threshold ``T`` exactly and keeps
``x >= T``. Values are compared through an order-preserving int32 key of the fp32 bits
(``-0.0`` and ``+0.0`` share a key). Six launches, five of them over ``(row, chunk)``
programs of a fixed vocab chunk (so results do not depend on the batch):

1. stats: row max ``m``, finite minimum, number of finite values, ``Z = sum exp(x - m)``;
2. pivots: at 16 pivot keys (denser near ``m``) the count and the mass ``sum exp(x - m)`` of
   the values above each pivot, which bracket the threshold: ``lo < T``, and for top-p
   without top-k also ``T <= hi`` (top-k's values above ``lo`` all stay candidates: its
   top-p cut may lie anywhere among them);
3. refine, top-p rows without top-k whose bracket holds more than ``cap`` values (flat rows,
   where the cut lies in the bulk and the first pivots are sparse): the same counts at 16
   pivots spread evenly over the bracket, which narrow it;
4. compaction: every value in the bracket is copied, in row order, to a scratch row;
5. resolve, one program per row: when at most ``cap`` candidates remain (the usual case) they
   are sorted in registers (a sort of ``small_cap`` slots when they fit: top-k's usual case)
   and top-k then top-p are applied exactly to the sorted list (the mass above ``hi`` added);
   otherwise (huge ``k``, mass ties) a key-space bisection with 16 pivots per pass over the
   candidates narrows the key range until it holds one key (at most ~8 passes per stage);
6. write: ``out = where(x >= T, x, -inf)``.

So the logits are read four times (five for a refined row) and written once; rows without
top-k / top-p are only copied. Top-k needs the k-th value and its mass ``Z_k`` before top-p
can be decided, so for rows with both the compaction bound comes from top-k.
"""

from __future__ import annotations

import math

import torch

from ._backend import cdiv, default_block, next_power_of_2, use_triton
from .top_k_top_p_kernels import (
    _compact_kernel,
    _pivot_kernel,
    _refine_kernel,
    _resolve_kernel,
    _stats_kernel,
    _write_kernel,
    order_key,
)
from .top_k_top_p_ref import (
    check_filter_args,
    check_temperature,
    order_keys,
    scaled,
    top_k_top_p_keys_ref,
    top_k_top_p_ref,
)

__all__ = [
    "order_key",
    "order_keys",
    "top_k_top_p",
    "top_k_top_p_keys",
    "top_k_top_p_keys_ref",
    "top_k_top_p_ref",
    "top_k_top_p_triton",
]

# --------------------------------------------------------------------------- host side


def _output(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if out.shape != logits.shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 of shape {tuple(logits.shape)}")
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError("out must have contiguous rows")
    if out.data_ptr() == logits.data_ptr() and (
        out.dtype != logits.dtype or out.stride() != logits.stride()
    ):
        raise ValueError("out may alias logits only as the very same float32 tensor")
    return out


def _thresholds(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    temperature: torch.Tensor | None, block_v: int | None, chunk: int | None,
    cap: int | None, small_cap: int | None, pivot_block: int | None,
) -> tuple[torch.Tensor, int, int]:
    """Launches 1-5 of the module docstring: each row's threshold key, the write's tiles."""
    n, vocab = logits.shape
    block = default_block(logits, cuda=1024, cpu=64, block=block_v)
    chunk = max(default_block(logits, cuda=8192, cpu=256, block=chunk), block)
    cap = default_block(logits, cuda=4096, cpu=128, block=cap)
    small_cap = min(default_block(logits, cuda=512, cpu=32, block=small_cap), cap)
    pivot_block = min(default_block(logits, cuda=256, cpu=32, block=pivot_block), chunk)
    nb = 16
    nch = cdiv(vocab, chunk)
    nch_p2 = next_power_of_2(nch)
    dev = logits.device
    stats = torch.empty((n, nch, 4), dtype=torch.float32, device=dev)
    cnt = torch.empty((n, nch, nb), dtype=torch.int32, device=dev)
    mass = torch.empty((n, nch, nb), dtype=torch.float32, device=dev)
    cand = torch.empty((n, vocab), dtype=torch.float32, device=dev)
    piv1 = torch.empty((n, nb), dtype=torch.int32, device=dev)
    piv2 = torch.empty_like(piv1)
    cnt2 = torch.empty_like(cnt)
    mass2 = torch.empty_like(mass)
    flag = torch.empty(n, dtype=torch.int32, device=dev)
    bound = torch.empty((n, 3), dtype=torch.int64, device=dev)
    base = torch.empty(n, dtype=torch.float32, device=dev)
    thr = torch.empty(n, dtype=torch.int64, device=dev)
    ln_v = math.log(vocab)
    grid = (n, nch)
    wide = 8 if logits.is_cuda else 4
    xs = logits.stride(0)
    t = temperature if temperature is not None else top_p  # (unread without TEMP)
    temp = temperature is not None
    _stats_kernel[grid](logits, xs, t, vocab, top_k, top_p, stats, nch, CHUNK=chunk,
                        BLOCK=block, TEMP=temp)
    _pivot_kernel[grid](logits, xs, t, vocab, top_k, top_p, stats, cnt, mass, piv1, nch, ln_v,
                        CHUNK=chunk, BLOCK=pivot_block, NB=nb, NCH_P2=nch_p2, TEMP=temp,
                        num_warps=wide)
    _refine_kernel[grid](logits, xs, t, vocab, top_k, top_p, stats, cnt, mass, piv1, cnt2,
                         mass2, piv2, flag, nch, CAP=cap, CHUNK=chunk, BLOCK=pivot_block, NB=nb,
                         NCH_P2=nch_p2, TEMP=temp, num_warps=wide)
    _compact_kernel[grid](logits, xs, t, vocab, top_k, top_p, stats, cnt, mass, piv1, cnt2,
                          mass2, piv2, flag, cand, cand.stride(0), bound, base, nch, CHUNK=chunk,
                          BLOCK=block, NB=nb, NCH_P2=nch_p2, TEMP=temp)
    _resolve_kernel[(n,)](cand, cand.stride(0), vocab, top_k, top_p, stats, bound, base, thr,
                          nch, CAP=cap, SMALL_CAP=small_cap, NB=nb, BLOCK=block,
                          NCH_P2=nch_p2, num_warps=wide)
    return thr, block, chunk


def top_k_top_p_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    temperature: torch.Tensor | None = None,
    block_v: int | None = None,
    chunk: int | None = None,
    cap: int | None = None,
    small_cap: int | None = None,
    pivot_block: int | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`top_k_top_p` (see the module docstring).

    ``block_v`` is the tile of every vocab loop but the pivot passes' (``pivot_block``: they
    keep ``pivot_block x 16`` accumulators), ``chunk`` the vocab slice of one program in the
    full-row passes (a fixed size, so the arithmetic never depends on the batch), ``cap`` the
    most candidates resolved by an in-register sort (more: refinement, then bisection),
    ``small_cap`` (at most ``cap``) the size of a smaller sort for rows with that few. All
    powers of two; the result does not depend on them except through float summation order.
    """
    check_filter_args(logits, top_k, top_p)
    check_temperature(logits, temperature)
    out = _output(logits, out)
    n, vocab = logits.shape
    if n == 0:
        return out
    thr, block, chunk = _thresholds(logits, top_k, top_p, temperature, block_v, chunk, cap,
                                    small_cap, pivot_block)
    t = temperature if temperature is not None else top_p
    _write_kernel[(n, cdiv(vocab, chunk))](
        logits, logits.stride(0), t, out, out.stride(0), vocab, thr, CHUNK=chunk, BLOCK=block,
        IN_PLACE=out.data_ptr() == logits.data_ptr(), TEMP=temperature is not None)
    return out


def top_k_top_p_keys(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    temperature: torch.Tensor | None = None,
    **tiles: int,
) -> torch.Tensor:
    """Each row's top-k / top-p threshold as an int64 order key (:func:`order_keys`): the row
    keeps the values whose key is at least its threshold (``-2**31``: a row without a filter;
    ``2**31``: a row that keeps nothing). Takes :func:`top_k_top_p`'s arguments, with the
    logits divided by ``temperature`` (``[B]`` float32, IEEE division) first when given, and
    writes nothing: :func:`mrv2_kernels.gumbel.gumbel_sample` applies the keys while it
    samples, which saves the filtered copy's write and read. ``tiles``: the Triton path's
    tile sizes (:func:`top_k_top_p_triton`'s keywords); without Triton,
    :func:`top_k_top_p_keys_ref`."""
    check_filter_args(logits, top_k, top_p)
    check_temperature(logits, temperature)
    if not use_triton(logits):
        return top_k_top_p_keys_ref(logits, top_k, top_p, temperature)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    return _thresholds(logits, top_k, top_p, temperature, tiles.get("block_v"),
                       tiles.get("chunk"), tiles.get("cap"), tiles.get("small_cap"),
                       tiles.get("pivot_block"))[0]


def top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    out: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k / top-p filter each row of ``logits``; return the float32 result.

    Args:
        logits: ``[B, V]`` float32 (bf16 / fp16 are read as float32), rows contiguous.
        top_k: ``[B]`` int32 / int64; ``<= 0`` or ``>= V`` disables top-k for the row.
        top_p: ``[B]`` float32; ``>= 1`` disables top-p for the row.
        out: optional float32 ``[B, V]`` output; ``out=logits`` filters in place. Without it
            a new tensor is returned and ``logits`` is left untouched.
        temperature: optional ``[B]`` float32: the rows are divided by it first (IEEE
            division, the bits of ``logits.float() / temperature[:, None]``) and the result
            holds the divided values: no separate temperature pass.

    See the module docstring for the exact rule (ties at either cut are kept whole). Runs
    :func:`top_k_top_p_triton` when :func:`use_triton` says so, else :func:`top_k_top_p_ref`.
    """
    if use_triton(logits):
        return top_k_top_p_triton(logits, top_k, top_p, out, temperature=temperature)
    check_temperature(logits, temperature)
    result = top_k_top_p_ref(scaled(logits, temperature), top_k, top_p)
    if out is None:
        return result
    _output(logits, out)
    return out.copy_(result)
