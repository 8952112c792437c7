"""The Triton kernels of :mod:`mrv2_kernels.paged_attention` (its docstring describes them
and their plans; the launcher, :func:`~mrv2_kernels.paged_attention.paged_attention`, lives
there): ``_paged_attn_kernel`` (prefill / mixed and split decode programs over the paged
cache, with the fused RoPE, sliding window, chunked local attention, soft-cap and sinks) and
``_combine_splits_kernel`` (a token's split partials into its output row).

Head dims: every tile is ``HEAD_DIM_P2`` wide (a power of two >= 16, what ``tl.arange`` and
``tl.dot`` take); a ``HEAD_DIM`` that is not one (80, 96, 160...) pads it (``PAD``, a
compile-time constant), every load and store of a head masked to its real ``HEAD_DIM``
columns, the padding read as zeros (adding nothing to a score, giving nothing to an output)
and never written. Power-of-2 head dims compile without those masks. The fused RoPE
(``ROPE``) takes power-of-2 head dims only (the launcher rotates others first)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import LOG2E_C as _LOG2E_C
from ._backend import M_INIT as _M_INIT
from ._backend import (
    kv_store_cast,
    pdl_prologue,
    pdl_release,
    pdl_wait,
)
from ._backend import online_softmax_step as _online_step
from .rotary import _norm_rotate


@triton.jit
def _head_mask(mask: tl.tensor, offs_d: tl.tensor, HEAD_DIM: tl.constexpr,
               PAD: tl.constexpr) -> tl.tensor:
    """``mask`` ``[R, 1]`` for a ``[R, HEAD_DIM_P2]`` tile of heads: with ``PAD``, also the
    columns past ``HEAD_DIM`` off; without, ``mask`` itself (no extra work)."""
    if PAD:  # noqa: SIM108 (a constexpr branch: nothing compiled without PAD)
        out = mask & (offs_d < HEAD_DIM)[None, :]
    else:
        out = mask
    return out


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


@triton.jit
def _masked_keys(
    q: tl.tensor, acc: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, k_ptr: tl.tensor,
    v_ptr: tl.tensor, bt_row: tl.tensor, lo: tl.tensor, hi: tl.tensor, seq_len: tl.tensor,
    pos: tl.tensor, first_pos: tl.tensor, window: tl.tensor, key_lo: tl.tensor,
    row_lo: tl.tensor, head_off: tl.tensor, stride_kb: tl.tensor, stride_ks: tl.tensor,
    qk_scale: tl.tensor, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr, FP32_PRECISION: tl.constexpr, CAP: tl.constexpr,
    SLIDING: tl.constexpr, CHUNK: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The key tiles ``[lo, hi)`` with every score masked: keys past ``seq_len`` or a row's
    position, before a row's window (``SLIDING``: ``pos - window + 1``, the tile's first row
    ``first_pos``) or its chunk (``CHUNK``: ``row_lo`` ``[BLOCK_M]``, the tile's lowest
    ``key_lo``), whose keys are not read either; columns past ``HEAD_DIM`` (a padded tile)
    read as zeros. Returns ``(acc, m_i, l_i)``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    PAD: tl.constexpr = HEAD_DIM_P2 != HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < seq_len
        if SLIDING:  # keys before every row's window are not read (their blocks may be gone)
            n_ok &= n > first_pos - window
        if CHUNK > 0:  # nor keys before every row's chunk
            n_ok &= n >= key_lo
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (
            blk[:, None] * stride_kb
            + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
            + head_off
            + offs_d[None, :]
        )
        kv_ok = _head_mask(n_ok[:, None], offs_d, HEAD_DIM, PAD)
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:  # an fp8 cache: the dots run in fp16 (e4m3 -> f16 is one cvt a pair)
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        visible = n[None, :] <= pos[:, None]
        if SLIDING:
            visible &= n[None, :] > pos[:, None] - window
        if CHUNK > 0:
            visible &= n[None, :] >= row_lo[:, None]
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, visible, True, DOT_FP32,
                                     FP32_PRECISION, CAP)
    return acc, m_i, l_i


@triton.jit
def _flat_tile(
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, num_reqs: tl.tensor, num_tiles: tl.tensor,
    tiles_last_keys: tl.tensor, BLOCK_Q: tl.constexpr, REQ_BLOCK: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """``(request, query tile, kv head x split)`` of this program of the flat grid: a 1-D grid
    of ``num_tiles`` flat query tiles (``flat_query_tile``'s numbering, the last ones, the
    heaviest, first) x kv heads x splits, in one of two orders picked per step on the device:
    the tile axis slowest where the step's longest sequence has at most ``tiles_last_keys``
    keys (the whole grid starts with its heaviest tiles: the best tail), else the kv-head axis
    slowest (the programs running at once read the keys of one or two kv heads, not every
    head's: at long contexts every head's keys overflow the L2 cache). Every program takes the
    same order (the same loads); the request search runs for both candidate tiles over the
    same loads, so the choice adds no memory round trip."""
    pid = tl.program_id(0)
    n_hs = tl.num_programs(0) // num_tiles
    t_last = num_tiles - 1 - pid // n_hs  # the tile axis slowest
    t_first = num_tiles - 1 - pid % num_tiles  # the kv-head axis slowest
    count_l = tl.full([], 0, tl.int32)
    start_l = tl.full([], 0, tl.int32)
    count_f = tl.full([], 0, tl.int32)
    start_f = tl.full([], 0, tl.int32)
    longest = tl.full([], 0, tl.int32)
    for c in range(0, num_reqs, REQ_BLOCK):
        i = c + tl.arange(0, REQ_BLOCK)
        ok = i < num_reqs
        first = tl.load(qsl_ptr + i, mask=ok, other=0) // BLOCK_Q + i
        longest = tl.maximum(longest, tl.max(tl.load(seq_lens_ptr + i, mask=ok, other=0), 0))
        seen = ok & (first <= t_last)
        count_l += tl.sum(seen.to(tl.int32), axis=0)
        start_l = tl.maximum(start_l, tl.max(tl.where(seen, first, 0), axis=0))
        seen = ok & (first <= t_first)
        count_f += tl.sum(seen.to(tl.int32), axis=0)
        start_f = tl.maximum(start_f, tl.max(tl.where(seen, first, 0), axis=0))
    last = longest <= tiles_last_keys
    req = tl.where(last, count_l, count_f) - 1
    q_tile = tl.where(last, t_last - start_l, t_first - start_f)
    pid_hs = tl.where(last, pid % n_hs, pid // num_tiles)
    return req, q_tile, pid_hs


@triton.jit(do_not_specialize=["num_q_tiles", "num_splits", "num_tokens", "num_reqs",
                                  "tiles_last_keys"])
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
    HEAD_DIM_P2: tl.constexpr,
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
    CHUNK: tl.constexpr = 0,
    TILES_LAST: tl.constexpr = False,
    tiles_last_keys: tl.tensor = 0,
) -> None:
    # Heaviest query tiles (latest positions) first: better tail balance in causal prefill.
    # FLAT: a 1-D grid over the step's query tiles x kv heads x splits, its order picked on
    # the device per step (_flat_tile; its tile and head found with the step's metadata
    # below). TILES_LAST (the (tile, request) grid): the grid is (kv head x split, request,
    # query tile) rather than (query tile, kv head x split, request): blocks are dispatched in
    # grid order (x fastest), so the whole grid starts with the last tiles.
    if TILES_LAST and not FLAT:
        tile_pid = tl.program_id(2)
        pid_hs = tl.program_id(0)
        req = tl.program_id(1)
    else:  # (FLAT: replaced by _flat_tile's)
        tile_pid = tl.program_id(0)
        pid_hs = tl.program_id(1)
        req = tl.program_id(2)
    q_tile = num_q_tiles - 1 - tile_pid
    offs_d = tl.arange(0, HEAD_DIM_P2)  # the head's columns: HEAD_DIM real, the rest padding
    PAD: tl.constexpr = HEAD_DIM_P2 != HEAD_DIM
    tl.static_assert(not (ROPE and PAD), "the fused RoPE takes power-of-2 head dims only")
    HALF: tl.constexpr = HEAD_DIM // 2
    KV_FP8: tl.constexpr = k_ptr.dtype.element_ty == tl.float8e4nv
    rows = tl.arange(0, BLOCK_M)
    grp = rows % GROUP_P2
    t_new = tl.arange(0, BLOCK_Q)
    if EARLY_META or ROPE:  # the request's query range and length before the wait
        # (pdl_early_meta's rule: no PDL kernel writes step metadata or constant tables)
        pdl_release(PDL)
        if FLAT:
            req, q_tile, pid_hs = _flat_tile(qsl_ptr, seq_lens_ptr, num_reqs, num_q_tiles,
                                             tiles_last_keys, BLOCK_Q, REQ_BLOCK)
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
            req, q_tile, pid_hs = _flat_tile(qsl_ptr, seq_lens_ptr, num_reqs, num_q_tiles,
                                             tiles_last_keys, BLOCK_Q, REQ_BLOCK)
    kvh = pid_hs // num_splits
    split = pid_hs % num_splits
    head = kvh * GROUP + grp

    if ZERO_PAD:  # rows of padding tokens (past query_start_loc[num_reqs]) become zeros:
        # spread over all programs, so no memset launch is needed before the kernel
        num_real = tl.load(qsl_ptr + num_reqs)
        pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) \
            * tl.num_programs(0) + tl.program_id(0)
        step = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        for t in range(num_real + pid, num_tokens, step):
            for h in range(0, num_heads):
                row64 = tl.full([], 0, tl.int64) + t  # int64 offsets (t may be a Python int)
                zeros = tl.zeros([HEAD_DIM_P2], dtype=out_ptr.dtype.element_ty)
                if PAD:
                    tl.store(out_ptr + row64 * stride_ot + h * stride_oh + offs_d, zeros,
                             mask=offs_d < HEAD_DIM)
                else:
                    tl.store(out_ptr + row64 * stride_ot + h * stride_oh + offs_d, zeros)

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
        q = tl.load(q_ptrs + offs_d[None, :],
                    mask=_head_mask(row_valid[:, None], offs_d, HEAD_DIM, PAD), other=0.0)
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
    key_lo = kv_start
    row_lo = pos
    if CHUNK > 0:  # chunked local attention: a row sees keys from its chunk's start on; the
        # tile's first row's chunk starts first (whole tiles before it are skipped)
        key_lo = (tl.maximum(ctx_len + tile_start, 0) // CHUNK) * CHUNK
        kv_start = (key_lo // BLOCK_N) * BLOCK_N
        row_lo = (pos // CHUNK) * CHUNK
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
    fast = lo
    if CHUNK > 0:  # the unmasked tiles start at the tile's last row's chunk (a query tile
        # across a chunk boundary: its rows' chunks start apart), the ones before are masked
        last_row = ctx_len + tl.minimum(tile_start + BLOCK_Q, qlen) - 1
        fast = tl.cdiv((last_row // CHUNK) * CHUNK, BLOCK_N) * BLOCK_N
        fast = tl.minimum(tl.maximum(fast, lo), hi)
        mid = fast + (tl.maximum(full_end - fast, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    if SINKS:  # a key of each head's own, valued zero, at its learned score (gpt-oss): in the
        # running max and sum from the start, once per row (by split 0 of a split row)
        sink = tl.load(sinks_ptr + head, mask=grp < GROUP, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink * _LOG2E_C, m_i)
        l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), l_i)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    head_off = kvh.to(tl.int64) * stride_kh

    if CHUNK > 0:
        acc, m_i, l_i = _masked_keys(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, lo, fast, seq_len,
                                     pos, ctx_len + tile_start, window, key_lo, row_lo,
                                     head_off, stride_kb, stride_ks, qk_scale, BLOCK_N,
                                     HEAD_DIM, HEAD_DIM_P2, KV_BLOCK_SIZE, DOT_FP32, KV_FP8,
                                     FP32_PRECISION, CAP, SLIDING, CHUNK)
    for start in range(fast, mid, BLOCK_N):
        n = start + offs_n
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE).to(tl.int64)
        kv_off = (
            blk[:, None] * stride_kb
            + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
            + head_off
            + offs_d[None, :]
        )
        if PAD:  # (the padding columns only: these keys are all real)
            k = tl.load(k_ptr + kv_off, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
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

    acc, m_i, l_i = _masked_keys(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, mid, hi, seq_len, pos,
                                 ctx_len + tile_start, window, key_lo, row_lo, head_off,
                                 stride_kb, stride_ks, qk_scale, BLOCK_N, HEAD_DIM, HEAD_DIM_P2,
                                 KV_BLOCK_SIZE, DOT_FP32, KV_FP8, FP32_PRECISION, CAP, SLIDING,
                                 CHUNK)

    row_ok = _head_mask(row_valid[:, None], offs_d, HEAD_DIM, PAD)
    if USE_SPLITS:
        part = (q_row * num_heads + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_ok,
        )
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok,
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
    HEAD_DIM_P2: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_P2)  # (a padded head: the columns past HEAD_DIM masked)
    PAD: tl.constexpr = HEAD_DIM_P2 != HEAD_DIM
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
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=_head_mask(s_ok[:, None], offs_d, HEAD_DIM, PAD), other=0.0
    )
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)
    l_tot = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0)
    l_tot = tl.where(l_tot > 0.0, l_tot, 1.0)
    o = tl.where(tok < num_real, o / l_tot, 0.0)  # padding token: zeros, whatever it read
    if PAD:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    else:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty))
