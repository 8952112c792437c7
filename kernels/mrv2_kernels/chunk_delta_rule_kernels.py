"""The Triton kernels of :mod:`mrv2_kernels.chunk_delta_rule` (its docstring has the algebra
and the design; its wrappers launch them): the WY kernel (``T = (I + A)^-1`` and ``W_k``,
``W_v`` per chunk, parallel over chunks), the state scan (the chunks of a sequence in order,
the state tile in registers: ``U = W_v - W_k S``, the state's update, snapshots) and the output
kernel (``O = (exp(G) Q) S_c + P U`` per chunk, parallel over chunks)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import flat_query_tile, pdl_prologue
from .linear_attention import raw_gates
from .recurrent_state import _zero_tail


@triton.jit
def _load_rows(ptr: tl.tensor, t64: tl.tensor, row_stride: int, cols: tl.tensor,
               mask: tl.tensor) -> tl.tensor:
    """Triton helper: rows ``t64`` (``[C]``, int64) of a row-strided matrix at ``ptr``, columns
    ``cols``, where ``mask`` (``[C, BLOCK]``), as fp32 (converted at once); zeros elsewhere."""
    src = ptr + t64[:, None] * row_stride + cols[None, :]
    return tl.load(src, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_gates(g_ptr: tl.tensor, beta_ptr: tl.tensor, a_log_ptr: tl.tensor,
                dt_bias_ptr: tl.tensor, t64: tl.tensor, h: tl.tensor, live: tl.tensor,
                g_st: int, g_sh: int, b_st: int, b_sh: int, dt_lo: float, dt_hi: float,
                RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr
                ) -> tuple[tl.tensor, tl.tensor]:
    """Triton helper: the log decay ``g`` and write strength ``beta`` (fp32 ``[C]``) of rows
    ``t64`` for v head ``h``, zero on dead rows (so a ``cumsum``'s last entry is the chunk's
    total). ``RAW_GATES``: ``g`` / ``beta`` hold the raw projections, turned into gates as
    :func:`~mrv2_kernels.linear_attention.gates_from_logits` (``MAMBA_GATES``:
    :func:`~mrv2_kernels.linear_attention.mamba_gates` of the raw ``dt`` in ``g``), the same
    arithmetic as the token-serial kernel's."""
    gv = tl.load(g_ptr + t64 * g_st + h * g_sh, mask=live, other=0.0).to(tl.float32)
    if MAMBA_GATES:  # (beta is the step: the same raw dt)
        bv = gv
    else:
        bv = tl.load(beta_ptr + t64 * b_st + h * b_sh, mask=live, other=0.0).to(tl.float32)
    if RAW_GATES:
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        gv, bv = raw_gates(gv, bv, neg_a, dt_bias, dt_lo, dt_hi, MAMBA_GATES)
    return tl.where(live, gv, 0.0), tl.where(live, bv, 0.0)


@triton.jit
def _flat_chunk(qsl_ptr: tl.tensor, num_seqs: tl.tensor, slot: tl.tensor, min_len: tl.tensor,
                CHUNK: tl.constexpr, REQ_BLOCK: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """Triton helper: ``(first token, tokens from it to its sequence's end)`` of the step's
    flat chunk ``slot`` (:func:`~mrv2_kernels._backend.flat_query_tile`'s numbering: sequence
    ``i``'s chunks from ``query_start_loc[i] // CHUNK + i``); the count is ``<= 0`` past a
    sequence's chunks or in a sequence of fewer than ``min_len`` tokens (the token-serial
    kernel's), and more than ``CHUNK`` before its last."""
    seq, c = flat_query_tile(qsl_ptr, num_seqs, slot, CHUNK, REQ_BLOCK)
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int32)
    first = bos + c * CHUNK
    return first, tl.where(eos - bos < min_len, 0, eos - first)


