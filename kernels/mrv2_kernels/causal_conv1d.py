"""Device op of hybrid linear-attention layers' short convolution (Qwen3-Next's Gated DeltaNet,
Mamba-2 mixers): the causal depthwise conv over the fused q/k/v projection, varlen over a flat
token batch, with a rolling per-row conv state. The step metadata, ``state_table``,
``row_slots`` and the state layout follow :mod:`mrv2_kernels.recurrent_state`'s docstring.
The dispatcher, :func:`mrv2_kernels.linear_attention.causal_conv1d`, stays beside the delta
rule's: both dispatch through that module's ``use_triton`` (tests patch it to route both).

The Triton kernel gives one program to each (sequence, channel block): the conv state is read
before it is overwritten within that program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import (
    cdiv,
    default_block,
    next_power_of_2,
    pdl,
    pdl_early_meta,
    pdl_prologue,
    pdl_release,
    pdl_wait,
)
from .recurrent_state import (
    _KERNEL_DTYPES,
    _check_meta,
    _check_table,
    _empty,
    _zero_tail,
    check_row_slots,
    iter_sequences,
)

__all__ = ["causal_conv1d_ref", "causal_conv1d_triton"]


def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv_state: torch.Tensor, activation: str | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, D] and weight [D, W], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    d, width = weight.shape
    if width < 2:
        raise ValueError(f"the conv width must be at least 2, got {width}")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"bias must have shape ({d},), got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (width - 1, d):
        raise ValueError(f"conv_state must be [R, {width - 1}, {d}], got "
                         f"{tuple(conv_state.shape)}")
    if conv_state.dtype != x.dtype:
        raise TypeError(f"conv_state must be {x.dtype} like x, got {conv_state.dtype}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_rows: torch.Tensor,
    activation: str | None = None, state_table: torch.Tensor | None = None,
    row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch specification of :func:`~mrv2_kernels.linear_attention.causal_conv1d`
    (reads the metadata on the host)."""
    _check_conv(x, weight, bias, conv_state, activation)
    _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    width = weight.shape[1]
    w = weight.float()
    out = torch.zeros_like(x)
    for seq in iter_sequences(query_start_loc, seq_lens, state_rows, state_table, slots):
        bos, eos, length = seq.bos, seq.eos, seq.length
        if seq.start > 0:
            ctx = conv_state[seq.src].float()
        else:
            ctx = torch.zeros(width - 1, x.shape[1], dtype=torch.float32, device=x.device)
        xs = torch.cat([ctx, x[bos:eos].float()])
        for c, snap_row in seq.snaps:  # the state after c tokens: xs[c : c + W - 1]
            conv_state[snap_row] = xs[c:c + width - 1].to(conv_state.dtype)
        acc = torch.zeros(length, x.shape[1], dtype=torch.float32, device=x.device)
        if bias is not None:
            acc = acc + bias.float()
        for j in range(width):
            acc = acc + w[:, j] * xs[j:j + length]
        if activation == "silu":
            acc = F.silu(acc)
        out[bos:eos] = acc.to(x.dtype)
        for c, kept_row in seq.kept:  # the state after c tokens
            conv_state[kept_row] = xs[c:c + width - 1].to(conv_state.dtype)
    return out


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _causal_conv1d_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, b_ptr: tl.tensor, state_ptr: tl.tensor,
    out_ptr: tl.tensor, qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor,
    tbl_ptr: tl.tensor,
    num_seqs: int, num_tokens: int, dim: int,
    x_stride: int, out_stride: int, w_stride: int, s_row_stride: int, s_t_stride: int,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, HAS_TABLE: tl.constexpr,
    ROW_SLOTS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False,
) -> None:
    # EARLY (pdl_early_meta's rule): the step's metadata, the state table and the bias before
    # the wait for the previous kernel (no PDL kernel writes them), the inputs after it
    if EARLY:
        pdl_release(PDL)
    else:
        pdl_prologue(PDL)
    # Programs (i < N, d block): sequence i's channels; program (N, d block): padding tokens.
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    if seq == num_seqs:
        if EARLY:
            pdl_wait(PDL)
        _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, out_stride, d, dmask, BLOCK_T,
                   BLOCK_D)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    n = tl.load(qsl_ptr + seq + 1).to(tl.int32) - bos
    if n <= 0:  # padding: its row may be another sequence's
        if EARLY:
            pdl_wait(PDL)  # (every program waits: the chain's completion goes through it)
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - n
    has_init = start > 0
    row = tl.load(rows_ptr + seq).to(tl.int64)
    s_base = state_ptr + row * ROW_SLOTS * s_row_stride  # the sequence's first state row
    src_base = s_base + (start % ROW_SLOTS) * s_row_stride  # the initial state's row
    if HAS_TABLE:
        tbl = tbl_ptr + row * 6
        src_row = tl.load(tbl).to(tl.int64)
        src_base = tl.where(start == tl.load(tbl + 1), state_ptr + src_row * s_row_stride,
                            src_base)
    x_base = x_ptr + bos.to(tl.int64) * x_stride
    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if EARLY:
        pdl_wait(PDL)
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + t_offs  # positions in the chunk
        live = t < n
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(WIDTH):
            # Input j of output t is chunk position p; p < 0 is context row WIDTH - 1 + p.
            p = t + (j - (WIDTH - 1))
            in_x = (live & (p >= 0))[:, None] & dmask[None, :]
            src = x_base + tl.maximum(p, 0).to(tl.int64)[:, None] * x_stride + d[None, :]
            xv = tl.load(src, mask=in_x, other=0.0).to(tl.float32)
            in_ctx = (live & (p < 0) & has_init)[:, None] & dmask[None, :]
            ctx = src_base + tl.maximum(p + (WIDTH - 1), 0)[:, None] * s_t_stride + d[None, :]
            cv = tl.load(ctx, mask=in_ctx, other=0.0).to(tl.float32)
            wj = tl.load(w_ptr + d * w_stride + j, mask=dmask, other=0.0).to(tl.float32)
            acc += (xv + cv) * wj[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        dst = out_ptr + (bos + t).to(tl.int64)[:, None] * out_stride + d[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & dmask[None, :])
    r = tl.arange(0, BLOCK_W)
    if HAS_TABLE:  # snapshots: the state after c tokens, into rows no one else touches
        for k in tl.static_range(2):
            c = tl.load(tbl + 2 + 2 * k) - start
            if (c > 0) & (c <= n):
                snap_base = state_ptr + tl.load(tbl + 3 + 2 * k).to(tl.int64) * s_row_stride
                _conv_state_store(snap_base, x_base, src_base, c, has_init, r, d, dmask,
                                  x_stride, s_t_stride, WIDTH, False)
    # The states after the chunk's last ROW_SLOTS counts c (1 <= c <= n), the state after c
    # tokens in row c % ROW_SLOTS (of the sequence's rows). Only the count that is a multiple
    # of ROW_SLOTS goes to the initial state's row (the whole chunk's, with ROW_SLOTS 1): it
    # comes last, each store's reads of the old rows before its writes.
    last = (n // ROW_SLOTS) * ROW_SLOTS
    for u in tl.static_range(ROW_SLOTS):
        c = last + 1 + u
        c = tl.where(c > n, c - ROW_SLOTS, c)
        if c >= 1:
            _conv_state_store(s_base + ((start + c) % ROW_SLOTS) * s_row_stride, x_base,
                              src_base, c, has_init, r, d, dmask, x_stride, s_t_stride, WIDTH,
                              True)


@triton.jit
def _conv_state_store(dst_base: tl.tensor, x_base: tl.tensor, ctx_base: tl.tensor,
                      c: tl.tensor, has_init: tl.tensor, r: tl.tensor, d: tl.tensor,
                      dmask: tl.tensor, x_stride: int, s_t_stride: int,
                      WIDTH: tl.constexpr, BARRIER: tl.constexpr) -> None:
    """Triton helper: the conv state after the chunk's first ``c`` tokens (its rows ``r``:
    chunk position ``c - (WIDTH - 1) + r``, an input or an old context row) into
    ``dst_base``; ``BARRIER``: every thread's reads precede any write (``dst_base`` may be the
    context's row)."""
    p = c - (WIDTH - 1) + r
    rmask = (r < WIDTH - 1)[:, None] & dmask[None, :]
    src = x_base + tl.maximum(p, 0).to(tl.int64)[:, None] * x_stride + d[None, :]
    xv = tl.load(src, mask=rmask & (p >= 0)[:, None], other=0.0).to(tl.float32)
    ctx = ctx_base + tl.maximum(p + (WIDTH - 1), 0)[:, None] * s_t_stride + d[None, :]
    cv = tl.load(ctx, mask=rmask & ((p < 0) & has_init)[:, None], other=0.0).to(tl.float32)
    if BARRIER:
        tl.debug_barrier()
    dst = dst_base + r[:, None] * s_t_stride + d[None, :]
    tl.store(dst, (xv + cv).to(dst_base.dtype.element_ty), mask=rmask)


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_rows: torch.Tensor,
    activation: str | None = None, state_table: torch.Tensor | None = None,
    row_slots: int = 1,
    *,
    block_t: int | None = None,
    block_d: int | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`~mrv2_kernels.linear_attention.causal_conv1d`: one
    launch, grid ``(N + 1, D / block_d)``; program ``(i, c)`` walks sequence ``i``'s tokens
    ``block_t`` at a time over channel block ``c`` and then rewrites its slice of the conv
    state; programs ``(N, c)`` zero the padding tokens. ``x`` may have a row stride (its last
    dim is made contiguous); ``conv_state`` must have a contiguous last dim (it is updated in
    place)."""
    _check_conv(x, weight, bias, conv_state, activation)
    n = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"causal_conv1d_triton takes fp32/bf16/fp16, got {x.dtype}")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state must have a contiguous last dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, dim = x.shape
    width = weight.shape[1]
    out = _empty((num_tokens, dim), x.dtype, x.device)
    if num_tokens == 0 or dim == 0:
        return out
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    pow2 = next_power_of_2(dim)
    bd = default_block(x, cuda=min(256, pow2), cpu=min(64, pow2), block=block_d)
    bt = default_block(x, cuda=16, cpu=8, block=block_t)
    _causal_conv1d_kernel[(n + 1, cdiv(dim, bd))](
        x, weight, weight if bias is None else bias.contiguous(), conv_state, out,
        query_start_loc, seq_lens, state_rows,
        state_rows if state_table is None else state_table,
        n, num_tokens, dim,
        x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0),
        conv_state.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_T=bt, BLOCK_D=bd, BLOCK_W=next_power_of_2(width - 1),
        HAS_TABLE=state_table is not None, ROW_SLOTS=slots,
        EARLY=pdl_early_meta(x, default=True),
        # (16 x 256 tiles: ptxas (sm_90) gives 4 warps 255 registers and 68-88 bytes of
        # spills, 8 warps 128-138 registers and none)
        num_warps=(8 if bt * bd >= 4096 else 4 if bt * bd >= 2048 else 2) if x.is_cuda else 1,
        **pdl(x),
    )
    return out

