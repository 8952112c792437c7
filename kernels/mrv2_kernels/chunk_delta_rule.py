"""Chunked prefill form of the gated delta rule (Qwen3-Next's Gated DeltaNet; without its delta
term, Mamba-2's SSM): the same op as :func:`mrv2_kernels.linear_attention.gated_delta_rule`,
same arguments, metadata and results up to fp32 rounding, computed a chunk of ``C`` tokens at a
time with matrix products instead of token by token (Yang et al., "Gated Delta Networks", the
WY representation / UT transform of the fla library's ``chunk_gated_delta_rule``).

**The algebra.** Per sequence and v head, chunks of ``C`` tokens aligned to the sequence's own
first token (a 5-token sequence is one partial chunk). In a chunk with state ``S`` ``[K, V]``
at its start, tokens ``i = 0 .. C-1``, ``G_i = g_0 + ... + g_i`` (the cumulative log decay,
``<= 0`` and non-increasing) and the token-serial update ``S_i = exp(g_i) S_{i-1} + k_i
u_i^T`` with ``u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i)``::

    S_i = exp(G_i) S + sum_{j <= i} exp(G_i - G_j) k_j u_j^T
    (I + A) U = beta V - (beta exp(G) K) S,  A_ij = beta_i exp(G_i - G_j) k_i . k_j  (i > j)
    U = W_v - W_k S with T = (I + A)^-1, W_v = T (beta V) [C, V], W_k = T (beta exp(G) K) [C, K]
    O = (exp(G) Q) S + P U,  P_ij = exp(G_i - G_j) q_i . k_j  (i >= j, else 0)
    S' = exp(G_last) S + (exp(G_last - G) K)^T U

``delta=False`` (Mamba-2) has ``U = beta V`` and no ``T``. Decay factors between two tokens
are ``exp(G_i - G_j)`` for ``i >= j`` only, masked before the ``exp`` (the other half could
overflow); no ``exp(-G)`` is ever formed.

**The Triton path** is two launches (both PDL, neither writes step metadata). Every product
runs over K blocks of ``BLOCK_K`` (32 on the GPU), so no tile is ``[C, K]`` whatever ``K``:

1. :func:`_chunk_wy_kernel` (``delta=True`` only), grid ``(cdiv(T, C) + N, Hv)``: one
   program per (chunk, v head), parallel over every chunk of the step. A program finds its
   sequence and chunk on the device (:func:`mrv2_kernels._backend.flat_query_tile`: sequence
   ``i``'s chunks are numbered from ``query_start_loc[i] // C + i``, so the grid bound needs
   only host-known ``T`` and ``N``; programs past a sequence's chunks return at once), builds
   ``A`` from ``K K^T`` of the raw keys (their l2 norms scale its rows and columns), inverts
   ``I + A`` and writes ``W_k`` and ``W_v`` (fp32 scratch ``[T, Hv, K]`` and ``[T, Hv, V]``,
   by token). The inverse is blocked forward substitution over sub-blocks of ``SUB`` rows (16
   on the GPU): the diagonal blocks' inverses ``D^-1`` all at once, row ``r`` of every block
   in step ``r`` (``SUB - 1`` steps of one ``[C, C]`` product), then the block rows in order,
   ``T_b = D_bb^-1 (I_b - sum_{j<b} A_bj T_j)`` (two ``[C, C]`` products each): exactly
   forward substitution's quantities (no Neumann series and its cancellations), tensor-core
   work throughout, and the chunk's live rows bound both loops (a 1-token chunk does none).
2. :func:`_chunk_scan_kernel`, grid ``(N + 1, Hv, V / BLOCK_V)``: program ``(i, h, c)`` walks
   sequence ``i``'s chunks in order (``ceil(L / C)`` serial steps instead of ``L``), its state
   tile ``[K, BLOCK_V]`` fp32 kept in the sequence's own state row (no other program touches
   that tile; a padding sequence never does) and streamed a K block at a time. Per chunk, a
   first pass over K blocks accumulates ``Q K^T``, ``Q S`` and ``W_k S`` of the raw q / k and
   their norms; then ``U = W_v - W_k S``, ``O = (exp(G) Q) S + P U``; a second pass rewrites
   each K block of the tile, ``S' = exp(G_last) S + (exp(G_last - G) K)^T U``. The tile is read
   through L2 (``.cg``) with barriers between the passes and chunks. (A register-resident
   ``[K, BLOCK_V]`` tile with ``[C, K]`` operand tiles, the first build, needed 246 KB of
   shared memory at ``K = 128`` on sm_90: past the limit.) Programs ``(N, h, c)`` zero the
   padding tokens. ``G`` is a ``tl.cumsum`` of the chunk's ``g`` (dead rows add 0).

**The keywords** of the token-serial op, all taken. ``gate_params`` (``dt_limits``): both
kernels turn the raw ``g`` / ``beta`` into gates where they load them (:func:`_load_gates`, the
token-serial kernel's arithmetic), zeroed on a partial chunk's dead rows. ``skip``: ``o +=
skip[h] v`` in the scan; ``out_dtype``: the output buffer's. ``state_table``: the scan reads the
first chunk's initial state from ``src_row`` when the sequence resumes there (``start ==
src_pos``; later chunks read the sequence's own row, so ``src_row``, a snapshot slot other
requests may read, is never written), and a chunk holding a snapshot position (``0 < c <= n``
for ``c = snap_pos - start - c0``; a runtime branch, so other chunks pay nothing) runs one extra
pass over K blocks before pass 2 (which keeps the chunk's initial tile unchanged for it):
``S_c = exp(G_{c-1}) S + (exp(G_{c-1} - G) K)^T U`` with the keys masked to ``j < c`` (``U``'s
row ``j`` depends on tokens ``<= j`` only, so the whole chunk's ``U`` serves), stored into
``snap_row``. A padding sequence returns before reading its table entry. ``row_slots``
(speculative decoding: :mod:`mrv2_kernels.recurrent_state`): the chunks stream the state
through the final count's row; the states after the sequence's last ``row_slots - 1`` counts
but its final one take the same extra pass each, into their counts' rows, before pass 2 (its
rows differ from pass 2's), but for the one whose row is the first chunk's initial state
(possible when the final row differs): that one runs after pass 2, which no longer reads it.

Products take fp32 operands at ``input_precision`` ``"tf32x3"`` on the GPU (fp32 accuracy on
tensor cores, as the attention kernels) and ``"ieee"`` under the interpreter. The scratch is
``4 (K + V)`` bytes per token and v head (Qwen3-Next-80B, 32 v heads of 128 + 128: 32 KiB a
token, 256 MiB for an 8,192-token step), freed after the call. GPU tiles (``C = 64``, ``SUB =
16``, ``BLOCK_K = 32``, ``BLOCK_V = 32``, 8 warps) come from compiling for sm_90 on a CPU
(``ptxas -v`` at ``K = V = 128``: 96 and 64 KB of shared memory, 255 registers a thread, so
one program per SM, and 72 / 352 bytes of spills; ``[C, 64]`` K blocks or 4 warps spill KBs),
not from timings.

:func:`prefer_chunked` is the rule a model applies with host-known numbers to pick this path or
the token-serial kernel (decode batches stay on the latter); :func:`gated_delta_rule_auto`
applies it. Its threshold and the GPU tiles are untuned: set them by an H200 A/B.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, flat_query_tile, next_power_of_2, pdl, pdl_prologue
from ._backend import use_triton as _use_triton
from .linear_attention import _L2_EPS, _check_gdr, check_triton_args, raw_gates, resolve_gates
from .linear_attention import gated_delta_rule as _serial_gated_delta_rule
from .recurrent_state import (
    _KERNEL_DTYPES,
    _check_meta,
    _check_table,
    _zero_tail,
    check_row_slots,
    iter_sequences,
)

__all__ = [
    "CHUNKED_MIN_QUERY_LEN",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "chunk_gated_delta_rule_triton",
    "gated_delta_rule_auto",
    "prefer_chunked",
]

#: :func:`prefer_chunked`'s threshold: the chunked path once some sequence of the step has at
#: least this many query tokens (half a GPU chunk). Unmeasured: an estimate that one chunk step
#: costs what a few dozen token steps of the serial kernel do.
CHUNKED_MIN_QUERY_LEN = 32
#: ``MRV2_CHUNKED_DELTA_RULE``: ``0``: every step token-serial; ``1``: the chunked form for the
#: delta rule too (by default only Mamba-2's form, ``delta=False``, takes it); read per call.
CHUNKED_ENV_VAR = "MRV2_CHUNKED_DELTA_RULE"
#: Sequences whose chunk starts one ``flat_query_tile`` load reads (a constexpr: not sized by N).
_REQ_BLOCK = 64


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ------------------------------------------------------------------------------ reference


def _chunked_sequence(
    qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, gs: torch.Tensor, bs: torch.Tensor,
    s: torch.Tensor, chunk: int, delta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked math of one sequence, all v heads at once: ``qs`` (normed and scaled),
    ``ks`` ``[Hv, L, K]``, ``vs`` ``[Hv, L, V]``, the gates ``gs``, ``bs`` ``[Hv, L]``, the
    initial state ``s`` ``[Hv, K, V]``; chunks of ``chunk`` tokens from the first. Returns the
    outputs ``[Hv, L, V]`` and the final state (fp32)."""
    hv, length, dv = vs.shape
    out = torch.empty(hv, length, dv, dtype=torch.float32, device=vs.device)
    for c0 in range(0, length, chunk):
        sl = slice(c0, min(c0 + chunk, length))
        qc, kc, vc, gc, bc = qs[:, sl], ks[:, sl], vs[:, sl], gs[:, sl], bs[:, sl]
        size = qc.shape[1]
        gcum = gc.cumsum(-1)  # [Hv, c]
        causal = torch.ones(size, size, dtype=torch.bool, device=qs.device).tril()
        diff = (gcum[:, :, None] - gcum[:, None, :]).masked_fill(~causal, float("-inf"))
        decay = diff.exp()  # exp(G_i - G_j) for i >= j, else 0
        if delta:
            a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
            eye = torch.eye(size, dtype=torch.float32, device=qs.device)
            rhs = torch.cat([bc[..., None] * vc, (bc * gcum.exp())[..., None] * kc], -1)
            wy = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
            u = wy[..., :dv] - wy[..., dv:] @ s  # [Hv, c, V]
        else:
            u = bc[..., None] * vc
        out[:, sl] = (qc * gcum.exp()[..., None]) @ s + ((qc @ kc.transpose(1, 2)) * decay) @ u
        last = gcum[:, -1:]  # [Hv, 1]
        kd = kc * (last - gcum).exp()[..., None]
        s = s * last.exp()[..., None] + kd.transpose(1, 2) @ u
    return out, s


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, chunk: int = 64, row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch chunked form of :func:`~mrv2_kernels.linear_attention.gated_delta_rule`
    (reads the metadata on the host): the gates computed first (``gate_params`` /
    ``dt_limits``), then per sequence chunks of ``chunk`` tokens from its first one, all v heads
    at once, ``T = (I + A)^-1`` applied by ``torch.linalg.solve_triangular`` (the module
    docstring's algebra). A snapshot after ``c`` tokens (``state_table``) runs the same math
    over the first ``c`` tokens alone, and so does each state ``row_slots`` keeps. A second
    formulation of the op, independent of the token-serial reference and of the kernels; same
    results up to fp32 rounding."""
    _check_gdr(q, k, v, g, beta, state)
    g, beta = resolve_gates(g, beta, v, gate_params, dt_limits, skip)
    _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    slots = check_row_slots(row_slots)
    hv, dk, dv = state.shape[1:]
    group = hv // q.shape[1]
    out = torch.zeros(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    for seq in iter_sequences(query_start_loc, seq_lens, state_rows, state_table, slots):
        bos, eos = seq.bos, seq.eos
        if seq.start > 0:
            s0 = state[seq.src].clone()  # [Hv, K, V]
        else:
            s0 = torch.zeros(hv, dk, dv, dtype=torch.float32, device=state.device)
        # [Hv, L, ...] per v head
        qs = q[bos:eos].float().repeat_interleave(group, dim=1).transpose(0, 1)
        ks = k[bos:eos].float().repeat_interleave(group, dim=1).transpose(0, 1)
        if l2norm_qk:
            qs = qs * torch.rsqrt((qs * qs).sum(-1, keepdim=True) + _L2_EPS)
            ks = ks * torch.rsqrt((ks * ks).sum(-1, keepdim=True) + _L2_EPS)
        qs = qs * scale
        vs = v[bos:eos].float().transpose(0, 1)
        gs, bs = g[bos:eos].float().T, beta[bos:eos].float().T  # [Hv, L]
        o, s = _chunked_sequence(qs, ks, vs, gs, bs, s0, chunk, delta)
        if skip is not None:
            o = o + skip.float()[:, None, None] * vs
        out[bos:eos] = o.transpose(0, 1).to(out.dtype)
        for c, snap_row in seq.snaps + seq.kept[:-1]:  # the final state: s, below
            part = slice(0, c)
            state[snap_row] = _chunked_sequence(qs[:, part], ks[:, part], vs[:, part],
                                                gs[:, part], bs[:, part], s0, chunk, delta)[1]
        state[seq.kept[-1][1]] = s
    return out


# -------------------------------------------------------------------------------- kernels


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


@triton.jit(do_not_specialize=["num_seqs"])
def _chunk_wy_kernel(
    k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor, beta_ptr: tl.tensor,
    wk_ptr: tl.tensor, wv_ptr: tl.tensor, qsl_ptr: tl.tensor, a_log_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor, dt_lo: float, dt_hi: float,
    num_seqs: int, dim_k: int, dim_v: int, group: int,
    k_st: int, k_sh: int, v_st: int, v_sh: int, g_st: int, g_sh: int, b_st: int, b_sh: int,
    wk_st: int, wk_sh: int, wv_st: int, wv_sh: int,
    L2NORM: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, REQ_BLOCK: tl.constexpr, PREC: tl.constexpr,
    RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr, PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    h = tl.program_id(1)
    seq, c = flat_query_tile(qsl_ptr, num_seqs, tl.program_id(0), CHUNK, REQ_BLOCK)
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    c0 = c * CHUNK
    n = tl.load(qsl_ptr + seq + 1).to(tl.int32) - bos - c0  # the chunk's tokens (if > 0)
    if n <= 0:  # past the sequence's chunks (or a zero-length sequence)
        return
    pos = tl.arange(0, CHUNK)
    live = pos < n
    t64 = (bos + c0).to(tl.int64) + pos
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
    same = (ri // SUB) == (ci // SUB)
    eye = tl.where(ri == ci, 1.0, 0.0)
    # D^-1 (the diagonal blocks' inverses): row r of every block from the rows before it.
    a_diag = tl.where(same, a, 0.0)
    d_inv = eye
    for r in range(1, tl.minimum(n, SUB)):
        step = eye - tl.dot(a_diag, d_inv, input_precision=PREC)
        d_inv = tl.where((ri % SUB) == r, step, d_inv)
    # The block rows in order: T_b = D_bb^-1 (I_b - sum_{j<b} A_bj T_j).
    a_off = tl.where(same, 0.0, a)
    t_inv = d_inv
    for b in range(1, tl.cdiv(n, SUB)):
        rhs = eye - tl.dot(a_off, t_inv, input_precision=PREC)
        step = tl.dot(d_inv, rhs, input_precision=PREC)
        t_inv = tl.where((ri // SUB) == b, step, t_inv)
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
def _store_state_after(
    c: tl.tensor, dst_base: tl.tensor, r_base: tl.tensor, k_base: tl.tensor, t64: tl.tensor,
    gcum: tl.tensor, pos: tl.tensor, rk: tl.tensor, u: tl.tensor, s_ok: tl.tensor,
    vmask: tl.tensor, dim_k: int, k_st: int, s_sk: int, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """Triton helper: the state after the chunk's first ``c`` tokens (``0 < c <= n``), the
    end-of-chunk update with the decay reference at token ``c - 1`` and the keys masked to ``j
    < c`` (``U``'s row ``j`` depends on tokens ``<= j`` only): ``S_c = exp(G_{c-1}) S +
    sum_{j<c} exp(G_{c-1} - G_j) k_j u_j^T``, ``S`` read from ``r_base``, into ``dst_base`` a K
    block at a time (each block's reads before its writes: ``dst_base`` may be ``r_base``)."""
    g_ref = tl.sum(tl.where(pos == c - 1, gcum, 0.0), axis=0)
    before = pos < c
    ks_snap = tl.where(before, rk * tl.exp(tl.where(before, g_ref - gcum, 0.0)), 0.0)
    for k0 in range(0, dim_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < dim_k
        smask = kmask[:, None] & vmask[None, :]
        kd = _load_rows(k_base, t64, k_st, kk, before[:, None] & kmask[None, :])
        s = tl.load(r_base + kk[:, None] * s_sk, mask=smask & s_ok, other=0.0,
                    cache_modifier=".cg")
        s = tl.dot(tl.trans(kd * ks_snap[:, None]), u, s * tl.exp(g_ref), input_precision=PREC)
        tl.debug_barrier()
        tl.store(dst_base + kk[:, None] * s_sk, s, mask=smask)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _chunk_scan_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor,
    beta_ptr: tl.tensor, wk_ptr: tl.tensor, wv_ptr: tl.tensor, state_ptr: tl.tensor,
    out_ptr: tl.tensor, qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor,
    tbl_ptr: tl.tensor, a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor, skip_ptr: tl.tensor,
    dt_lo: float, dt_hi: float,
    num_seqs: int, num_tokens: int, scale: float, dim_k: int, dim_v: int, group: int,
    q_st: int, q_sh: int, k_st: int, k_sh: int, v_st: int, v_sh: int,
    g_st: int, g_sh: int, b_st: int, b_sh: int, wk_st: int, wk_sh: int, wv_st: int,
    wv_sh: int, o_st: int, o_sh: int, s_sr: int, s_sh: int, s_sk: int, tbl_st: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
    HAS_TABLE: tl.constexpr, RAW_GATES: tl.constexpr, MAMBA_GATES: tl.constexpr,
    HAS_SKIP: tl.constexpr, ROW_SLOTS: tl.constexpr, PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    # Programs (i < N, v head, V block) run sequence i; programs (N, ...) zero the padding.
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
    if length <= 0:  # padding: its row (and its table entry) may be another sequence's
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - length
    has_init = start > 0
    row = tl.load(rows_ptr + seq).to(tl.int64)
    base = row * ROW_SLOTS  # the sequence's first state row (ROW_SLOTS: recurrent_state)
    dst = base + (start + length) % ROW_SLOTS  # the final state's row, the chunks' working row
    # the first chunk's initial state: the row of the start's count, a snapshot's when resuming
    src_row = base + start % ROW_SLOTS
    if HAS_TABLE:
        tbl = tbl_ptr + row * tbl_st
        src_row = tl.where(start == tl.load(tbl + 1), tl.load(tbl).to(tl.int64), src_row)
    q_base = q_ptr + (h // group) * q_sh
    k_base = k_ptr + (h // group) * k_sh
    # The state tile [K, BLOCK_V] lives in its own row (no other program touches it), read
    # and rewritten a K block at a time: through L2 (".cg"), behind barriers. The first chunk
    # reads src_row (never written but by the one kept state below: a snapshot slot other
    # requests may read too is never written).
    tile = h * s_sh + vv[None, :]
    s_base = state_ptr + dst * s_sr + tile
    if HAS_SKIP:
        skip = tl.load(skip_ptr + h).to(tl.float32)
    pos = tl.arange(0, CHUNK)
    causal = pos[:, None] >= pos[None, :]
    for c0 in range(0, length, CHUNK):
        n = tl.minimum(length - c0, CHUNK)  # the chunk's tokens
        live = pos < n
        t64 = (bos + c0).to(tl.int64) + pos
        s_ok = has_init | (c0 > 0)  # else the row holds garbage: start from zeros
        r_row = tl.where(c0 == 0, src_row, dst)  # S's row
        r_base = state_ptr + r_row * s_sr + tile
        gv, beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, t64, h, live, g_st,
                               g_sh, b_st, b_sh, dt_lo, dt_hi, RAW_GATES, MAMBA_GATES)
        gcum = tl.cumsum(gv, 0)  # dead rows add 0: the last entry is the chunk's total
        g_last = tl.sum(tl.where(pos == CHUNK - 1, gcum, 0.0), axis=0)
        # Pass 1 over K blocks: Q K^T, Q S and W_k S of the raw q / k.
        qkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        qs = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
        ws = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
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
            s = tl.load(r_base + kk[:, None] * s_sk, mask=kmask[:, None] & vmask[None, :] & s_ok,
                        other=0.0, cache_modifier=".cg")
            qs = tl.dot(q, s, qs, input_precision=PREC)
            if DELTA:
                wk = _load_rows(wk_ptr + h * wk_sh, t64, wk_st, kk, qkmask)
                ws = tl.dot(wk, s, ws, input_precision=PREC)
        if L2NORM:
            rq = tl.rsqrt(q_ss + 1e-6) * scale
            rk = tl.rsqrt(k_ss + 1e-6)
        else:
            rq = q_ss * 0.0 + scale
            rk = k_ss * 0.0 + 1.0
        ovmask = live[:, None] & vmask[None, :]
        if (not DELTA) or HAS_SKIP:
            vt = _load_rows(v_ptr + h * v_sh, t64, v_st, vv, ovmask)  # [C, BLOCK_V]
        if DELTA:
            u = _load_rows(wv_ptr + h * wv_sh, t64, wv_st, vv, ovmask) - ws  # [C, BLOCK_V]
        else:
            u = vt * beta[:, None]
        decay = tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], 0.0))
        p = tl.where(causal, qkt * decay * rq[:, None] * rk[None, :], 0.0)
        o = tl.dot(p, u, qs * (rq * tl.exp(gcum))[:, None], input_precision=PREC)
        if HAS_SKIP:
            o += skip * vt
        tl.store(out_ptr + t64[:, None] * o_st + h * o_sh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=ovmask)
        if HAS_TABLE:
            # Snapshots after c tokens of this chunk (0 < c <= n), into rows no one else
            # touches. A pass only where one falls.
            for i in tl.static_range(2):
                c = tl.load(tbl + 2 + 2 * i) - start - c0
                if (c > 0) & (c <= n):
                    snap_base = state_ptr + tl.load(tbl + 3 + 2 * i).to(tl.int64) * s_sr + tile
                    _store_state_after(c, snap_base, r_base, k_base, t64, gcum, pos, rk, u,
                                       s_ok, vmask, dim_k, k_st, s_sk, BLOCK_K, PREC)
        deferred = -1  # (ROW_SLOTS: the kept state whose row is S's own, stored after pass 2)
        if ROW_SLOTS > 1:
            # The states after the sequence's last ROW_SLOTS - 1 counts but its final one that
            # fall in this chunk (speculative decoding's verified tokens), each in its count's
            # row; never the final one's row (dst). One may be S's own row (the first chunk,
            # when the final count's row differs): that one waits for pass 2's reads of it.
            lo = tl.maximum(length - ROW_SLOTS + 1, c0 + 1)
            for c in range(lo, tl.minimum(length - 1, c0 + n) + 1):
                kept = base + (start + c) % ROW_SLOTS
                if kept == r_row:
                    deferred = c - c0
                else:
                    _store_state_after(c - c0, state_ptr + kept * s_sr + tile, r_base, k_base,
                                       t64, gcum, pos, rk, u, s_ok, vmask, dim_k, k_st, s_sk,
                                       BLOCK_K, PREC)
        # Pass 2: S' = exp(G_last) S + (exp(G_last - G) K)^T U, a K block at a time.
        kscale = rk * tl.exp(g_last - gcum)
        tl.debug_barrier()  # every pass-1 read of the tile precedes its rewrite
        for k0 in range(0, dim_k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < dim_k
            smask = kmask[:, None] & vmask[None, :]
            kd = _load_rows(k_base, t64, k_st, kk, live[:, None] & kmask[None, :])
            s = tl.load(r_base + kk[:, None] * s_sk, mask=smask & s_ok, other=0.0,
                        cache_modifier=".cg")
            s = tl.dot(tl.trans(kd * kscale[:, None]), u, s * tl.exp(g_last),
                       input_precision=PREC)
            tl.debug_barrier()
            tl.store(s_base + kk[:, None] * s_sk, s, mask=smask)
        if ROW_SLOTS > 1:  # noqa: SIM102 (constexpr: compiled out at 1)
            if deferred > 0:  # S's own row (the first chunk's; dst is another): now free
                tl.debug_barrier()
                _store_state_after(deferred, r_base, r_base, k_base, t64, gcum, pos, rk, u,
                                   s_ok, vmask, dim_k, k_st, s_sk, BLOCK_K, PREC)
        tl.debug_barrier()  # the new tile is written before the next chunk reads it


# ------------------------------------------------------------------------------- wrappers


def chunk_gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True,
    *,
    delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    row_slots: int = 1,
    chunk: int | None = None,
    block_sub: int | None = None,
    block_k: int | None = None,
    block_v: int | None = None,
    dot_precision: str | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`chunk_gated_delta_rule`: two launches, no host sync
    (the module docstring has the design). Tiles, powers of two: ``chunk`` (``C``; GPU 64,
    CPU 16), ``block_sub`` (the triangular solve's sub-blocks, at most ``C``; GPU 16, CPU 8),
    ``block_k`` (the K blocks the products loop over; GPU 32, CPU up to 64) and ``block_v`` (a
    program's state columns; GPU 32, CPU up to 64); on the GPU all but ``block_sub`` at least
    16. ``dot_precision``: the products' fp32 ``input_precision`` (GPU ``"tf32x3"``, CPU
    ``"ieee"``; ``"tf32"`` would trade accuracy, ~1e-3, for speed: unmeasured). q/k/v may be
    strided views (their last dim is made contiguous); ``state`` must have a contiguous last
    dim (it is updated in place, its rows also holding each program's tile between chunks).
    ``state_table``, ``gate_params``, ``dt_limits``, ``skip``, ``out_dtype``, ``row_slots``:
    as :func:`~mrv2_kernels.linear_attention.gated_delta_rule`'s (the module docstring says
    how)."""
    n = check_triton_args("chunk_gated_delta_rule_triton", q, k, v, g, beta, state,
                          query_start_loc, seq_lens, state_rows, state_table, gate_params,
                          dt_limits, skip)
    slots = check_row_slots(row_slots)
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    on_gpu = v.is_cuda
    c = default_block(v, cuda=64, cpu=16, block=chunk)
    sub = default_block(v, cuda=16, cpu=8, block=block_sub)
    if sub > c:
        raise ValueError(f"block_sub ({sub}) must divide the chunk ({c})")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = _empty((num_tokens, hv, dv), out_dtype or v.dtype, v.device)
    if out.numel() == 0:
        return out
    tile_min = 16 if on_gpu else 1  # tl.dot's smallest tile dim on the GPU
    bk = default_block(v, cuda=min(32, max(16, next_power_of_2(dk))),
                       cpu=min(64, next_power_of_2(dk)), block=block_k)
    pow2_v = max(tile_min, next_power_of_2(dv))
    bv = default_block(v, cuda=min(32, pow2_v), cpu=min(64, pow2_v), block=block_v)
    if on_gpu and min(bk, bv, c) < 16:
        raise ValueError(f"chunk, block_k and block_v must be at least 16 on the GPU (tl.dot), "
                         f"got {c}, {bk}, {bv}")
    prec = dot_precision or ("tf32x3" if on_gpu else "ieee")
    a_log, dt_bias = ((g, g) if gate_params is None
                      else (gate_params[0].contiguous(), gate_params[1].contiguous()))
    dt_lo, dt_hi = (0.0, 0.0) if dt_limits is None else (float(dt_limits[0]),
                                                         float(dt_limits[1]))
    gates = {"RAW_GATES": gate_params is not None, "MAMBA_GATES": dt_limits is not None}
    if delta and n > 0:
        wk = _empty((num_tokens, hv, dk), torch.float32, v.device)
        wv = _empty((num_tokens, hv, dv), torch.float32, v.device)
        _chunk_wy_kernel[(cdiv(num_tokens, c) + n, hv)](
            k, v, g, beta, wk, wv, query_start_loc, a_log, dt_bias, dt_lo, dt_hi,
            n, dk, dv, hv // hk,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), wk.stride(0), wk.stride(1), wv.stride(0),
            wv.stride(1),
            L2NORM=l2norm_qk, CHUNK=c, SUB=sub, BLOCK_K=bk,
            BLOCK_V=block_v or default_block(v, cuda=min(64, pow2_v), cpu=pow2_v),
            REQ_BLOCK=_REQ_BLOCK, PREC=prec, **gates,
            num_warps=8 if on_gpu else 1,
            **pdl(v),
        )
    else:
        wk = wv = out  # not read
    tbl = state_rows if state_table is None else state_table
    _chunk_scan_kernel[(n + 1, hv, cdiv(dv, bv))](
        q, k, v, g, beta, wk, wv, state, out, query_start_loc, seq_lens, state_rows,
        tbl, a_log, dt_bias, g if skip is None else skip.contiguous(), dt_lo, dt_hi,
        n, num_tokens, float(scale), dk, dv, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), wk.stride(0), wk.stride(1),
        wv.stride(0), wv.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2), tbl.stride(0),
        L2NORM=l2norm_qk, DELTA=delta, CHUNK=c, BLOCK_K=bk, BLOCK_V=bv, BLOCK_T=8,
        PREC=prec, HAS_TABLE=state_table is not None, HAS_SKIP=skip is not None,
        ROW_SLOTS=slots, **gates,
        num_warps=8 if on_gpu else 1,
        **pdl(v),
    )
    return out


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """:func:`mrv2_kernels.linear_attention.gated_delta_rule` (same arguments, semantics and
    results up to fp32 rounding: see its docstring) computed a chunk of tokens at a time, for
    prefill. Runs :func:`chunk_gated_delta_rule_triton` when :func:`use_triton` says so, else
    :func:`chunk_gated_delta_rule_ref`."""
    fn = (chunk_gated_delta_rule_triton
          if _use_triton(v) and all(t.dtype in _KERNEL_DTYPES for t in (q, k, v, beta))
          else chunk_gated_delta_rule_ref)
    return fn(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
              delta=delta, state_table=state_table, gate_params=gate_params,
              dt_limits=dt_limits, skip=skip, out_dtype=out_dtype, row_slots=row_slots)


def prefer_chunked(num_tokens: int, num_seqs: int, max_query_len: int | None = None) -> bool:
    """Whether a step of ``num_tokens`` tokens over ``num_seqs`` sequences (padding ones
    included) should run the chunked path: when its longest query is at least
    :data:`CHUNKED_MIN_QUERY_LEN` tokens. Host numbers only: ``max_query_len`` where the caller
    knows it (the runner's ``InputBatch.max_query_len``; a mixed CUDA graph bakes its token
    count there, so its steps, which carry prompt tokens, go chunked; a decode graph bakes ``1
    + k`` and stays token-serial), else the mean query length, a lower bound of the longest (a
    long prompt among many decodes then stays token-serial: correct, slower)."""
    if os.environ.get(CHUNKED_ENV_VAR, "1") == "0":
        return False
    if max_query_len is not None:
        longest = min(max_query_len, num_tokens)
    else:
        longest = cdiv(num_tokens, max(num_seqs, 1))
    return longest >= CHUNKED_MIN_QUERY_LEN


def gated_delta_rule_auto(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, max_query_len: int | None = None,
    row_slots: int = 1,
) -> torch.Tensor:
    """The gated delta rule by the faster form for the step: :func:`chunk_gated_delta_rule`
    where :func:`prefer_chunked` says so (from ``q``'s token count, the sequence count and
    ``max_query_len``), else the token-serial
    :func:`~mrv2_kernels.linear_attention.gated_delta_rule`; every keyword of the latter
    (``state_table``, ``gate_params``, ``dt_limits``, ``skip``, ``out_dtype``, ``row_slots``)
    passed on. Same results up to fp32 rounding either way."""
    # The delta rule itself (Gated DeltaNet) stays token-serial unless MRV2_CHUNKED_DELTA_RULE=1:
    # on the H200 the chunked kernel took 10.5 ms for one 4,096-token Qwen3-Next prompt
    # against 7.4 token-serial, 3.7 against 2.0 for 8 x 512 (BENCHMARKS.md, 2026-12-06);
    # Mamba-2's form (delta=False) gained 1.9x (3.4 against 6.6 ms).
    chunked = prefer_chunked(q.shape[0], query_start_loc.shape[0] - 1, max_query_len) and (
        not delta or os.environ.get(CHUNKED_ENV_VAR) == "1")
    fn = chunk_gated_delta_rule if chunked else _serial_gated_delta_rule
    return fn(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
              delta=delta, state_table=state_table, gate_params=gate_params,
              dt_limits=dt_limits, skip=skip, out_dtype=out_dtype, row_slots=row_slots)