@triton.jit
def _inverse_diagonal_blocks(t_base: tl.tensor, CHUNK: tl.constexpr, SUB: tl.constexpr
                             ) -> None:
    """Triton helper: each ``[SUB, SUB]`` diagonal block ``I + A_bb`` of the ``[C, C]`` tile at
    ``t_base`` (``A`` strictly lower there) replaced by its inverse, all blocks at once, by
    forward substitution a row at a time: row ``r`` of ``D^-1`` is ``e_r - sum_{j<r} A_rj
    (D^-1)_j`` (fp32 vector arithmetic, exact as the algebra's). Held transposed,
    ``[block, column, j]``, so the sums run along the tile's last dim."""
    NB: tl.constexpr = CHUNK // SUB
    blk = tl.arange(0, NB)[:, None, None]
    col = tl.arange(0, SUB)[None, :, None]
    j = tl.arange(0, SUB)[None, None, :]
    d_t = tl.where((col == j) & (blk >= 0), 1.0, 0.0)  # [NB, SUB, SUB]: (D^-1)^T per block
    diag = t_base + (blk * SUB) * (CHUNK + 1)  # each block's top-left element
    for r in range(1, SUB):
        a_r = tl.load(diag + r * CHUNK + j)  # [NB, 1, SUB]: A_bb's row r
        new = tl.where(col == r, 1.0, 0.0) - tl.sum(a_r * d_t, axis=2, keep_dims=True)
        d_t = tl.where(j == r, new, d_t)
    tl.debug_barrier()  # every read of A_bb before its overwrite
    tl.store(diag + j * CHUNK + col, d_t)


@triton.jit(do_not_specialize=["num_seqs", "min_len"])
def _chunk_wy_kernel(
    k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor, beta_ptr: tl.tensor,
    wk_ptr: tl.tensor, wv_ptr: tl.tensor, t_ptr: tl.tensor, qsl_ptr: tl.tensor,
    a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor, dt_lo: float, dt_hi: float,
    num_seqs: int, min_len: int, dim_k: int, dim_v: int, group: int,
    k_st: int, k_sh: int, v_st: int, v_sh: int, g_st: int, g_sh: int, b_st: int, b_sh: int,
    wk_st: int, wk_sh: int, wv_st: int, wv_sh: int, t_sc: int, t_sh: int,
    L2NORM: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, LOG2_BLOCKS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, REQ_BLOCK: tl.constexpr, PREC: tl.constexpr,
    RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr, PDL: tl.constexpr,
) -> None:
    """Program ``(chunk, v head)`` over every chunk of the step: ``A`` from ``K K^T``, then
    ``T = (I + A)^-1``, then ``W_k = T (beta exp(G) K)`` and ``W_v = T (beta V)``. The
    inverse: the diagonal ``[SUB, SUB]`` blocks' by forward substitution in fp32 vector
    arithmetic (:func:`_inverse_diagonal_blocks`, through the program's ``[C, C]`` tile at
    ``t_ptr``), then the blocks below them as the finite series of ``N = D^-1 L`` (``L``:
    ``A``'s blocks below the diagonal), ``2 + 2 log2(C / SUB)`` ``[C, C]`` products."""
    pdl_prologue(PDL)
    h = tl.program_id(1)
    slot = tl.program_id(0)
    first, n = _flat_chunk(qsl_ptr, num_seqs, slot, min_len, CHUNK, REQ_BLOCK)
    if n <= 0:  # past the sequence's chunks (or a zero-length sequence)
        return
    pos = tl.arange(0, CHUNK)
    live = pos < n
    t64 = first.to(tl.int64) + pos
    k_base = k_ptr + (h // group) * k_sh
    # K K^T of the raw keys, over K blocks; the l2 norms scale its rows and columns.
    kkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    ss = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k = _load_rows(k_base, t64, k_st, kk, live[:, None] & (kk < dim_k)[None, :])
        ss += tl.sum(k * k, axis=1)
        kkt = tl.dot(k, tl.trans(k), kkt, input_precision=PREC)
    rk = ss * 0.0 + 1.0
    if L2NORM:
        rk = tl.rsqrt(ss + 1e-6)
    gv, beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, t64, h, live, g_st, g_sh,
                           b_st, b_sh, dt_lo, dt_hi, RAW_GATES, MAMBA_GATES)
    gcum = tl.cumsum(gv, 0)
    ri = pos[:, None]
    ci = pos[None, :]
    lower = ri > ci
    # A: strictly lower, decays masked before the exp
    decay = tl.exp(tl.where(lower, gcum[:, None] - gcum[None, :], 0.0))
    a = tl.where(lower, kkt * decay * (beta * rk)[:, None] * rk[None, :], 0.0)
    t_base = t_ptr + slot.to(tl.int64) * t_sc + h * t_sh
    tl.store(t_base + ri * CHUNK + ci, a)
    tl.debug_barrier()
    _inverse_diagonal_blocks(t_base, CHUNK, SUB)
    tl.debug_barrier()
    # T = (D + L)^-1 = (I + N)^-1 D^-1 with D the diagonal blocks (I + A_bb), L the blocks
    # below them and N = D^-1 L, strictly block-lower: N^NB = 0, so (I + N)^-1 = (I - N)
    # (I + N^2) (I + N^4) ... (2^k >= NB terms of the series, each block row's sum exact)
    same = (ri // SUB) == (ci // SUB)
    d_inv = tl.load(t_base + ri * CHUNK + ci, mask=same, other=0.0)
    eye = tl.where(ri == ci, 1.0, 0.0)
    n_pow = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision=PREC)  # N
    t_inv = eye - n_pow
    for _ in tl.static_range(LOG2_BLOCKS - 1):
        n_pow = tl.dot(n_pow, n_pow, input_precision=PREC)
        t_inv = tl.dot(t_inv, eye + n_pow, input_precision=PREC)
    t_inv = tl.dot(t_inv, d_inv, input_precision=PREC)
    kscale = rk * beta * tl.exp(gcum)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = live[:, None] & (kk < dim_k)[None, :]
        kb = _load_rows(k_base, t64, k_st, kk, kmask) * kscale[:, None]
        wk = tl.dot(t_inv, kb, input_precision=PREC)
        tl.store(wk_ptr + t64[:, None] * wk_st + h * wk_sh + kk[None, :], wk, mask=kmask)
    for v0 in range(0, dim_v, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        vmask = live[:, None] & (vv < dim_v)[None, :]
        vb = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, vmask) * beta[:, None]
        wv = tl.dot(t_inv, vb, input_precision=PREC)
        tl.store(wv_ptr + t64[:, None] * wv_st + h * wv_sh + vv[None, :], wv, mask=vmask)


