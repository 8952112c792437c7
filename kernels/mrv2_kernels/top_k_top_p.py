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
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, use_triton
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

_KEEP_ALL = tl.constexpr(-(2**31))  # threshold key below every key: keep the whole row
_DROP_ALL = tl.constexpr(2**31)  # threshold key above every key: drop the whole row
# Top-p keeps only values above m - ln(V) - 17 (the rest weighs < 2**-24 of the row's mass),
# so its first pivots are spread over that window. Placement only: correctness never uses it.
_P_WINDOW = tl.constexpr(17.0)


# --------------------------------------------------------------------------- Triton helpers


@triton.jit
def _skey(x: tl.tensor) -> tl.tensor:
    # int32 key with the order of the fp32 values (signed compare); -0.0 maps to +0.0's key.
    b = x.to(tl.int32, bitcast=True)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(x == 0.0, 0, key)


#: The Triton helper behind :func:`order_keys` (for kernels that apply the thresholds).
order_key = _skey


@triton.jit
def _load_scaled(
    x_ptr: tl.tensor, v: tl.tensor, end: tl.tensor, t_ptr: tl.tensor, row: tl.tensor,
    TEMP: tl.constexpr,
) -> tl.tensor:
    # One tile of a row as fp32, divided by the row's temperature with TEMP (IEEE division:
    # the bits of ``logits.float() / t``, as mrv2_kernels.gumbel.divide_rows gives).
    x = tl.load(x_ptr + v, mask=v < end, other=float("-inf")).to(tl.float32)
    if TEMP:
        x = tl.div_rn(x, tl.load(t_ptr + row))
    return x


@triton.jit
def _key_value(key: tl.tensor) -> tl.tensor:
    # The fp32 value whose _skey is ``key`` (int32; +0.0 for key 0).
    b = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _narrow(
    cnt_ptr: tl.tensor, mass_ptr: tl.tensor, piv_ptr: tl.tensor, row: tl.tensor, nch: int,
    k: tl.tensor, p: tl.tensor, z: tl.tensor, nfin: tl.tensor, kact: tl.tensor, lo: tl.tensor,
    hi: tl.tensor, mass_hi: tl.tensor, c_lo: tl.tensor, c_hi: tl.tensor, NB: tl.constexpr,
    NCH_P2: tl.constexpr,
) -> tuple[tl.tensor, ...]:
    # Narrow the bracket (lo, hi] holding the threshold key with the (row, chunk) counts and
    # masses above the row's NB pivots: lo rises to the highest pivot the threshold lies above,
    # hi (top-p without top-k only: top-k resolves over every value above lo) falls to the
    # lowest pivot it does not. Only moves inward, so pivots placed from another kernel's
    # float sums can cost candidates, never correctness. Also returns the mass above hi and
    # each chunk's counts above lo and above hi (c_lo, c_hi).
    j = tl.arange(0, NB)
    piv = tl.load(piv_ptr + row * NB + j)
    cc = tl.arange(0, NCH_P2)
    offs = (row * nch + cc[:, None]) * NB + j[None, :]
    cm = (cc < nch)[:, None]
    cnt = tl.load(cnt_ptr + offs, mask=cm, other=0)
    tot_cnt = tl.sum(cnt, axis=0)
    tot_mass = tl.sum(tl.load(mass_ptr + offs, mask=cm, other=0.0), axis=0)
    # below[j]: the threshold is above pivot j; a prefix of the (non-decreasing) pivots.
    below = tl.where(kact, tot_cnt >= k, (tot_cnt >= nfin) | (tot_mass >= p * z))
    f = tl.max(tl.where(below, j, -1), axis=0)
    g = tl.min(tl.where(below, NB, j), axis=0)
    piv_f = tl.sum(tl.where(j == f, piv, 0), axis=0)
    piv_g = tl.sum(tl.where(j == g, piv, 0), axis=0)
    up = (f >= 0) & (piv_f > lo)
    down = (g < NB) & (piv_g < hi) & (kact == 0)
    c_lo = tl.where(up, tl.sum(tl.where((j == f)[None, :], cnt, 0), axis=1), c_lo)
    c_hi = tl.where(down, tl.sum(tl.where((j == g)[None, :], cnt, 0), axis=1), c_hi)
    mass_hi = tl.where(down, tl.sum(tl.where(j == g, tot_mass, 0.0), axis=0), mass_hi)
    return tl.where(up, piv_f, lo), tl.where(down, piv_g, hi), mass_hi, c_lo, c_hi


