"""The Triton kernels of :mod:`mrv2_kernels.top_k_top_p` (its docstring describes the
algorithm and the six launches; its host side launches them): per-row statistics, the pivot
and refinement passes that bracket each row's threshold, the compaction of the bracket's
values, the resolve (a sort in registers, or a key-space bisection) and the write.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["order_key"]

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
