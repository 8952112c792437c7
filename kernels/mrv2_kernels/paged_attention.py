"""Paged causal attention over a block-table KV cache (Triton); reference in paged_attention_ref.

KV cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 keys, 1 values).
Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are the last
``qlen_i`` positions of a sequence of ``seq_lens[i]`` tokens, so query ``j`` sits at position
``seq_lens[i] - qlen_i + j`` and attends to keys ``0..`` that position.

One kernel family, two configurations chosen on the host from CPU-known bounds only
(:mod:`mrv2_kernels.paged_attention_plan`):

* prefill / mixed: a program per (query tile, kv head, request). The query heads of a GQA group
  and ``BLOCK_Q`` query tokens are packed into the ``BLOCK_M = BLOCK_Q * GROUP_P2`` rows of one
  ``tl.dot`` tile, so every KV tile is read once per kv head and query tile. Keys are visited in
  ``BLOCK_N`` tiles through the block table (any block size); tiles wholly below the causal
  diagonal take an unmasked fast loop, the rest a masked one.
* small queries (decode, uniform or spec-decode sized): the same kernel with one query tile per
  request and the key range cut into ``num_splits`` chunks ("flash decoding"): programs per
  (kv head x split, request) write partial (max, sum, acc) in fp32, and a second kernel combines
  them per (token, head). Each request's range is cut evenly by its own ``seq_len`` on the
  device, so ``num_splits`` can come from a loose CPU bound and still balance. (Combining in
  the last-arriving split program instead, with an atomic counter, was tried twice: a serial
  walk over the splits took 15 us per layer on the H200 against 5.7 + 2.7 us for the two
  kernels; a vectorized one (all of a token's splits in one load) was no faster than the two
  PDL-launched kernels in CUDA graphs (batch 1, 256 keys: 7.0 against 6.5 us) and left decode
  TPOT unchanged, BENCHMARKS.md 2026-12-01.)

With raw q/k/v (``rope=``) and a prefill plan, where :func:`~mrv2_kernels.prefill_attention.
use_tma_prefill` allows it (``MRV2_TMA_PREFILL=1``, a Hopper GPU), requests of a query tile or
more attend in :mod:`mrv2_kernels.prefill_attention` (the step's keys through TMA) and this
kernel skips them.

No host syncs: grids come from ``num_reqs``, ``max_query_len`` and ``max_seq_len``; programs
past a request's real work exit early. A prefill plan's programs walk the step's query tiles
(``flat_grid``, the default; ``MRV2_ATTN_FLAT_GRID=0`` turns it off), each finding its request
in ``query_start_loc`` (one vector load): ``T // block_q + num_reqs`` programs per kv head
rather than ``ceil(max_query_len / block_q) * num_reqs``, most of which exit at once in a mixed
step, and a grid that does not depend on ``max_query_len``: a CUDA graph of mixed steps at a
padded token count bakes ``max_query_len = T`` and launches no more programs than the step
needs. (H200, 2026-12-02: a mixed step of 16 prompts and 128 decodes 248 against 253 us on
Qwen3-0.6B heads, 390 against 388 on Qwen3-8B heads; the throughput workload equal.)
A prefill plan's one-token requests (a mixed step's decoding requests) may attend first in a
launch of their own, in the decode plan's tiles, the prefill launch skipping them
(``one_token_apart``; rule and measurements at :data:`ONE_TOKEN_APART_MIN_BLOCK_M`): in a query
tile a decoding request has one real token (one row in 32 of Qwen3-8B's 128 x 32 tiles). That
launch has no splits, so a few long-context decoding requests beside a long prompt chunk no
longer overlap it. (As a branch of the prefill kernel instead, the 8B prefill rate fell 252 ->
156 TFLOP/s.)
Accumulation is fp32 (online softmax in base 2). The cache may be fp8 (e4m3,
``kv_cache_dtype="fp8"``, stored as :func:`~mrv2_kernels.kv_cache.to_cache_dtype` does):
the key and value tiles become fp16 after the load, and the dots run in fp16 (e4m3 -> fp16
is one ``cvt`` a pair, e4m3 -> bf16 goes through fp32: on the H200 the workload's decode
attention took 1,903 against 2,146 us; the query is clamped to fp16's range). The TMA prefill
path is not taken then (it reads the step's keys from the step's tensors, not the cache).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from ._backend import LOG2E as _LOG2E
from ._backend import LOG2E_C as _LOG2E_C
from ._backend import M_INIT as _M_INIT
from ._backend import (
    flat_query_tile,
    kv_store_cast,
    next_power_of_2,
    pdl,
    pdl_early_meta,
    pdl_prologue,
    pdl_release,
    pdl_wait,
)
from ._backend import online_softmax_step as _online_step
from .kv_cache import FP8_KV_DTYPE
from .paged_attention_plan import AttentionPlan, FusedRope, attention_plan, fused_rope_launch
from .paged_attention_ref import _check_inputs, paged_attention_ref
from .prefill_attention import prefill_attention_tma, tma_prefill_min_query
from .rotary import _norm_rotate

#: ``0``: prefill plans launch one program per (query tile bound, request) instead of over the
#: step's query tiles only (``paged_attention``'s ``flat_grid``, on by default).
FLAT_GRID_ENV_VAR = "MRV2_ATTN_FLAT_GRID"
#: A prefill plan's one-token requests (a mixed step's decoding requests) get a launch of their
#: own in the decode plan's tiles (``paged_attention``'s ``one_token_apart``) where its tiles
#: have at least :data:`ONE_TOKEN_APART_MIN_BLOCK_M` rows; ``1``: for every prefill plan, ``0``:
#: never (they take a query tile each).
ONE_TOKEN_ENV_VAR = "MRV2_ATTN_ONE_TOKEN_APART"
#: Tile rows from which one-token requests attend apart by default: 128-row tiles (Qwen3-8B's
#: 4-head groups) gave a mixed step 384 -> 321 us; 64-row ones (Qwen3-0.6B) 247 us either way,
#: where the extra launch would only cost host time in eager steps (H200, BENCHMARKS.md
#: 2026-12-02, thirteenth session).
ONE_TOKEN_APART_MIN_BLOCK_M = 128

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rope_table(
    pos_ptr: tl.tensor, rows: tl.tensor, valid: tl.tensor, cos_sin_ptr: tl.tensor,
    HALF: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """``[R, HALF]`` cos and sin (fp32) at the positions of token rows ``rows`` ``[R]``."""
    pos = tl.load(pos_ptr + rows, mask=valid, other=0).to(tl.int64)
    at = cos_sin_ptr + pos[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    cos = tl.load(at, mask=valid[:, None], other=0.0).to(tl.float32)
    sin = tl.load(at + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
    return cos, sin


@triton.jit(do_not_specialize=["num_q_tiles", "num_splits", "num_tokens", "num_reqs"])
def _paged_attn_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_m_ptr: tl.tensor,
    part_l_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    block_table_ptr: tl.tensor,
    qk_scale: tl.tensor,
    num_q_tiles: tl.tensor,
    num_heads: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_bt: tl.tensor,
    num_splits: tl.tensor,
    num_tokens: tl.tensor,
    pos_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    q_w_ptr: tl.tensor,
    k_w_ptr: tl.tensor,
    eps: tl.tensor,
    new_k_ptr: tl.tensor,
    new_v_ptr: tl.tensor,
    stride_nt: tl.tensor,
    stride_nvt: tl.tensor,
    slot_ptr: tl.tensor,
    long_qlen: tl.tensor,
    num_reqs: tl.tensor,
    window: tl.tensor,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_META: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    SKIP_LONG: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    REQ_BLOCK: tl.constexpr = 16,
    ONE_TOKEN: tl.constexpr = 0,
    SLIDING: tl.constexpr = False,
    CAP: tl.constexpr = 0.0,
    sinks_ptr: tl.tensor = None,
    SINKS: tl.constexpr = False,
) -> None:
    # Heaviest query tiles (latest positions) first: better tail balance in causal prefill.
    # FLAT: program_id(0) counts every request's tiles (see flat_query_tile), the last ones
    # first.
    q_tile = num_q_tiles - 1 - tl.program_id(0)
    pid_hs = tl.program_id(1)
    req = tl.program_id(2)
    flat_t = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = pid_hs // num_splits
    split = pid_hs % num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    HALF: tl.constexpr = HEAD_DIM // 2
    KV_FP8: tl.constexpr = k_ptr.dtype.element_ty == tl.float8e4nv
    rows = tl.arange(0, BLOCK_M)
    grp = rows % GROUP_P2
    head = kvh * GROUP + grp
    t_new = tl.arange(0, BLOCK_Q)
    if EARLY_META or ROPE:  # the request's query range and length before the wait
        # (pdl_early_meta's rule: no PDL kernel writes step metadata or constant tables)
        pdl_release(PDL)
        if FLAT:
            req, q_tile = flat_query_tile(qsl_ptr, num_reqs, flat_t, BLOCK_Q, REQ_BLOCK)
        q_start = tl.load(qsl_ptr + req)
        seq_len = tl.load(seq_lens_ptr + req)
        q_end = tl.load(qsl_ptr + req + 1)  # qlen is taken after the wait: nothing before it
        if ROPE:  # and the rotation's positions, tables, weights and slots too
            tok_e = q_tile * BLOCK_Q + rows // GROUP_P2
            qv_e = (tok_e < q_end - q_start) & (grp < GROUP)
            q_cos, q_sin = _rope_table(pos_ptr, (q_start + tok_e).to(tl.int64), qv_e,
                                       cos_sin_ptr, HALF)
            new_e = t_new < q_end - q_start
            new_row = (q_start + t_new).to(tl.int64)
            k_cos, k_sin = _rope_table(pos_ptr, new_row, new_e, cos_sin_ptr, HALF)
            slot = tl.load(slot_ptr + new_row, mask=new_e, other=-1).to(tl.int64)
            offs_h = tl.arange(0, HALF)
            if QK_NORM:
                qw1 = tl.load(q_w_ptr + offs_h).to(tl.float32)[None, :]
                qw2 = tl.load(q_w_ptr + HALF + offs_h).to(tl.float32)[None, :]
                kw1 = tl.load(k_w_ptr + offs_h).to(tl.float32)[None, :]
                kw2 = tl.load(k_w_ptr + HALF + offs_h).to(tl.float32)[None, :]
            else:
                qw1 = tl.full([1, HALF], 1.0, tl.float32)
                qw2 = qw1
                kw1 = qw1
                kw2 = qw1
        pdl_wait(PDL)  # needs a load's value, so the loads stay in flight through the wait
    else:
        pdl_prologue(PDL)
        if FLAT:
            req, q_tile = flat_query_tile(qsl_ptr, num_reqs, flat_t, BLOCK_Q, REQ_BLOCK)

    if ZERO_PAD:  # rows of padding tokens (past query_start_loc[num_reqs]) become zeros:
        # spread over all programs, so no memset launch is needed before the kernel
        num_real = tl.load(qsl_ptr + num_reqs)
        pid = (tl.program_id(2) * tl.num_programs(1) + pid_hs) * tl.num_programs(0) \
            + tl.program_id(0)
        step = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        for t in range(num_real + pid, num_tokens, step):
            for h in range(0, num_heads):
                row64 = tl.full([], 0, tl.int64) + t  # int64 offsets (t may be a Python int)
                tl.store(out_ptr + row64 * stride_ot + h * stride_oh + offs_d,
                         tl.zeros([HEAD_DIM], dtype=out_ptr.dtype.element_ty))

    # seq_len is loaded before the early exit: its load then overlaps query_start_loc's instead
    # of waiting for it (one memory round trip less before the first key tile is requested).
    if EARLY_META or ROPE:
        qlen = q_end - q_start
    else:
        q_start = tl.load(qsl_ptr + req)
        seq_len = tl.load(seq_lens_ptr + req)
        qlen = tl.load(qsl_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK_Q
    if tile_start >= qlen:
        return
    if SKIP_LONG:  # noqa: SIM102 (constexpr branch) requests of long_qlen+ query tokens: TMA
        if qlen >= long_qlen:
            return
    if ONE_TOKEN == 1:  # noqa: SIM102 (constexpr branch) this launch: one-token requests only
        if qlen != 1:
            return
    if ONE_TOKEN == 2:  # noqa: SIM102 (constexpr branch) they have their own launch
        if qlen == 1:
            return
    ctx_len = seq_len - qlen

    tok = tile_start + rows // GROUP_P2
    row_valid = (tok < qlen) & (grp < GROUP)
    pos = ctx_len + tok
    q_row = (q_start + tok).to(tl.int64)

    q_ptrs = q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:  # raw query: RMS-normalized per head (QK_NORM) and rotated here, in registers
        q1, q2 = _norm_rotate(q_ptrs + offs_h[None, :], row_valid[:, None], HALF, q_cos, q_sin,
                              qw1, qw2, eps, QK_NORM)
        q = tl.join(q1, q2).permute(0, 2, 1).reshape(BLOCK_M, HEAD_DIM)  # [q1 | q2]
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif KV_FP8:  # fp16 dots (see the key loop): bf16 -> fp16 is exact within fp16's range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # Keys this tile can see: [kv_start, kv_end); split `split` takes one chunk of them.
    kv_end = tl.minimum(ctx_len + tile_start + BLOCK_Q, seq_len)
    kv_end = tl.maximum(kv_end, 0)
    kv_start = kv_end * 0
    if SLIDING:  # the tile's first row sees keys from its position - window + 1 (whole tiles)
        kv_start = (tl.maximum(ctx_len + tile_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    if USE_SPLITS:
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    else:
        lo = kv_start
        hi = kv_end
    if ROPE:
        # This step's keys and values (its query tokens' positions, [ctx_len, seq_len)) go
        # into the cache first: each program stores the ones in its own key range, rotated
        # like the queries, then a barrier makes them visible to its own loads below. No
        # other program reads them (a program reads only keys of its range), so nothing
        # else waits. (small-query plans only: one query tile holds every query token.)
        k_seq = ctx_len + t_new
        new_ok = (t_new < qlen) & (k_seq >= lo) & (k_seq < hi) & (slot >= 0)
        k1, k2 = _norm_rotate(new_k_ptr + new_row[:, None] * stride_nt + kvh * HEAD_DIM
                              + offs_h[None, :], new_ok[:, None], HALF, k_cos, k_sin, kw1, kw2,
                              eps, QK_NORM)
        v_new = tl.load(new_v_ptr + new_row[:, None] * stride_nvt + kvh * HEAD_DIM
                        + offs_d[None, :], mask=new_ok[:, None], other=0.0)
        slot_row = ((slot // KV_BLOCK_SIZE) * stride_kb + (slot % KV_BLOCK_SIZE) * stride_ks
                    + kvh.to(tl.int64) * stride_kh)[:, None]
        tl.store(k_ptr + slot_row + offs_h[None, :], kv_store_cast(k1, k_ptr),
                 mask=new_ok[:, None])
        tl.store(k_ptr + slot_row + HALF + offs_h[None, :], kv_store_cast(k2, k_ptr),
                 mask=new_ok[:, None])
        tl.store(v_ptr + slot_row + offs_d[None, :], kv_store_cast(v_new, v_ptr),
                 mask=new_ok[:, None])
        tl.debug_barrier()
    # Keys below every row's position need no mask (and are all < seq_len); with a sliding
    # window every tile takes the masked loop (its lower edge moves with each row).
    full_end = tl.minimum(hi, ctx_len + tile_start + 1)
    mid = lo + (tl.maximum(full_end - lo, 0) // BLOCK_N) * BLOCK_N
    if SLIDING:
        mid = lo

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if SINKS:  # a key of each head's own, valued zero, at its learned score (gpt-oss): in the
        # running max and sum from the start, once per row (by split 0 of a split row)
        sink = tl.load(sinks_ptr + head, mask=grp < GROUP, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink * _LOG2E_C, m_i)
        l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), l_i)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    head_off = kvh.to(tl.int64) * stride_kh

    for start in range(lo, mid, BLOCK_N):
        n = start + offs_n
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE).to(tl.int64)
        kv_off = (
            blk[:, None] * stride_kb
            + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
            + head_off
            + offs_d[None, :]
        )
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:  # an fp8 cache: the dots run in fp16 (e4m3 -> f16 is one cvt a pair)
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, pos[:, None] >= 0,
                                     False, DOT_FP32, FP32_PRECISION, CAP)

    for start in range(mid, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < seq_len
        if SLIDING:  # keys before every row's window are not read (their blocks may be gone)
            n_ok &= n > ctx_len + tile_start - window
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (
            blk[:, None] * stride_kb
            + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
            + head_off
            + offs_d[None, :]
        )
        k = tl.load(k_ptr + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=n_ok[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:  # an fp8 cache: the dots run in fp16 (e4m3 -> f16 is one cvt a pair)
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        visible = n[None, :] <= pos[:, None]
        if SLIDING:
            visible &= n[None, :] > pos[:, None] - window
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, visible, True, DOT_FP32,
                                     FP32_PRECISION, CAP)

    if USE_SPLITS:
        part = (q_row * num_heads + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _combine_splits_kernel(
    part_m_ptr: tl.tensor,
    part_l_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    num_reqs: tl.tensor,
    num_heads: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    num_splits: tl.tensor,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    # The partials are loaded without waiting for the real-token count (no branch before the
    # loads: both round trips overlap); a padding token's partials were never written and
    # its row is replaced by zeros at the end.
    num_real = tl.load(qsl_ptr + num_reqs)
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < num_splits
    part = (tok * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=_M_INIT)
    l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)
    l_tot = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0)
    l_tot = tl.where(l_tot > 0.0, l_tot, 1.0)
    o = tl.where(tok < num_real, o / l_tot, 0.0)  # padding token: zeros, whatever it read
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_reqs: int,
    uniform_decode: bool = False,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rope: FusedRope | None = None,
    flat_grid: bool | None = None,
    one_token_apart: bool | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` ``[T, H, D]`` over ``kv_cache``; see the module doc.

    ``sliding_window``: a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``
    only; its programs start at the first key tile their first row sees (decode reads the
    window, not the context), mask every tile, and never take the TMA prefill path.
    ``logit_softcap``: scores ``cap * tanh(score / cap)`` before the softmax (Gemma 2; not on
    the TMA path either). ``sinks`` ``[H]``: each head's attention sink (gpt-oss), a score
    that joins every row's softmax with a value of zero (not on the TMA path).

    With ``rope``, ``query`` is raw (not yet normalized or rotated) and this call also stores
    the step's key and value in the cache (see :class:`FusedRope`).

    ``max_query_len``, ``max_seq_len`` and ``num_reqs`` are CPU-known upper bounds: only they
    size the grids, device tensors are never read on the host. ``uniform_decode`` says every
    request has the same small query length (decode, or decode plus draft tokens); it selects
    the split-KV configuration, as does ``max_query_len * group <= 16`` by itself.

    Rows of tokens past ``query_start_loc[num_reqs]`` come out as zeros, as do queries with no
    key to attend to (whether ``out`` is given or not). ``block_m``/``block_n``/``num_splits``/
    ``num_warps``/``num_stages`` override the per-device defaults of :func:`attention_plan`
    (``num_splits`` only applies to the small-query configuration). ``flat_grid`` (default:
    on unless :data:`FLAT_GRID_ENV_VAR` is ``0``): a prefill plan's programs over the step's
    query tiles only (see the module doc). ``one_token_apart`` (default: :data:`ONE_TOKEN_ENV_VAR`'s
    rule): a prefill plan's requests of one query token attend in a launch of their own
    first, in the decode plan's tiles (one query row per kv head's group instead of a query
    tile in which one token is real). Returns ``out`` (allocated when
    ``None``), query dtype.
    """
    num_heads, num_kv_heads, head_dim, block_size = _check_inputs(query, kv_cache)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"paged_attention (Triton) needs a power-of-2 head_dim >= 16, got {head_dim}"
    )
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_table.dtype in (torch.int32, torch.int64), "block_table must be integer"
    assert kv_cache.dtype in (query.dtype, FP8_KV_DTYPE), (
        f"kv_cache dtype {kv_cache.dtype} must be the query's {query.dtype} or {FP8_KV_DTYPE}"
    )
    assert out is None or (
        out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    ), "out must match the query's shape and dtype"
    assert num_reqs < 65536, "num_reqs is a grid dimension: at most 65535 requests per launch"
    num_tokens = query.shape[0]
    group = num_heads // num_kv_heads
    on_gpu = query.is_cuda
    dot_fp32 = (not on_gpu) or query.dtype == torch.float32
    plan = attention_plan(
        query,
        kv_cache,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_reqs=num_reqs,
        uniform_decode=uniform_decode,
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    qsl = query_start_loc
    query, rope, rope_args, step_kv = fused_rope_launch(query, kv_cache, plan, rope, qsl,
                                                        num_heads, num_kv_heads, head_dim)
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return torch.zeros_like(query) if out is None else out.zero_()
    splits = plan.num_splits
    num_q_tiles = plan.num_q_tiles

    if out is None:
        # Every row gets written: by its query's program (or the combine kernel), or zeroed
        # as a padding token.
        out = torch.empty_like(query)
    long_qlen = 0
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != query.device):
        raise ValueError(f"sinks must be [{num_heads}] (one per query head) on the query's "
                         f"device, got {tuple(sinks.shape)} on {sinks.device}")
    if (step_kv is not None and sliding_window is None and logit_softcap is None
            and sinks is None and max_query_len >= (tile := tma_prefill_min_query(query))):
        # Prefill on Hopper: requests of a query tile or more read the step's own keys through
        # TMA, in their own kernel; the paged kernel below takes the rest (and the padding).
        long_qlen = tile
        prefill_attention_tma(query, *step_kv, kv_cache, qsl, seq_lens, block_table, scale,
                              max_query_len=max_query_len, num_reqs=num_reqs, out=out,
                              min_query_len=long_qlen)
    if splits > 1:
        part_m = torch.empty(
            (num_tokens, num_heads, splits), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
        )
    else:
        part_m = part_l = part_acc = out  # unused

    key_cache, value_cache = kv_cache[0], kv_cache[1]
    flat = (not plan.small_q and (flat_grid if flat_grid is not None
                                  else os.environ.get(FLAT_GRID_ENV_VAR, "1") != "0"))
    if one_token_apart is None:
        setting = os.environ.get(ONE_TOKEN_ENV_VAR)
        one_token_apart = (plan.block_m >= ONE_TOKEN_APART_MIN_BLOCK_M if setting is None
                           else setting != "0")
    apart = not plan.small_q and num_reqs > 1 and rope is None and one_token_apart
    def launch(grid: tuple[int, int, int], p: AttentionPlan, flags: dict[str, Any]) -> None:
        """``_paged_attn_kernel`` over ``grid`` with plan ``p``'s tiles and splits."""
        _paged_attn_kernel[grid](
            query, key_cache, value_cache, out, part_m, part_l, part_acc, qsl, seq_lens,
            block_table, scale * _LOG2E, p.num_q_tiles, num_heads, query.stride(0),
            query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0),
            key_cache.stride(1), key_cache.stride(2), block_table.stride(0), p.num_splits,
            num_tokens, *rope_args, flags.pop("long_qlen", 0), num_reqs, sliding_window or 0,
            GROUP=group, GROUP_P2=next_power_of_2(group), BLOCK_Q=p.block_q, BLOCK_M=p.block_m,
            BLOCK_N=p.block_n, HEAD_DIM=head_dim, KV_BLOCK_SIZE=block_size,
            USE_SPLITS=p.num_splits > 1, DOT_FP32=dot_fp32,
            # fp32 models on GPU: 3xTF32 tensor-core dots (about fp32 accurate); interpreter:
            # exact.
            FP32_PRECISION="tf32x3" if on_gpu else "ieee", num_warps=p.num_warps,
            num_stages=p.num_stages, EARLY_META=pdl_early_meta(query),
            SLIDING=sliding_window is not None,
            CAP=0.0 if logit_softcap is None else float(logit_softcap) / scale,
            **({} if sinks is None else {"sinks_ptr": sinks, "SINKS": True}),
            **flags, **pdl(query),
        )

    if apart:
        # One-token requests (decoding requests in a mixed step) first, in the decode plan's
        # tiles, without splits: [1 query tile, kv head, request] programs; the others exit.
        one = attention_plan(query, kv_cache, max_query_len=1, max_seq_len=max_seq_len,
                             num_reqs=num_reqs, uniform_decode=True, num_splits=1)
        launch((1, num_kv_heads, num_reqs), one, {"ZERO_PAD": False, "ROPE": False,
                                                  "QK_NORM": False, "ONE_TOKEN": 1})
    if flat:
        grid = (num_tokens // plan.block_q + num_reqs, num_kv_heads * splits, 1)
    else:
        grid = (num_q_tiles, num_kv_heads * splits, num_reqs)
    launch(grid, plan, {
        "long_qlen": long_qlen,
        "ZERO_PAD": splits == 1,  # with splits the combine kernel zeroes the padding rows
        "ROPE": rope is not None,
        "QK_NORM": rope is not None and rope.qk_norm is not None,
        "SKIP_LONG": long_qlen > 0,
        "FLAT": flat,
        "REQ_BLOCK": 256 if on_gpu else 16,  # requests per load of the flat grid's search
        "ONE_TOKEN": 2 if apart else 0,
    })
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            qsl,
            num_reqs,
            num_heads,
            out.stride(0),
            out.stride(1),
            splits,
            SPLITS_P2=next_power_of_2(splits),
            HEAD_DIM=head_dim,
            num_warps=4 if on_gpu else 1,
            **pdl(query),
        )
    return out


__all__ = ["FLAT_GRID_ENV_VAR", "ONE_TOKEN_APART_MIN_BLOCK_M", "ONE_TOKEN_ENV_VAR", "AttentionPlan",
           "FusedRope", "attention_plan", "paged_attention", "paged_attention_ref"]