@triton.jit
def _first_bracket(
    cnt_ptr: tl.tensor, mass_ptr: tl.tensor, piv_ptr: tl.tensor, row: tl.tensor, nch: int,
    k: tl.tensor, p: tl.tensor, z: tl.tensor, nfin: tl.tensor, m: tl.tensor, kact: tl.tensor,
    NB: tl.constexpr, NCH_P2: tl.constexpr,
) -> tuple[tl.tensor, ...]:
    # The bracket from the first pivots: (lo, hi], the mass above hi, each chunk's counts.
    none = tl.zeros([NCH_P2], tl.int32)
    return _narrow(cnt_ptr, mass_ptr, piv_ptr, row, nch, k, p, z, nfin, kact,
                   tl.full([], -(2**31), tl.int32), _skey(m), tl.full([], 0.0, tl.float32),
                   none, none, NB, NCH_P2)


@triton.jit
def _row_setup(
    stat_ptr: tl.tensor, row: tl.tensor, nch: int, topk_ptr: tl.tensor, topp_ptr: tl.tensor,
    vocab: int, NCH_P2: tl.constexpr,
) -> tuple[tl.tensor, ...]:
    # Row statistics from the stats partials, and which filters are active. The stats of a
    # row exist only where it asked for a filter (``req``); kact / pact are False elsewhere.
    k = tl.load(topk_ptr + row).to(tl.int64)
    p = tl.load(topp_ptr + row).to(tl.float32)
    req = ((k >= 1) & (k < vocab)) | (p < 1.0)
    c = tl.arange(0, NCH_P2)
    cm = (c < nch) & req
    base = stat_ptr + (row * nch + c) * 4
    cmax = tl.load(base, mask=cm, other=float("-inf"))
    m = tl.max(cmax, axis=0)
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(tl.load(base + 2, mask=cm, other=0.0) * tl.exp(cmax - safe_m), axis=0)
    mn = tl.min(tl.load(base + 1, mask=cm, other=float("inf")), axis=0)
    nfin = tl.sum(tl.load(base + 3, mask=cm, other=0.0), axis=0).to(tl.int64)
    kact = req & (k >= 1) & (k < nfin)
    pact = req & (p < 1.0) & (nfin > 0)
    return m, mn, z, nfin, k, p, kact, pact