@triton.jit
def _state_after(c: tl.tensor, s: tl.tensor, k: tl.tensor, rk: tl.tensor, gcum: tl.tensor,
                 pos: tl.tensor, u: tl.tensor, PREC: tl.constexpr) -> tl.tensor:
    """Triton helper: the state after the chunk's first ``c`` tokens (``0 < c <= n``), from its
    initial state ``s`` ``[K, BLOCK_V]``, the raw keys ``k`` ``[C, K]`` with their norms' inverses
    ``rk`` and ``U`` ``[C, BLOCK_V]`` (row ``j`` depends on tokens ``<= j`` only, so the whole
    chunk's serves): ``S_c = exp(G_{c-1}) S + sum_{j<c} exp(G_{c-1} - G_j) k_j u_j^T``."""
    g_ref = tl.sum(tl.where(pos == c - 1, gcum, 0.0), axis=0)
    before = pos < c
    ks = tl.where(before, rk * tl.exp(tl.where(before, g_ref - gcum, 0.0)), 0.0)
    return tl.dot(tl.trans(k * ks[:, None]), u, s * tl.exp(g_ref), input_precision=PREC)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "min_len"])
def _chunk_state_kernel(
    k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor, beta_ptr: tl.tensor,
    wk_ptr: tl.tensor, u_ptr: tl.tensor, h_ptr: tl.tensor, state_ptr: tl.tensor,
    out_ptr: tl.tensor, qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor,
    tbl_ptr: tl.tensor, a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor,
    dt_lo: float, dt_hi: float, num_seqs: int, num_tokens: int, min_len: int, dim_k: int,
    dim_v: int, group: int, k_st: int, k_sh: int, v_st: int, v_sh: int, g_st: int, g_sh: int,
    b_st: int, b_sh: int, wk_st: int, wk_sh: int, u_st: int, u_sh: int, h_sc: int, h_sh: int,
    o_st: int, o_sh: int, s_sr: int, s_sh: int, s_sk: int, tbl_st: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, CHUNK: tl.constexpr, BLOCK_KF: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
    HAS_TABLE: tl.constexpr, RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr,
    ROW_SLOTS: tl.constexpr, PDL: tl.constexpr,
) -> None:
    """Program ``(i < N, v head, V block)``: sequence ``i``'s chunks in order, the state tile
    ``[K, BLOCK_V]`` in registers (fp32). Per chunk: its initial state into the chunk's slot
    of ``h_ptr`` (for the output kernel), ``U = W_v - W_k S`` over ``W_v`` in ``u_ptr``
    (``DELTA``; else ``U = beta V`` is the output kernel's to form), the states the table and
    ``ROW_SLOTS`` keep inside the chunk, then ``S' = exp(G_last) S + (exp(G_last - G) K)^T U``.
    The final state goes to the final count's row. Programs ``(N, ...)`` zero the output's
    padding tokens."""
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
    # padding (its row and table entry may be another sequence's), or a sequence the
    # token-serial kernel runs (fewer than min_len tokens)
    if (length <= 0) | (length < min_len):
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - length
    row = tl.load(rows_ptr + seq).to(tl.int64)
    base = row * ROW_SLOTS  # the sequence's first state row (ROW_SLOTS: recurrent_state)
    dst = base + (start + length) % ROW_SLOTS  # the final state's row
    # the initial state: the row of the start's count, a snapshot's when resuming there (read
    # once, before any store: a snapshot slot other requests may read is never written)
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
    slot = (bos // CHUNK + seq).to(tl.int64)  # the first chunk's (flat_query_tile's numbering)
    pos = tl.arange(0, CHUNK)
    for c0 in range(0, length, CHUNK):
        n = tl.minimum(length - c0, CHUNK)  # the chunk's tokens
        live = pos < n
        t64 = (bos + c0).to(tl.int64) + pos
        gv, beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, t64, h, live, g_st,
                               g_sh, b_st, b_sh, dt_lo, dt_hi, RAW_GATES, MAMBA_GATES)
        gcum = tl.cumsum(gv, 0)  # dead rows add 0: the last entry is the chunk's total
        g_last = tl.sum(tl.where(pos == CHUNK - 1, gcum, 0.0), axis=0)
        tl.store(h_ptr + slot * h_sc + h_tile, s.to(h_ptr.dtype.element_ty), mask=smask)
        slot += 1
        kc = _load_rows(k_base, t64, k_st, kf, live[:, None] & kmask[None, :])  # [C, K]
        if L2NORM:  # noqa: SIM108 (a constexpr branch)
            rk = tl.rsqrt(tl.sum(kc * kc, axis=1) + 1e-6)
        else:
            rk = gv * 0.0 + 1.0
        ovmask = live[:, None] & vmask[None, :]
        if DELTA:
            w = _load_rows(wk_ptr + h * wk_sh, t64, wk_st, kf, live[:, None] & kmask[None, :])
            u_rows = u_ptr + t64[:, None] * u_st + h * u_sh + vv[None, :]
            u = tl.load(u_rows, mask=ovmask, other=0.0) - tl.dot(w, s, input_precision=PREC)
            tl.store(u_rows, u, mask=ovmask)
        else:
            u = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, ovmask) * beta[:, None]
        if HAS_TABLE:
            # Snapshots after c tokens of this chunk (0 < c <= n), into rows no one else
            # touches; a product only where one falls.
            for i in tl.static_range(2):
                c = tl.load(tbl + 2 + 2 * i) - start - c0
                if (c > 0) & (c <= n):
                    snap = state_ptr + tl.load(tbl + 3 + 2 * i).to(tl.int64) * s_sr + tile
                    tl.store(snap, _state_after(c, s, kc, rk, gcum, pos, u, PREC), mask=smask)
        if ROW_SLOTS > 1:
            # The states after the sequence's last ROW_SLOTS - 1 counts but its final one
            # that fall in this chunk (speculative decoding's verified tokens), each in its
            # count's row (never dst, the final one's).
            lo = tl.maximum(length - ROW_SLOTS + 1, c0 + 1)
            for c in range(lo, tl.minimum(length - 1, c0 + n) + 1):
                kept = state_ptr + (base + (start + c) % ROW_SLOTS) * s_sr + tile
                tl.store(kept, _state_after(c - c0, s, kc, rk, gcum, pos, u, PREC),
                         mask=smask)
        kscale = rk * tl.exp(g_last - gcum)
        s = tl.dot(tl.trans(kc * kscale[:, None]), u, s * tl.exp(g_last), input_precision=PREC)
    tl.store(state_ptr + dst * s_sr + tile, s, mask=smask)


