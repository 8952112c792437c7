"""Device op of Mamba-1 mixers (state-spaces Mamba, FalconMamba, Jamba): the selective scan,
varlen over a flat token batch, with a per-row fp32 state ``[R, D, N]`` (one ``[D, N]`` matrix
per request: ``D`` channels, ``N`` state indices). The step metadata, prefix caching's
``state_table``, speculative decoding's ``row_slots`` and the padding rule follow
:mod:`mrv2_kernels.recurrent_state`'s docstring.

Per token ``t`` of a sequence, channel ``d`` and state index ``n`` (fp32)::

    dt[d]   = softplus(dt_raw[t, d] + dt_bias[d])
    h[d, n] = exp(dt[d] * A[d, n]) * h[d, n] + dt[d] * B[t, n] * x[t, d],  A = -exp(A_log)
    y[t, d] = (sum_n C[t, n] * h[d, n] + D[d] * x[t, d]) * silu(z[t, d])

(``z`` optional), as ``mamba_ssm``'s ``selective_scan_fn`` with ``delta_softplus=True`` and
one B/C group. Unlike Mamba-2 (one decay per head, :mod:`mrv2_kernels.linear_attention`'s
delta-free rule), each channel has ``N`` decays, so the op is its own kernel.

The Triton kernel gives one program to each (sequence, channel block): it keeps its
``[block_d, N]`` state tile in fp32 registers and walks the sequence's tokens in order (no
host syncs: the loop bounds are read on the device). It is not launched with PDL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, use_triton
from .recurrent_state import (
    _KERNEL_DTYPES,
    _check_meta,
    _check_table,
    _empty,
    _zero_tail,
    check_row_slots,
    iter_sequences,
)

__all__ = ["MAX_STATE", "selective_scan", "selective_scan_ref", "selective_scan_triton"]

#: The largest state size ``N`` of :func:`selective_scan_triton` (one register tile of it).
MAX_STATE = 256


def _check_scan(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, d_skip: torch.Tensor | None, z: torch.Tensor | None,
                dt_bias: torch.Tensor | None, state: torch.Tensor) -> None:
    if x.dim() != 2 or dt.shape != x.shape:
        raise ValueError(f"x and dt must be [T, D] alike, got {tuple(x.shape)}, "
                         f"{tuple(dt.shape)}")
    num_tokens, dim = x.shape
    if a_log.dim() != 2 or a_log.shape[0] != dim:
        raise ValueError(f"A_log must be [{dim}, N], got {tuple(a_log.shape)}")
    n = a_log.shape[1]
    for name, t in (("B", b), ("C", c)):
        if t.shape != (num_tokens, n):
            raise ValueError(f"{name} must have shape ({num_tokens}, {n}), got "
                             f"{tuple(t.shape)}")
    for name, v in (("D", d_skip), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (dim,):
            raise ValueError(f"{name} must have shape ({dim},), got {tuple(v.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if state.dim() != 3 or state.shape[1:] != (dim, n):
        raise ValueError(f"state must be [R, {dim}, {n}], got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be fp32, got {state.dtype}")


def selective_scan_ref(
    x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d_skip: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, *, state_table: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch specification of :func:`selective_scan` (reads the metadata on the host):
    token by token, as HF transformers' ``mamba_selective_scan`` recurrence."""
    _check_scan(x, dt, a_log, b, c, d_skip, z, dt_bias, state)
    _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    dim, n = a_log.shape
    neg_a = -a_log.float().exp()
    out = torch.zeros(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    for seq in iter_sequences(query_start_loc, seq_lens, state_rows, state_table, slots):
        bos, eos = seq.bos, seq.eos
        keep = dict(seq.kept)
        if seq.start > 0:
            h = state[seq.src].clone()
        else:
            h = torch.zeros(dim, n, dtype=torch.float32, device=state.device)
        xs = x[bos:eos].float()
        step = dt[bos:eos].float()
        if dt_bias is not None:
            step = step + dt_bias.float()
        step = F.softplus(step)
        bs, cs = b[bos:eos].float(), c[bos:eos].float()
        for t in range(seq.length):
            h = torch.exp(step[t][:, None] * neg_a) * h \
                + (step[t] * xs[t])[:, None] * bs[t][None, :]
            y = h @ cs[t]
            if d_skip is not None:
                y = y + d_skip.float() * xs[t]
            if z is not None:
                y = y * F.silu(z[bos + t].float())
            out[bos + t] = y.to(out.dtype)
            for cnt, snap_row in seq.snaps:
                if cnt == t + 1:
                    state[snap_row] = h
            if t + 1 in keep:
                state[keep[t + 1]] = h
    return out


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _selective_scan_kernel(
    x_ptr: tl.tensor, dt_ptr: tl.tensor, a_log_ptr: tl.tensor, b_ptr: tl.tensor,
    c_ptr: tl.tensor, d_ptr: tl.tensor, z_ptr: tl.tensor, dt_bias_ptr: tl.tensor,
    state_ptr: tl.tensor, out_ptr: tl.tensor,
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor, tbl_ptr: tl.tensor,
    num_seqs: int, num_tokens: int, dim: int, dstate: int,
    x_st: int, dt_st: int, b_st: int, c_st: int, z_st: int, o_st: int, a_sd: int,
    s_sr: int, s_sd: int,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_TABLE: tl.constexpr, ROW_SLOTS: tl.constexpr,
) -> None:
    # Programs (i < N, d block) run sequence i; programs (N, d block) zero the padding.
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    if seq == num_seqs:
        _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, o_st, d, dmask, BLOCK_T, BLOCK_D)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    n = tl.load(qsl_ptr + seq + 1).to(tl.int32) - bos
    if n <= 0:  # padding: its row may be another sequence's
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - n
    has_init = start > 0
    row = tl.load(rows_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BLOCK_N)
    kmask = kk < dstate
    tile = d[:, None] * s_sd + kk[None, :]
    smask = dmask[:, None] & kmask[None, :]
    base = row * ROW_SLOTS  # the sequence's first state row (ROW_SLOTS: module docstring)
    src_row = base + start % ROW_SLOTS
    c0 = -1  # snapshots: after c0 / c1 tokens, into rows snap0 / snap1
    c1 = -1
    snap0 = row
    snap1 = row
    if HAS_TABLE:
        tbl = tbl_ptr + row * 6
        src_row = tl.where(start == tl.load(tbl + 1), tl.load(tbl).to(tl.int64), src_row)
        c0 = tl.load(tbl + 2) - start
        snap0 = tl.load(tbl + 3).to(tl.int64)
        c1 = tl.load(tbl + 4) - start
        snap1 = tl.load(tbl + 5).to(tl.int64)
    h = tl.load(state_ptr + src_row * s_sr + tile, mask=smask & has_init, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + d[:, None] * a_sd + kk[None, :], mask=smask,
                            other=0.0).to(tl.float32))
    if HAS_D:
        skip = tl.load(d_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    bos64 = bos.to(tl.int64)
    for i in range(0, n):
        t64 = bos64 + i
        xt = tl.load(x_ptr + t64 * x_st + d, mask=dmask, other=0.0).to(tl.float32)
        st = tl.load(dt_ptr + t64 * dt_st + d, mask=dmask, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + t64 * b_st + kk, mask=kmask, other=0.0).to(tl.float32)
        ct = tl.load(c_ptr + t64 * c_st + kk, mask=kmask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            st = st + dt_bias
        st = tl.where(st > 20.0, st, tl.log(1.0 + tl.exp(st)))  # softplus
        h = tl.exp(st[:, None] * neg_a) * h + (st * xt)[:, None] * bt[None, :]
        y = tl.sum(h * ct[None, :], axis=1)
        if HAS_D:
            y += skip * xt
        if HAS_Z:
            zt = tl.load(z_ptr + t64 * z_st + d, mask=dmask, other=0.0).to(tl.float32)
            y = y * (zt / (1.0 + tl.exp(-zt)))
        tl.store(out_ptr + t64 * o_st + d, y.to(out_ptr.dtype.element_ty), mask=dmask)
        if HAS_TABLE:
            if i + 1 == c0:
                tl.store(state_ptr + snap0 * s_sr + tile, h, mask=smask)
            if i + 1 == c1:
                tl.store(state_ptr + snap1 * s_sr + tile, h, mask=smask)
        if ROW_SLOTS > 1:  # noqa: SIM102 (constexpr: compiled out at 1)
            # the states after the chunk's last tokens but the final one
            if (i + ROW_SLOTS >= n) & (i + 1 < n):
                kept = base + (start + i + 1) % ROW_SLOTS
                tl.store(state_ptr + kept * s_sr + tile, h, mask=smask)
    tl.store(state_ptr + (base + (start + n) % ROW_SLOTS) * s_sr + tile, h, mask=smask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim (a row-strided view stays a view)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def selective_scan_triton(
    x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d_skip: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, *, state_table: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1, block_d: int | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`selective_scan`: one launch, grid ``(N + 1, D /
    block_d)``; program ``(i, c)`` keeps its ``[block_d, N]`` state tile in fp32 registers and
    walks sequence ``i``'s tokens in order; programs ``(N, c)`` zero the padding tokens. The
    token inputs may be row-strided views (their last dim is made contiguous); ``state`` must
    have a contiguous last dim (it is updated in place)."""
    _check_scan(x, dt, a_log, b, c, d_skip, z, dt_bias, state)
    num_seqs = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    for t in (x, dt, b, c) + ((z,) if z is not None else ()):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"selective_scan_triton takes fp32/bf16/fp16, got {t.dtype}")
    if state.stride(-1) != 1:
        raise ValueError("state must have a contiguous last dim")
    num_tokens, dim = x.shape
    dstate = a_log.shape[1]
    if dstate > MAX_STATE:
        raise ValueError(f"the state size must be at most {MAX_STATE}, got {dstate}")
    x, dt, b, c, a_log = (_rows(t) for t in (x, dt, b, c, a_log))
    z = _rows(z) if z is not None else None
    out = _empty((num_tokens, dim), out_dtype or x.dtype, x.device)
    if out.numel() == 0:
        return out
    block_n = next_power_of_2(dstate)
    pow2 = next_power_of_2(dim)
    # (a [block_d, N] fp32 tile plus A's: 64 x 16 in 2 warps is 16 values a thread each)
    bd = default_block(x, cuda=min(64, pow2), cpu=min(32, pow2), block=block_d)
    warps = max(1, min(8, bd * block_n // 512)) if x.is_cuda else 1
    _selective_scan_kernel[(num_seqs + 1, cdiv(dim, bd))](
        x, dt, a_log, b, c, x if d_skip is None else d_skip.contiguous(),
        x if z is None else z, x if dt_bias is None else dt_bias.contiguous(), state, out,
        query_start_loc, seq_lens, state_rows,
        state_rows if state_table is None else state_table,
        num_seqs, num_tokens, dim, dstate,
        x.stride(0), dt.stride(0), b.stride(0), c.stride(0),
        0 if z is None else z.stride(0), out.stride(0), a_log.stride(0),
        state.stride(0), state.stride(1),
        BLOCK_D=bd, BLOCK_N=block_n, BLOCK_T=8, HAS_D=d_skip is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, HAS_TABLE=state_table is not None, ROW_SLOTS=slots,
        num_warps=warps,
    )
    return out


def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d_skip: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, *, state_table: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Varlen Mamba-1 selective scan with a per-row fp32 state (module docstring).

    ``x`` ``[T, D]`` (the convolved input), ``dt`` ``[T, D]`` (the raw time step, before
    ``dt_bias`` and the softplus), ``a_log`` ``[D, N]`` (``A = -exp(A_log)``), ``b``, ``c``
    ``[T, N]``, ``d_skip`` ``[D]`` or None, ``z`` ``[T, D]`` (the gate: ``y * silu(z)``) or None,
    ``dt_bias`` ``[D]`` or None, ``state`` ``[R, D, N]`` fp32; the metadata, ``state_table``
    and ``row_slots`` as in :mod:`mrv2_kernels.recurrent_state`. Per sequence the scan starts
    from ``state[src]`` if ``start > 0`` else zeros, and writes the states it keeps in place.
    Returns ``y`` ``[T, D]`` in ``out_dtype`` (default ``x``'s), zero on padding tokens. Runs
    :func:`selective_scan_triton` when :func:`use_triton` says so, else
    :func:`selective_scan_ref`."""
    op = (selective_scan_triton if use_triton(x) and all(
        t.dtype in _KERNEL_DTYPES for t in (x, dt, b, c)) else selective_scan_ref)
    return op(x, dt, a_log, b, c, d_skip, z, dt_bias, state, query_start_loc, seq_lens,
              state_rows, state_table=state_table, out_dtype=out_dtype, row_slots=row_slots)