@triton.jit
def _first_pivots(
    m: tl.tensor, mn: tl.tensor, kact: tl.tensor, ln_v: float, NB: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    # Pivot 0 is just below the finite minimum; pivots 1.. lie at m - span * ((NB - j) / NB)^2.
    j = tl.arange(0, NB)
    lo0 = _skey(mn) - 1
    span = tl.where(kact, m - mn, tl.minimum(m - mn, ln_v + _P_WINDOW))
    f = (NB - j).to(tl.float32) / NB
    piv = tl.minimum(tl.maximum(_skey(m - span * f * f), lo0), _skey(m))
    return tl.where(j == 0, lo0, piv), j


@triton.jit
def _stats_kernel(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, vocab: int, topk_ptr: tl.tensor,
    topp_ptr: tl.tensor, stat_ptr: tl.tensor, nch: int, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    TEMP: tl.constexpr,
) -> None:
    # Program (row, chunk): max, finite min, finite count and sum exp(x - max) of its chunk.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k = tl.load(topk_ptr + row).to(tl.int64)
    p = tl.load(topp_ptr + row).to(tl.float32)
    if not (((k >= 1) & (k < vocab)) | (p < 1.0)):
        return
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    # Per-lane running max / sum exp(x - max) / finite min / finite count, reduced across the
    # block once at the end (no block-wide reduction per tile); one exp per value: a value
    # above its lane's max rescales the lane's sum by exp(old max - value).
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    nf = tl.zeros([BLOCK], tl.int32)
    for v0 in range(start, end, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _load_scaled(x_ptr + row * x_stride, v, end, t_ptr, row, TEMP)
        fin = x > float("-inf")
        top = tl.maximum(m, x)
        d = tl.exp(tl.minimum(m, x) - tl.where(top == float("-inf"), 0.0, top))
        s = tl.where(x > m, s * d + 1.0, s + d)
        m = top
        mn = tl.minimum(mn, tl.where(fin, x, float("inf")))
        nf += fin.to(tl.int32)
    row_m = tl.max(m, axis=0)
    safe_m = tl.where(row_m == float("-inf"), 0.0, row_m)
    base = stat_ptr + (row * nch + c) * 4
    tl.store(base, row_m)
    tl.store(base + 1, tl.min(mn, axis=0))
    tl.store(base + 2, tl.sum(s * tl.exp(m - safe_m), axis=0))
    tl.store(base + 3, tl.sum(nf, axis=0).to(tl.float32))


@triton.jit
def _count_above(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, row: tl.tensor, c: tl.tensor,
    vocab: int, piv: tl.tensor, m: tl.tensor, cnt_ptr: tl.tensor, mass_ptr: tl.tensor, nch: int,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, TEMP: tl.constexpr,
) -> None:
    # Chunk c of the row: the count and the mass sum exp(x - m) of its values above each of
    # the NB pivot keys ``piv``, stored at (row, c). [NB, BLOCK] accumulators (one value a
    # thread, its NB counts in registers; [BLOCK, NB] got a layout that spread each value over
    # NB threads: 664 -> 267 µs on bf16, H200, 256 rows of 151,936), summed over the block
    # once at the end instead of a block-wide reduction per tile.
    cnt = tl.zeros([NB, BLOCK], tl.int32)
    mass = tl.zeros([NB, BLOCK], tl.float32)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    for v0 in range(start, end, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _load_scaled(x_ptr + row * x_stride, v, end, t_ptr, row, TEMP)
        gt = _skey(x)[None, :] > piv[:, None]
        cnt += gt.to(tl.int32)
        mass += tl.where(gt, tl.exp(x - m)[None, :], 0.0)
    offs = (row * nch + c) * NB + tl.arange(0, NB)
    tl.store(cnt_ptr + offs, tl.sum(cnt, axis=1))
    tl.store(mass_ptr + offs, tl.sum(mass, axis=1))


@triton.jit
def _pivot_kernel(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, vocab: int, topk_ptr: tl.tensor,
    topp_ptr: tl.tensor, stat_ptr: tl.tensor, cnt_ptr: tl.tensor, mass_ptr: tl.tensor,
    piv_ptr: tl.tensor, nch: int, ln_v: float, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    NB: tl.constexpr, NCH_P2: tl.constexpr, TEMP: tl.constexpr,
) -> None:
    # Program (row, chunk): count and mass of its values above each first pivot. Chunk 0
    # records the pivot keys, so that the next kernel need not recompute them in float.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, mn, z, nfin, k, p, kact, pact = _row_setup(
        stat_ptr, row, nch, topk_ptr, topp_ptr, vocab, NCH_P2
    )
    if not (kact | (pact & (p > 0.0))):
        return
    piv, j = _first_pivots(m, mn, kact, ln_v, NB)
    if c == 0:
        tl.store(piv_ptr + row * NB + j, piv)
    _count_above(x_ptr, x_stride, t_ptr, row, c, vocab, piv, m, cnt_ptr, mass_ptr, nch, CHUNK,
                 BLOCK, NB, TEMP)


@triton.jit
def _refine_kernel(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, vocab: int, topk_ptr: tl.tensor,
    topp_ptr: tl.tensor, stat_ptr: tl.tensor, cnt_ptr: tl.tensor, mass_ptr: tl.tensor,
    piv_ptr: tl.tensor,
    cnt2_ptr: tl.tensor, mass2_ptr: tl.tensor, piv2_ptr: tl.tensor, flag_ptr: tl.tensor,
    nch: int, CAP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    NCH_P2: tl.constexpr, TEMP: tl.constexpr,
) -> None:
    # Program (row, chunk), top-p rows without top-k whose first bracket holds more than CAP
    # values (flat rows: the threshold lies in the bulk, where the first pivots are sparse):
    # count and weigh its values above NB pivots spread evenly (in value) over the bracket.
    # Chunk 0 records whether the row was refined, and its pivots.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, mn, z, nfin, k, p, kact, pact = _row_setup(
        stat_ptr, row, nch, topk_ptr, topp_ptr, vocab, NCH_P2
    )
    refine = pact & (p > 0.0) & (kact == 0)
    lo = tl.full([], 0, tl.int32)
    hi = lo
    if refine:  # (the pivot pass skipped the other rows: their counts are not written)
        lo, hi, mass_hi, c_lo, c_hi = _first_bracket(
            cnt_ptr, mass_ptr, piv_ptr, row, nch, k, p, z, nfin, m, kact, NB, NCH_P2
        )
        refine = tl.sum(c_lo - c_hi, axis=0) > CAP
    if c == 0:
        tl.store(flag_ptr + row, refine.to(tl.int32))
    if not refine:
        return
    j = tl.arange(0, NB)
    t = (j + 1).to(tl.float32) / (NB + 1)
    lo_v = _key_value(lo + 1)  # the bracket's least value: finite, unlike lo's may not be
    hi_v = _key_value(hi)
    piv = tl.minimum(tl.maximum(_skey(lo_v * (1.0 - t) + hi_v * t), lo), hi)
    if c == 0:
        tl.store(piv2_ptr + row * NB + j, piv)
    _count_above(x_ptr, x_stride, t_ptr, row, c, vocab, piv, m, cnt2_ptr, mass2_ptr, nch,
                 CHUNK, BLOCK, NB, TEMP)


@triton.jit
def _compact_kernel(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, vocab: int, topk_ptr: tl.tensor,
    topp_ptr: tl.tensor, stat_ptr: tl.tensor, cnt_ptr: tl.tensor, mass_ptr: tl.tensor,
    piv_ptr: tl.tensor,
    cnt2_ptr: tl.tensor, mass2_ptr: tl.tensor, piv2_ptr: tl.tensor, flag_ptr: tl.tensor,
    cand_ptr: tl.tensor, cand_stride: int, bound_ptr: tl.tensor, base_ptr: tl.tensor, nch: int,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NCH_P2: tl.constexpr,
    TEMP: tl.constexpr,
) -> None:
    # Program (row, chunk): the bracket (lo, hi] holding the threshold key, from the first
    # pivots and, for a refined row, the second ones (identically in every program of the
    # row); then copy its chunk's values inside it to the candidate row, after those of the
    # chunks before it. Chunk 0 records (lo, count, hi) and the mass above hi.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, mn, z, nfin, k, p, kact, pact = _row_setup(
        stat_ptr, row, nch, topk_ptr, topp_ptr, vocab, NCH_P2
    )
    if not (kact | (pact & (p > 0.0))):
        return
    lo, hi, mass_hi, c_lo, c_hi = _first_bracket(
        cnt_ptr, mass_ptr, piv_ptr, row, nch, k, p, z, nfin, m, kact, NB, NCH_P2
    )
    if tl.load(flag_ptr + row) != 0:
        lo, hi, mass_hi, c_lo, c_hi = _narrow(
            cnt2_ptr, mass2_ptr, piv2_ptr, row, nch, k, p, z, nfin, kact, lo, hi, mass_hi,
            c_lo, c_hi, NB, NCH_P2
        )
    cc = tl.arange(0, NCH_P2)
    inside = c_lo - c_hi
    off = tl.sum(tl.where(cc < c, inside, 0), axis=0).to(tl.int64)
    if c == 0:
        tl.store(bound_ptr + row * 3, lo.to(tl.int64))
        tl.store(bound_ptr + row * 3 + 1, tl.sum(inside, axis=0).to(tl.int64))
        tl.store(bound_ptr + row * 3 + 2, hi.to(tl.int64))
        tl.store(base_ptr + row, mass_hi)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    for v0 in range(start, end, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _load_scaled(x_ptr + row * x_stride, v, end, t_ptr, row, TEMP)
        key = _skey(x)
        keep = ((key > lo) & (key <= hi)).to(tl.int32)
        kept = tl.sum(keep, axis=0)
        if kept > 0:  # most tiles of a top-k row hold no candidate: no scan, no store
            pos = off + tl.cumsum(keep, axis=0) - 1
            tl.store(cand_ptr + row * cand_stride + pos, x, mask=keep != 0)
            off += kept


@triton.jit
def _sort_resolve(
    cand: tl.tensor, n: tl.tensor, hi: tl.tensor, base: tl.tensor, m: tl.tensor, z: tl.tensor,
    k: tl.tensor, p: tl.tensor, kact: tl.tensor, pact: tl.tensor, CAP: tl.constexpr,
) -> tl.tensor:
    # All n <= CAP candidates (the values in the bracket: with top-k every value above lo)
    # sorted: exact top-k, then top-p, the bracket's values weighing ``base`` (the mass above
    # hi, 0 with top-k) more. Top-p keeping none of them (float rounding) keeps keys >= hi.
    i = tl.arange(0, CAP)
    s = tl.sort(tl.load(cand + i, mask=i < n, other=float("-inf")), descending=True)
    kth = tl.max(tl.where(i == k - 1, s, float("-inf")), axis=0)
    kth = tl.where(kact, kth, float("-inf"))
    w = tl.where(s >= kth, tl.exp(s - m), 0.0)
    zk = tl.where(kact, tl.sum(w, axis=0), z)
    before = base + tl.cumsum(w, axis=0) - w
    keep = (i < n) & (s >= kth) & (before < p * zk)
    tp = tl.min(tl.where(keep, s, float("inf")), axis=0)
    thr_p = tl.where(tp < float("inf"), _skey(tp), hi)
    return tl.where(pact, thr_p, _skey(kth)).to(tl.int64)


@triton.jit
def _bisect(
    cand: tl.tensor, n: tl.tensor, lo: tl.tensor, hi: tl.tensor, base: tl.tensor,
    m: tl.tensor, z: tl.tensor, k: tl.tensor, p: tl.tensor, kact: tl.tensor, pact: tl.tensor,
    NB: tl.constexpr, TILE: tl.constexpr,
) -> tl.tensor:
    # Key-space bisection over the n candidates (the values with key in (lo, hi], the mass
    # above hi being ``base``): the threshold key lies in (lo, hi]; each pass counts and
    # weighs the candidates above NB pivots and keeps the sub-range holding the threshold,
    # until hi == lo + 1. With top-k (hi = key(m), base 0), the top-k stage's final range
    # gives Z_k = mass above lo; the top-p stage then searches (key(kth) - 1, key(m)].
    j = tl.arange(0, NB)
    hi = hi.to(tl.int64)
    stage_k = kact.to(tl.int32)
    zk = z
    t = hi
    done = tl.full([], 0, tl.int32)
    it = 0
    while (done == 0) & (it < 80):
        piv = lo + ((hi - lo) * (j + 1)) // (NB + 1)
        piv = tl.minimum(tl.maximum(piv, lo + 1), hi).to(tl.int32)
        # [NB, TILE] per-lane accumulators (one candidate a thread, its NB counts in
        # registers), reduced once a pass (as _count_above's)
        lane_cnt = tl.zeros([NB, TILE], tl.int32)
        lane_mass = tl.zeros([NB, TILE], tl.float32)
        lane_cnt_lo = tl.zeros([TILE], tl.int32)
        lane_mass_lo = tl.zeros([TILE], tl.float32)
        for v0 in range(0, n, TILE):
            v = v0 + tl.arange(0, TILE)
            x = tl.load(cand + v, mask=v < n, other=float("-inf"))
            key = _skey(x)
            w = tl.exp(x - m)
            gt = key[None, :] > piv[:, None]
            lane_cnt += gt.to(tl.int32)
            lane_mass += tl.where(gt, w[None, :], 0.0)
            above = key > lo
            lane_cnt_lo += above.to(tl.int32)
            lane_mass_lo += tl.where(above, w, 0.0)
        cnt = tl.sum(lane_cnt, axis=1)
        mass = tl.sum(lane_mass, axis=1)
        cnt_lo = tl.sum(lane_cnt_lo, axis=0)
        mass_lo = tl.sum(lane_mass_lo, axis=0)
        below = tl.where(stage_k != 0, cnt >= k, (cnt >= cnt_lo) | (base + mass >= p * zk))
        f = tl.max(tl.where(below, j, -1), axis=0)
        g = tl.min(tl.where(below, NB, j), axis=0)
        mass_lo = tl.where(f >= 0, tl.sum(tl.where(j == f, mass, 0.0), axis=0), mass_lo)
        lo = tl.where(f >= 0, tl.sum(tl.where(j == f, piv, 0), axis=0).to(tl.int64), lo)
        hi = tl.where(g < NB, tl.sum(tl.where(j == g, piv, 0), axis=0).to(tl.int64), hi)
        if hi - lo <= 1:
            if (stage_k != 0) & pact:
                stage_k = stage_k * 0
                zk = mass_lo
                hi = _skey(m).to(tl.int64)
            else:
                t = hi
                done = done + 1
        it += 1
    return t


@triton.jit
def _resolve_kernel(
    cand_ptr: tl.tensor, cand_stride: int, vocab: int, topk_ptr: tl.tensor, topp_ptr: tl.tensor,
    stat_ptr: tl.tensor, bound_ptr: tl.tensor, base_ptr: tl.tensor, thr_ptr: tl.tensor,
    nch: int, CAP: tl.constexpr,
    SMALL_CAP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, NCH_P2: tl.constexpr,
) -> None:
    # One program per row: the threshold key (keep x with key >= thr). A few candidates (the
    # usual top-k case) take a small sort: a sort's cost grows with its size, not with n.
    row = tl.program_id(0).to(tl.int64)
    m, mn, z, nfin, k, p, kact, pact = _row_setup(
        stat_ptr, row, nch, topk_ptr, topp_ptr, vocab, NCH_P2
    )
    thr = tl.full([], _KEEP_ALL, tl.int64)
    if pact & (p <= 0.0):
        thr = tl.full([], _DROP_ALL, tl.int64)
    elif kact | pact:
        lo = tl.load(bound_ptr + row * 3)
        n = tl.load(bound_ptr + row * 3 + 1)
        hi = tl.load(bound_ptr + row * 3 + 2)
        base = tl.load(base_ptr + row)
        cand = cand_ptr + row * cand_stride
        if n <= SMALL_CAP:
            thr = _sort_resolve(cand, n, hi, base, m, z, k, p, kact, pact, SMALL_CAP)
        elif n <= CAP:
            thr = _sort_resolve(cand, n, hi, base, m, z, k, p, kact, pact, CAP)
        else:
            thr = _bisect(cand, n, lo, hi, base, m, z, k, p, kact, pact, NB, BLOCK // 4)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _write_kernel(
    x_ptr: tl.tensor, x_stride: int, t_ptr: tl.tensor, out_ptr: tl.tensor, out_stride: int,
    vocab: int, thr_ptr: tl.tensor, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    IN_PLACE: tl.constexpr, TEMP: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(thr_ptr + row)
    if IN_PLACE and not TEMP:  # noqa: SIM102 (constexpr branch; `and` would mix it with a tensor)
        if t == _KEEP_ALL:  # nothing to drop or divide, and out is logits
            return
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    for v0 in range(start, end, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _load_scaled(x_ptr + row * x_stride, v, end, t_ptr, row, TEMP)
        y = tl.where(_skey(x).to(tl.int64) >= t, x, float("-inf"))
        tl.store(out_ptr + row * out_stride + v, y, mask=v < end)


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