@triton.jit(do_not_specialize=["num_seqs", "min_len"])
def _chunk_out_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor,
    beta_ptr: tl.tensor, u_ptr: tl.tensor, h_ptr: tl.tensor, out_ptr: tl.tensor,
    qsl_ptr: tl.tensor, a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor, skip_ptr: tl.tensor,
    dt_lo: float, dt_hi: float, num_seqs: int, min_len: int, scale: float, dim_k: int,
    dim_v: int, group: int, q_st: int, q_sh: int, k_st: int, k_sh: int, v_st: int, v_sh: int,
    g_st: int, g_sh: int, b_st: int, b_sh: int, u_st: int, u_sh: int, h_sc: int, h_sh: int,
    o_st: int, o_sh: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, REQ_BLOCK: tl.constexpr, PREC: tl.constexpr,
    RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr, HAS_SKIP: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Program ``(chunk, v head, V block)`` over every chunk of the step (the WY kernel's flat
    numbering, which is also the chunk's slot of ``h_ptr``): ``O = (exp(G) Q) S_c + P U`` with
    ``S_c`` the chunk's initial state (the scan's) and ``U`` the scan's (``DELTA``) or
    ``beta V``, over K blocks of ``BLOCK_K`` (``Q K^T``, ``Q S_c``, the norms)."""
    pdl_prologue(PDL)
    h = tl.program_id(1)
    slot = tl.program_id(0)
    first, n = _flat_chunk(qsl_ptr, num_seqs, slot, min_len, CHUNK, REQ_BLOCK)
    if n <= 0:  # past the sequence's chunks (or a zero-length sequence)
        return
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < dim_v
    pos = tl.arange(0, CHUNK)
    live = pos < n
    t64 = first.to(tl.int64) + pos
    gv, beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, t64, h, live, g_st, g_sh,
                           b_st, b_sh, dt_lo, dt_hi, RAW_GATES, MAMBA_GATES)
    gcum = tl.cumsum(gv, 0)
    q_base = q_ptr + (h // group) * q_sh
    k_base = k_ptr + (h // group) * k_sh
    h_base = h_ptr + slot.to(tl.int64) * h_sc + h * h_sh
    qkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    qs = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    q_ss = tl.zeros([CHUNK], dtype=tl.float32)
    k_ss = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < dim_k
        qkmask = live[:, None] & kmask[None, :]
        q = _load_rows(q_base, t64, q_st, kk, qkmask)  # [C, BLOCK_K]
        k = _load_rows(k_base, t64, k_st, kk, qkmask)
        q_ss += tl.sum(q * q, axis=1)
        k_ss += tl.sum(k * k, axis=1)
        qkt = tl.dot(q, tl.trans(k), qkt, input_precision=PREC)
        s = tl.load(h_base + kk[:, None] * dim_v + vv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        qs = tl.dot(q, s, qs, input_precision=PREC)
    if L2NORM:
        rq = tl.rsqrt(q_ss + 1e-6) * scale
        rk = tl.rsqrt(k_ss + 1e-6)
    else:
        rq = q_ss * 0.0 + scale
        rk = k_ss * 0.0 + 1.0
    ovmask = live[:, None] & vmask[None, :]
    if (not DELTA) or HAS_SKIP:
        vt = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, ovmask)  # [C, BLOCK_V]
    if DELTA:  # noqa: SIM108 (a constexpr branch)
        u = _load_rows(u_ptr + h * u_sh, t64, u_st, vv, ovmask)
    else:
        u = vt * beta[:, None]
    causal = pos[:, None] >= pos[None, :]
    decay = tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], 0.0))
    p = tl.where(causal, qkt * decay * rq[:, None] * rk[None, :], 0.0)
    o = tl.dot(p, u, qs * (rq * tl.exp(gcum))[:, None], input_precision=PREC)
    if HAS_SKIP:
        o += tl.load(skip_ptr + h).to(tl.float32) * vt
    tl.store(out_ptr + t64[:, None] * o_st + h * o_sh + vv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=ovmask)
