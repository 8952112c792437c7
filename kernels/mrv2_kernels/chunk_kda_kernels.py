"""The Triton kernels of the chunked gated delta rule with a decay per key channel (Kimi Delta
Attention, ``g`` ``[T, Hv, K]``): :mod:`mrv2_kernels.chunk_delta_rule`'s algebra with the
scalar ``exp(G_i - G_j)`` replaced by a diagonal one, ``diag(exp(G_i - G_j))`` (``G`` the
per-channel cumulative log decay from the chunk's first token), launched by
:func:`mrv2_kernels.chunk_delta_rule.chunk_gated_delta_rule_triton` for a 3-D ``g``.

Per chunk, state ``S`` ``[K, V]`` at its start, ``*`` a per-channel product::

    A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)  (i > j),   P_ij = same with q_i  (i >= j)
    W_k = T (beta exp(G) * K),  W_v = T (beta V),  U = W_v - W_k S,  T = (I + A)^-1
    O = (exp(G) * Q) S + P U,   S' = exp(G_last) * S + (exp(G_last - G) * K)^T U

**Numerical range.** A per-channel decay does not factor out of ``sum_c``, and ``exp(-G)``
overflows fp32 once a chunk's decay passes ``exp(-88)`` (Kimi's decays reach ``exp(-20)`` a
token). So, as the fla library's ``chunk_kda``, the chunk is split into ``SUB``-token blocks:
a block below the diagonal (rows in block ``b``, columns before it) is one product of ``q_i
exp(G_i - G_r)`` and ``k_j exp(G_r - G_j)`` with ``r`` block ``b``'s first token (both
exponents ``<= 0``); a diagonal block is summed per channel, a column of every block at a
time (``SUB`` steps of ``[C, BLOCK_K]`` vector work), the exponent ``G_ic - G_jc <= 0``
masked before the ``exp``. No ``exp`` of a positive number is formed anywhere (dead rows'
exponents masked too: ``G`` is not stored there).

Four launches (all PDL; none writes step metadata): :func:`_kda_gates_kernel` (the gates
from the raw projections where given, ``G`` by a ``tl.cumsum`` per chunk, into fp32 scratch
``[T, Hv, K]``, and ``beta`` into ``[T, Hv]``; the later kernels read those), then the WY
kernel, the state scan and the output kernel, the scalar path's split and grids
(:mod:`mrv2_kernels.chunk_delta_rule_kernels`)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import pdl_prologue
from .chunk_delta_rule_kernels import _flat_chunk, _inverse_diagonal_blocks, _load_rows
from .linear_attention import raw_gates
from .recurrent_state import _zero_tail


@triton.jit(do_not_specialize=["num_seqs", "min_len"])
def _kda_gates_kernel(
    g_ptr: tl.tensor, beta_ptr: tl.tensor, a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor,
    gc_ptr: tl.tensor, bt_ptr: tl.tensor, qsl_ptr: tl.tensor, num_seqs: int, min_len: int,
    dim_k: int, g_st: int, g_sh: int, g_sk: int, b_st: int, b_sh: int, gc_st: int,
    gc_sh: int, bt_st: int,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, REQ_BLOCK: tl.constexpr,
    RAW_GATES: tl.constexpr, PDL: tl.constexpr,
) -> None:
    """Program ``(chunk, v head)``: the chunk's ``beta`` (``sigmoid`` of the raw ``b`` with
    ``RAW_GATES``) and per key channel ``G = cumsum(g)`` from its first token (``g =
    -exp(A_log[h]) softplus(a + dt_bias[h])`` with ``RAW_GATES``: the token-serial kernel's
    arithmetic), fp32, live rows only."""
    pdl_prologue(PDL)
    h = tl.program_id(1)
    first, n = _flat_chunk(qsl_ptr, num_seqs, tl.program_id(0), min_len, CHUNK, REQ_BLOCK)
    if n <= 0:
        return
    pos = tl.arange(0, CHUNK)
    live = pos < n
    t64 = first.to(tl.int64) + pos
    bv = tl.load(beta_ptr + t64 * b_st + h * b_sh, mask=live, other=0.0).to(tl.float32)
    neg_a = 0.0
    if RAW_GATES:
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        bv = 1.0 / (1.0 + tl.exp(-bv))
    tl.store(bt_ptr + t64 * bt_st + h, bv, mask=live)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < dim_k
        m2 = live[:, None] & kmask[None, :]
        gv = tl.load(g_ptr + t64[:, None] * g_st + h * g_sh + kk[None, :] * g_sk, mask=m2,
                     other=0.0).to(tl.float32)
        if RAW_GATES:
            dt_bias = tl.load(dt_bias_ptr + h * dim_k + kk, mask=kmask, other=0.0).to(
                tl.float32)
            gv = raw_gates(gv, gv, neg_a, dt_bias[None, :], 0.0, 0.0, False)[0]
        gcum = tl.cumsum(tl.where(m2, gv, 0.0), 0)
        tl.store(gc_ptr + t64[:, None] * gc_st + h * gc_sh + kk[None, :], gcum, mask=m2)


@triton.jit
def _decayed_gram(acc: tl.tensor, a: tl.tensor, b: tl.tensor, gk: tl.tensor,
                  b_base: tl.tensor, b_st: int, gc_base: tl.tensor, gc_st: int,
                  first64: tl.tensor, kk: tl.tensor, kmask: tl.tensor, n: tl.tensor,
                  CHUNK: tl.constexpr, SUB: tl.constexpr, INCLUSIVE: tl.constexpr,
                  PREC: tl.constexpr) -> tl.tensor:
    """Triton helper: ``acc`` ``[C, C]`` plus one K block's share of ``sum_c a_ic b_jc
    exp(G_ic - G_jc)`` for ``j < i`` (``INCLUSIVE``: ``j <= i``), zero elsewhere. ``a``,
    ``b``, ``gk``: the block's ``[C, BLOCK_K]`` rows of the chunk (dead rows' ``a`` / ``b``
    zero; ``gk``'s there unread); ``b_base`` / ``gc_base`` (rows ``first64 + j``, strides
    ``b_st`` / ``gc_st``, columns ``kk``): the same rows again, gathered a column per diagonal
    block (the module docstring's split)."""
    pos = tl.arange(0, CHUNK)
    live = pos < n
    blk = pos // SUB
    for bi in tl.static_range(1, CHUNK // SUB):
        r = bi * SUB  # block bi's first row: the reference of its products with earlier rows
        g_r = tl.sum(tl.where(pos[:, None] == r, gk, 0.0), axis=0)
        rows = ((blk == bi) & live)[:, None]
        left = tl.where(rows, a * tl.exp(tl.where(rows, gk - g_r[None, :], 0.0)), 0.0)
        cols = ((pos < r) & (r < n))[:, None]
        right = tl.where(cols, b * tl.exp(tl.where(cols, g_r[None, :] - gk, 0.0)), 0.0)
        acc = tl.dot(left, tl.trans(right), acc, input_precision=PREC)
    ci = pos[None, :]
    for jj in range(0, SUB):
        jrow = blk * SUB + jj  # column jj of each row's own diagonal block
        if INCLUSIVE:  # noqa: SIM108 (a constexpr branch)
            on = live & (pos >= jrow)
        else:
            on = live & (pos > jrow)
        m2 = (jrow < n)[:, None] & kmask[None, :]
        t_j = first64 + jrow
        bj = _load_rows(b_base, t_j, b_st, kk, m2)
        gj = tl.load(gc_base + t_j[:, None] * gc_st + kk[None, :], mask=m2, other=0.0)
        val = tl.sum(a * bj * tl.exp(tl.where(on[:, None], gk - gj, 0.0)), axis=1)
        acc += tl.where((ci == jrow[:, None]) & on[:, None], val[:, None], 0.0)
    return acc


@triton.jit(do_not_specialize=["num_seqs", "min_len"])
def _kda_wy_kernel(
    k_ptr: tl.tensor, v_ptr: tl.tensor, gc_ptr: tl.tensor, bt_ptr: tl.tensor,
    wk_ptr: tl.tensor, wv_ptr: tl.tensor, t_ptr: tl.tensor, qsl_ptr: tl.tensor,
    num_seqs: int, min_len: int, dim_k: int, dim_v: int, group: int,
    k_st: int, k_sh: int, v_st: int, v_sh: int, gc_st: int, gc_sh: int, bt_st: int,
    wk_st: int, wk_sh: int, wv_st: int, wv_sh: int, t_sc: int, t_sh: int,
    L2NORM: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, LOG2_BLOCKS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, REQ_BLOCK: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Program ``(chunk, v head)``: ``A`` (:func:`_decayed_gram` of the raw keys, their l2
    norms scaling rows and columns), ``T = (I + A)^-1`` as the scalar path's WY kernel forms
    it, ``W_k = T (beta exp(G) * K)`` and ``W_v = T (beta V)``."""
    pdl_prologue(PDL)
    h = tl.program_id(1)
    slot = tl.program_id(0)
    first, n = _flat_chunk(qsl_ptr, num_seqs, slot, min_len, CHUNK, REQ_BLOCK)
    if n <= 0:
        return
    pos = tl.arange(0, CHUNK)
    live = pos < n
    first64 = first.to(tl.int64)
    t64 = first64 + pos
    k_base = k_ptr + (h // group) * k_sh
    gc_base = gc_ptr + h * gc_sh
    kkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    ss = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < dim_k
        m2 = live[:, None] & kmask[None, :]
        k = _load_rows(k_base, t64, k_st, kk, m2)
        gk = tl.load(gc_base + t64[:, None] * gc_st + kk[None, :], mask=m2, other=0.0)
        ss += tl.sum(k * k, axis=1)
        kkt = _decayed_gram(kkt, k, k, gk, k_base, k_st, gc_base, gc_st, first64, kk, kmask,
                            n, CHUNK, SUB, False, PREC)
    rk = ss * 0.0 + 1.0
    if L2NORM:
        rk = tl.rsqrt(ss + 1e-6)
    beta = tl.load(bt_ptr + t64 * bt_st + h, mask=live, other=0.0)
    ri = pos[:, None]
    ci = pos[None, :]
    a = tl.where(ri > ci, kkt * (beta * rk)[:, None] * rk[None, :], 0.0)
    # T = (I + A)^-1: the scalar path's (chunk_delta_rule_kernels._chunk_wy_kernel)
    t_base = t_ptr + slot.to(tl.int64) * t_sc + h * t_sh
    tl.store(t_base + ri * CHUNK + ci, a)
    tl.debug_barrier()
    _inverse_diagonal_blocks(t_base, CHUNK, SUB)
    tl.debug_barrier()
    same = (ri // SUB) == (ci // SUB)
    d_inv = tl.load(t_base + ri * CHUNK + ci, mask=same, other=0.0)
    eye = tl.where(ri == ci, 1.0, 0.0)
    n_pow = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision=PREC)
    t_inv = eye - n_pow
    for _ in tl.static_range(LOG2_BLOCKS - 1):
        n_pow = tl.dot(n_pow, n_pow, input_precision=PREC)
        t_inv = tl.dot(t_inv, eye + n_pow, input_precision=PREC)
    t_inv = tl.dot(t_inv, d_inv, input_precision=PREC)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        m2 = live[:, None] & (kk < dim_k)[None, :]
        gk = tl.load(gc_base + t64[:, None] * gc_st + kk[None, :], mask=m2, other=0.0)
        kb = _load_rows(k_base, t64, k_st, kk, m2) * (rk * beta)[:, None] * tl.exp(gk)
        wk = tl.dot(t_inv, kb, input_precision=PREC)
        tl.store(wk_ptr + t64[:, None] * wk_st + h * wk_sh + kk[None, :], wk, mask=m2)
    for v0 in range(0, dim_v, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        vmask = live[:, None] & (vv < dim_v)[None, :]
        vb = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, vmask) * beta[:, None]
        wv = tl.dot(t_inv, vb, input_precision=PREC)
        tl.store(wv_ptr + t64[:, None] * wv_st + h * wv_sh + vv[None, :], wv, mask=vmask)


@triton.jit
def _kda_state_after(c: tl.tensor, s: tl.tensor, k: tl.tensor, rk: tl.tensor, gk: tl.tensor,
                     pos: tl.tensor, u: tl.tensor, PREC: tl.constexpr) -> tl.tensor:
    """Triton helper: the state after the chunk's first ``c`` tokens (``0 < c <= n``):
    ``exp(G_{c-1}) * S + sum_{j<c} (exp(G_{c-1} - G_j) * k_j) u_j^T`` (``k`` raw ``[C, K]``,
    ``rk`` its norms' inverses, ``gk`` ``[C, K]``, ``U`` ``[C, BLOCK_V]``)."""
    g_ref = tl.sum(tl.where(pos[:, None] == c - 1, gk, 0.0), axis=0)  # [K]
    before = (pos < c)[:, None]
    ks = tl.where(before, rk[:, None] * tl.exp(tl.where(before, g_ref[None, :] - gk, 0.0)), 0.0)
    return tl.dot(tl.trans(k * ks), u, s * tl.exp(g_ref)[:, None], input_precision=PREC)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "min_len"])
def _kda_state_kernel(
    k_ptr: tl.tensor, v_ptr: tl.tensor, gc_ptr: tl.tensor, bt_ptr: tl.tensor,
    wk_ptr: tl.tensor, u_ptr: tl.tensor, h_ptr: tl.tensor, state_ptr: tl.tensor,
    out_ptr: tl.tensor, qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor,
    tbl_ptr: tl.tensor, num_seqs: int, num_tokens: int, min_len: int, dim_k: int,
    dim_v: int, group: int, k_st: int, k_sh: int, v_st: int, v_sh: int, gc_st: int,
    gc_sh: int, bt_st: int, wk_st: int, wk_sh: int, u_st: int, u_sh: int, h_sc: int,
    h_sh: int, o_st: int, o_sh: int, s_sr: int, s_sh: int, s_sk: int, tbl_st: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, CHUNK: tl.constexpr, BLOCK_KF: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
    HAS_TABLE: tl.constexpr, ROW_SLOTS: tl.constexpr, PDL: tl.constexpr,
) -> None:
    """Program ``(i < N, v head, V block)``: the scalar path's state scan
    (:func:`~mrv2_kernels.chunk_delta_rule_kernels._chunk_state_kernel`: the initial state,
    snapshots, ``row_slots``' kept states, the final row) with per-channel decays: ``U = W_v
    - W_k S`` (``DELTA``; else ``beta V``), ``S' = exp(G_last) * S + (exp(G_last - G) *
    K)^T U``. Programs ``(N, ...)`` zero the output's padding tokens."""
    pdl_prologue(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < dim_v
    if seq == num_seqs:
        _zero_tail(out_ptr + h * o_sh, qsl_ptr, num_seqs, num_tokens, o_st, vv, vmask,
                   BLOCK_T, BLOCK_V)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int32) - bos
    if (length <= 0) | (length < min_len):  # padding, or the token-serial kernel's
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - length
    row = tl.load(rows_ptr + seq).to(tl.int64)
    base = row * ROW_SLOTS
    dst = base + (start + length) % ROW_SLOTS
    src_row = base + start % ROW_SLOTS
    if HAS_TABLE:
        tbl = tbl_ptr + row * tbl_st
        src_row = tl.where(start == tl.load(tbl + 1), tl.load(tbl).to(tl.int64), src_row)
    kf = tl.arange(0, BLOCK_KF)
    kmask = kf < dim_k
    smask = kmask[:, None] & vmask[None, :]
    tile = h * s_sh + kf[:, None] * s_sk + vv[None, :]
    s = tl.load(state_ptr + src_row * s_sr + tile, mask=smask & (start > 0), other=0.0)
    h_tile = h * h_sh + kf[:, None] * dim_v + vv[None, :]
    k_base = k_ptr + (h // group) * k_sh
    gc_base = gc_ptr + h * gc_sh
    slot = (bos // CHUNK + seq).to(tl.int64)
    pos = tl.arange(0, CHUNK)
    for c0 in range(0, length, CHUNK):
        n = tl.minimum(length - c0, CHUNK)
        live = pos < n
        t64 = (bos + c0).to(tl.int64) + pos
        m2 = live[:, None] & kmask[None, :]
        tl.store(h_ptr + slot * h_sc + h_tile, s.to(h_ptr.dtype.element_ty), mask=smask)
        slot += 1
        ovmask = live[:, None] & vmask[None, :]
        if DELTA:  # (W_k before the keys and G: one [C, K] tile fewer live at a time)
            w = _load_rows(wk_ptr + h * wk_sh, t64, wk_st, kf, m2)
            u_rows = u_ptr + t64[:, None] * u_st + h * u_sh + vv[None, :]
            u = tl.load(u_rows, mask=ovmask, other=0.0) - tl.dot(w, s, input_precision=PREC)
            tl.store(u_rows, u, mask=ovmask)
        else:
            beta = tl.load(bt_ptr + t64 * bt_st + h, mask=live, other=0.0)
            u = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, ovmask) * beta[:, None]
        kc = _load_rows(k_base, t64, k_st, kf, m2)
        gk = tl.load(gc_base + t64[:, None] * gc_st + kf[None, :], mask=m2, other=0.0)
        if L2NORM:  # noqa: SIM108 (a constexpr branch)
            rk = tl.rsqrt(tl.sum(kc * kc, axis=1) + 1e-6)
        else:
            rk = tl.sum(kc * 0.0, axis=1) + 1.0
        if HAS_TABLE:
            for i in tl.static_range(2):
                c = tl.load(tbl + 2 + 2 * i) - start - c0
                if (c > 0) & (c <= n):
                    snap = state_ptr + tl.load(tbl + 3 + 2 * i).to(tl.int64) * s_sr + tile
                    tl.store(snap, _kda_state_after(c, s, kc, rk, gk, pos, u, PREC),
                             mask=smask)
        if ROW_SLOTS > 1:
            lo = tl.maximum(length - ROW_SLOTS + 1, c0 + 1)
            for c in range(lo, tl.minimum(length - 1, c0 + n) + 1):
                kept = state_ptr + (base + (start + c) % ROW_SLOTS) * s_sr + tile
                tl.store(kept, _kda_state_after(c - c0, s, kc, rk, gk, pos, u, PREC),
                         mask=smask)
        s = _kda_state_after(n, s, kc, rk, gk, pos, u, PREC)
    tl.store(state_ptr + dst * s_sr + tile, s, mask=smask)


@triton.jit(do_not_specialize=["num_seqs", "min_len"])
def _kda_out_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, gc_ptr: tl.tensor,
    bt_ptr: tl.tensor, u_ptr: tl.tensor, h_ptr: tl.tensor, out_ptr: tl.tensor,
    qsl_ptr: tl.tensor, skip_ptr: tl.tensor, num_seqs: int, min_len: int, scale: float,
    dim_k: int, dim_v: int, group: int, q_st: int, q_sh: int, k_st: int, k_sh: int,
    v_st: int, v_sh: int, gc_st: int, gc_sh: int, bt_st: int, u_st: int, u_sh: int,
    h_sc: int, h_sh: int, o_st: int, o_sh: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, REQ_BLOCK: tl.constexpr,
    PREC: tl.constexpr, HAS_SKIP: tl.constexpr, PDL: tl.constexpr,
) -> None:
    """Program ``(chunk, v head, V block)``: ``O = (exp(G) * Q) S_c + P U`` with ``S_c`` the
    chunk's initial state (the scan's) and ``P`` :func:`_decayed_gram` of the raw q and k
    (inclusive), scaled by their norms; ``U`` the scan's (``DELTA``) or ``beta V``."""
    pdl_prologue(PDL)
    h = tl.program_id(1)
    slot = tl.program_id(0)
    first, n = _flat_chunk(qsl_ptr, num_seqs, slot, min_len, CHUNK, REQ_BLOCK)
    if n <= 0:
        return
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < dim_v
    pos = tl.arange(0, CHUNK)
    live = pos < n
    first64 = first.to(tl.int64)
    t64 = first64 + pos
    q_base = q_ptr + (h // group) * q_sh
    k_base = k_ptr + (h // group) * k_sh
    gc_base = gc_ptr + h * gc_sh
    h_base = h_ptr + slot.to(tl.int64) * h_sc + h * h_sh
    qkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    qs = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    q_ss = tl.zeros([CHUNK], dtype=tl.float32)
    k_ss = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < dim_k
        m2 = live[:, None] & kmask[None, :]
        q = _load_rows(q_base, t64, q_st, kk, m2)
        k = _load_rows(k_base, t64, k_st, kk, m2)
        gk = tl.load(gc_base + t64[:, None] * gc_st + kk[None, :], mask=m2, other=0.0)
        q_ss += tl.sum(q * q, axis=1)
        k_ss += tl.sum(k * k, axis=1)
        qkt = _decayed_gram(qkt, q, k, gk, k_base, k_st, gc_base, gc_st, first64, kk, kmask,
                            n, CHUNK, SUB, True, PREC)
        s = tl.load(h_base + kk[:, None] * dim_v + vv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        qs = tl.dot(q * tl.exp(gk), s, qs, input_precision=PREC)
    if L2NORM:
        rq = tl.rsqrt(q_ss + 1e-6) * scale
        rk = tl.rsqrt(k_ss + 1e-6)
    else:
        rq = q_ss * 0.0 + scale
        rk = k_ss * 0.0 + 1.0
    ovmask = live[:, None] & vmask[None, :]
    if (not DELTA) or HAS_SKIP:
        vt = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, ovmask)
    if DELTA:  # noqa: SIM108 (a constexpr branch)
        u = _load_rows(u_ptr + h * u_sh, t64, u_st, vv, ovmask)
    else:
        u = vt * tl.load(bt_ptr + t64 * bt_st + h, mask=live, other=0.0)[:, None]
    p = qkt * rq[:, None] * rk[None, :]
    o = tl.dot(p, u, qs * rq[:, None], input_precision=PREC)
    if HAS_SKIP:
        o += tl.load(skip_ptr + h).to(tl.float32) * vt
    tl.store(out_ptr + t64[:, None] * o_st + h * o_sh + vv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=ovmask)
