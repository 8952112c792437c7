"""Device ops of hybrid linear-attention layers (Qwen3-Next's Gated DeltaNet, Mamba-2 mixers):
the causal depthwise conv over the fused q/k/v projection, and the gated delta rule recurrence
(without its delta term, Mamba-2's SSM).

Both are varlen over a flat token batch and keep per-request state in a tensor indexed by a
state **row** (not by batch position). Per step (all device tensors, no host syncs on the
Triton path):

* ``query_start_loc`` int32 ``[N + 1]``, ``query_start_loc[0] == 0``: sequence ``i`` owns
  tokens ``query_start_loc[i]:query_start_loc[i + 1]``; ``N`` may count padding sequences of
  length 0, and tokens past ``query_start_loc[N]`` are padding.
* ``seq_lens`` int32 ``[N]``: the sequence's length after this step; its chunk starts at
  ``start = seq_lens[i] - query length``. ``start > 0``: the row holds the state after the
  first ``start`` tokens; ``start == 0``: begin from zeros, whatever the row holds.
* ``state_rows`` int32 ``[N]``: sequence ``i``'s state row. Real sequences have distinct rows; a
  zero-length sequence neither reads nor writes its row (so padding may alias any row).

Prefix caching (``state_table``, optional, int32 ``[R_req, 6]``, indexed by a sequence's state
row): ``(src_row, src_pos, snap_pos0, snap_row0, snap_pos1, snap_row1)``. A chunk that starts at
``start == src_pos`` reads its initial state from row ``src_row`` instead of its own (a request
resuming from a snapshot of a cached prefix); and when the chunk covers absolute position
``snap_pos`` (``start < snap_pos <= start + length``), the state after the first ``snap_pos``
tokens is also stored in row ``snap_row`` (a snapshot for later requests). A row's defaults
``(row, -1, -1, 0, -1, 0)`` mean neither. Snapshot rows are distinct from every row the step
reads or writes otherwise (the engine's rule), so the stores race with nothing.

Speculative decoding (``row_slots = S > 1``, the verify step's ``1 + k`` tokens): each
sequence owns ``S`` consecutive state rows, ``state_rows[i] * S + j``, and the state after a
sequence's first ``c`` tokens lives in row ``state_rows[i] * S + c % S``. A chunk reads its
initial state from the row of its ``start`` and stores the states after each of its last ``S``
tokens (the final one included), so the next step, whose ``start`` is the accepted count the
device computed, reads the state after the last accepted token: rejected drafts are dropped
without a host sync and without recomputing anything. ``S = 1`` is the plain layout. Table rows
(``src_row``, snapshot rows) are absolute rows (snapshot slots after the ``R_req * S`` rows).

State layouts: the conv state is ``[R, W - 1, D]`` in ``x``'s dtype (each row's last ``W - 1``
inputs, oldest first); the recurrent state is ``[R, Hv, K, V]`` fp32. Outputs are zero on
padding tokens (the kernels write those zeros; nothing is left uninitialised).

The Triton kernels give one program to each (sequence, channel block), which owns its state
tile and walks the sequence's tokens in order: the conv state is read before it is
overwritten within that program, and the delta-rule state tile stays in registers in fp32.
This token-serial delta rule is right for decode and acceptable for prefill for now; the next
step is a chunked prefill path (WY representation / UT transform: intra-chunk work as matrix
products, the state carried across chunks), as the fla library's ``chunk_gated_delta_rule``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, pdl, pdl_prologue, use_triton

__all__ = [
    "MAX_ROW_SLOTS",
    "STATE_TABLE_COLS",
    "causal_conv1d",
    "causal_conv1d_ref",
    "causal_conv1d_triton",
    "check_row_slots",
    "gated_delta_rule",
    "gated_delta_rule_ref",
    "default_state_table",
    "gated_delta_rule_triton",
    "gates_from_logits",
    "mamba_gates",
]

#: dtypes the Triton kernels take for activations (loaded and converted to fp32 at once).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The largest key head dim of :func:`gated_delta_rule_triton` (one register tile of K).
MAX_K = 256
_L2_EPS = 1e-6
#: The most state rows a sequence may own (``row_slots``: 1 + at most 16 drafts).
MAX_ROW_SLOTS = 17


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


#: Columns of a ``state_table`` row: ``(src_row, src_pos, snap_pos0, snap_row0, snap_pos1,
#: snap_row1)``.
STATE_TABLE_COLS = 6


def default_state_table(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``state_table`` of ``rows`` rows that changes nothing: each row reads its own state
    and stores no snapshot."""
    table = torch.zeros((rows, STATE_TABLE_COLS), dtype=torch.int32, device=device)
    table[:, 0] = torch.arange(rows, dtype=torch.int32, device=device)
    table[:, 1] = table[:, 2] = table[:, 4] = -1
    return table


def _check_table(state_table: torch.Tensor | None) -> None:
    if state_table is None:
        return
    if state_table.dim() != 2 or state_table.shape[1] != STATE_TABLE_COLS:
        raise ValueError(f"state_table must be [R, {STATE_TABLE_COLS}], got "
                         f"{tuple(state_table.shape)}")
    if state_table.dtype != torch.int32 or state_table.stride(1) != 1:
        raise TypeError("state_table must be int32 with a contiguous last dim")


def _table_host(state_table: torch.Tensor | None, row: int, start: int, row_slots: int = 1
                ) -> tuple[int, list[tuple[int, int]]]:
    """The references' reading of ``state_table``: the row to read the initial state from and
    the ``(tokens into the chunk, row)`` of each snapshot (unfiltered by the chunk length)."""
    own = row * row_slots + start % row_slots
    if state_table is None:
        return own, []
    src_row, src_pos, p0, r0, p1, r1 = state_table[row].tolist()
    return (src_row if start == src_pos else own), [(p0 - start, r0), (p1 - start, r1)]


def check_row_slots(row_slots: int) -> int:
    """``row_slots`` as an int, ``ValueError`` unless it is 1 to 17 (``1 +
    num_speculative_tokens``, at most 16 drafts)."""
    if isinstance(row_slots, bool) or not isinstance(row_slots, int) or not \
            1 <= row_slots <= MAX_ROW_SLOTS:
        raise ValueError(f"row_slots must be an int in 1..{MAX_ROW_SLOTS} (1 + "
                         f"num_speculative_tokens), got {row_slots!r}")
    return row_slots


def kept_counts(start: int, length: int, row_slots: int) -> list[tuple[int, int]]:
    """The references' stores of a chunk: ``(tokens into the chunk, row offset)`` of the states
    kept, the chunk's last ``row_slots`` (the final one last)."""
    return [(c, (start + c) % row_slots) for c in range(max(1, length - row_slots + 1),
                                                         length + 1)]


def _check_meta(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                state_rows: torch.Tensor) -> int:
    """The sequence count ``N`` after checking the metadata's shapes and dtypes (no sync)."""
    n = query_start_loc.shape[0] - 1
    if query_start_loc.dim() != 1 or n < 0:
        raise ValueError("query_start_loc must be 1-D of length N + 1")
    for name, t in (("seq_lens", seq_lens), ("state_rows", state_rows)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    for t in (query_start_loc, seq_lens, state_rows):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"step metadata must be int32 (or int64), got {t.dtype}")
    return n


@triton.jit
def _zero_tail(out_ptr: tl.tensor, qsl_ptr: tl.tensor, num_seqs: tl.tensor,
               num_tokens: tl.tensor, out_stride: int, cols: tl.tensor, cmask: tl.tensor,
               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr) -> None:
    """Triton helper: zeros in ``out_ptr``'s rows ``query_start_loc[N]:num_tokens`` (the
    padding tokens), columns ``cols`` (``[BLOCK_C]``) where ``cmask``."""
    end = tl.load(qsl_ptr + num_seqs).to(tl.int32)
    zero = tl.zeros([BLOCK_T, BLOCK_C], dtype=out_ptr.dtype.element_ty)
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(end, num_tokens, BLOCK_T):
        t = t0 + t_offs
        dst = out_ptr + t.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(dst, zero, mask=(t < num_tokens)[:, None] & cmask[None, :])


# ------------------------------------------------------------------------- causal conv1d


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
    """Plain-torch specification of :func:`causal_conv1d` (reads the metadata on the host)."""
    _check_conv(x, weight, bias, conv_state, activation)
    n = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    width = weight.shape[1]
    w = weight.float()
    out = torch.zeros_like(x)
    qsl, lens, rows = query_start_loc.tolist(), seq_lens.tolist(), state_rows.tolist()
    for i in range(n):
        bos, eos = qsl[i], qsl[i + 1]
        length = eos - bos
        if length <= 0:
            continue
        row, start = rows[i], lens[i] - length
        src, snaps = _table_host(state_table, row, start, slots)
        if start > 0:
            ctx = conv_state[src].float()
        else:
            ctx = torch.zeros(width - 1, x.shape[1], dtype=torch.float32, device=x.device)
        xs = torch.cat([ctx, x[bos:eos].float()])
        for c, snap_row in snaps:  # the state after c tokens: xs[c : c + W - 1]
            if 0 < c <= length:
                conv_state[snap_row] = xs[c:c + width - 1].to(conv_state.dtype)
        acc = torch.zeros(length, x.shape[1], dtype=torch.float32, device=x.device)
        if bias is not None:
            acc = acc + bias.float()
        for j in range(width):
            acc = acc + w[:, j] * xs[j:j + length]
        if activation == "silu":
            acc = F.silu(acc)
        out[bos:eos] = acc.to(x.dtype)
        for c, j in kept_counts(start, length, slots):  # the state after c tokens
            conv_state[row * slots + j] = xs[c:c + width - 1].to(conv_state.dtype)
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
    ROW_SLOTS: tl.constexpr, PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    # Programs (i < N, d block): sequence i's channels; program (N, d block): padding tokens.
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    if seq == num_seqs:
        _zero_tail(out_ptr, qsl_ptr, num_seqs, num_tokens, out_stride, d, dmask, BLOCK_T,
                   BLOCK_D)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    n = tl.load(qsl_ptr + seq + 1).to(tl.int32) - bos
    if n <= 0:  # padding: its row may be another sequence's
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
    """Triton implementation of :func:`causal_conv1d`: one launch, grid ``(N + 1, D /
    block_d)``; program ``(i, c)`` walks sequence ``i``'s tokens ``block_t`` at a time over
    channel block ``c`` and then rewrites its slice of the conv state; programs ``(N, c)``
    zero the padding tokens. ``x`` may have a row stride (its last dim is made contiguous);
    ``conv_state`` must have a contiguous last dim (it is updated in place)."""
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
        # (16 x 256 tiles: ptxas (sm_90) gives 4 warps 255 registers and 68-88 bytes of
        # spills, 8 warps 128-138 registers and none)
        num_warps=(8 if bt * bd >= 4096 else 4 if bt * bd >= 2048 else 2) if x.is_cuda else 1,
        **pdl(x),
    )
    return out


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_rows: torch.Tensor,
    activation: str | None = None, state_table: torch.Tensor | None = None,
    row_slots: int = 1,
) -> torch.Tensor:
    """Varlen causal depthwise conv1d with a rolling per-row state (Qwen3-Next's q/k/v conv).

    ``x`` ``[T, D]`` (fp32/bf16/fp16), ``weight`` ``[D, W]``, ``bias`` ``[D]`` or None,
    ``conv_state`` ``[R, W - 1, D]`` in ``x``'s dtype (each row's last ``W - 1`` inputs, oldest
    first), ``activation`` ``"silu"`` or None; the metadata as in the module docstring. Per
    sequence: ``ctx = conv_state[row]`` if ``start > 0`` else zeros; ``xs = cat(ctx,
    x[tokens])``; ``out[t] = act(bias + sum_j weight[:, j] * xs[t + j])`` in fp32 (the last tap
    multiplies the current token: ``nn.Conv1d(groups=D, padding=W - 1)`` truncated to the
    sequence); then ``conv_state[row] = xs[-(W - 1):]``, in place. Returns ``out`` ``[T, D]`` in
    ``x``'s dtype, zero on padding tokens. ``state_table``: snapshots and resumed states;
    ``row_slots``: the rows a sequence owns under speculative decoding (module docstring). Runs
    :func:`causal_conv1d_triton` when :func:`use_triton` says so, else
    :func:`causal_conv1d_ref`.
    """
    if use_triton(x) and x.dtype in _KERNEL_DTYPES:
        return causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, seq_lens,
                                    state_rows, activation, state_table, row_slots)
    return causal_conv1d_ref(x, weight, bias, conv_state, query_start_loc, seq_lens,
                             state_rows, activation, state_table, row_slots)


# ---------------------------------------------------------------------- gated delta rule


def _check_gdr(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, K] and v [T, Hv, V], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hk == 0 or hv % hk:
        raise ValueError(f"the v heads ({hv}) must be a multiple of the q/k heads ({hk})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (num_tokens, hv):
            raise ValueError(f"{name} must have shape ({num_tokens}, {hv}), got "
                             f"{tuple(t.shape)}")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be [R, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be fp32, got {state.dtype}")


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch specification of :func:`gated_delta_rule` (reads the metadata on the host):
    token by token, as HF transformers' ``torch_recurrent_gated_delta_rule`` (``delta=False``:
    the Mamba-2 SSM recurrence)."""
    _check_gdr(q, k, v, g, beta, state)
    g, beta = resolve_gates(g, beta, v, gate_params, dt_limits, skip)
    n = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    hv, dk, dv = state.shape[1:]
    group = hv // q.shape[1]
    out = torch.zeros(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    qsl, lens, rows = query_start_loc.tolist(), seq_lens.tolist(), state_rows.tolist()
    for i in range(n):
        bos, eos = qsl[i], qsl[i + 1]
        length = eos - bos
        if length <= 0:
            continue
        row, start = rows[i], lens[i] - length
        src, snaps = _table_host(state_table, row, start, slots)
        keep = dict(kept_counts(start, length, slots))
        if start > 0:
            s = state[src].clone()
        else:
            s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=state.device)
        qs = q[bos:eos].float().repeat_interleave(group, dim=1)  # [L, Hv, K]
        ks = k[bos:eos].float().repeat_interleave(group, dim=1)
        if l2norm_qk:
            qs = qs * torch.rsqrt((qs * qs).sum(-1, keepdim=True) + _L2_EPS)
            ks = ks * torch.rsqrt((ks * ks).sum(-1, keepdim=True) + _L2_EPS)
        qs = qs * scale
        vs, gs, bs = v[bos:eos].float(), g[bos:eos].float(), beta[bos:eos].float()
        for t in range(length):
            s = s * gs[t].exp()[:, None, None]
            upd = vs[t]
            if delta:
                upd = upd - (s * ks[t][:, :, None]).sum(1)  # v - S^T k: [Hv, V]
            s = s + ks[t][:, :, None] * (upd * bs[t][:, None])[:, None, :]
            o = (s * qs[t][:, :, None]).sum(1)
            if skip is not None:
                o = o + skip.float()[:, None] * vs[t]
            out[bos + t] = o.to(out.dtype)
            for c, snap_row in snaps:
                if c == t + 1:
                    state[snap_row] = s
            if t + 1 in keep:
                state[row * slots + keep[t + 1]] = s
    return out


def gates_from_logits(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's decay and write strength from the projections' raw values (HF's
    Qwen3-Next): ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, fp32,
    ``A_log`` and ``dt_bias`` per v head."""
    _check_gate_params(a, a_log, dt_bias)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def resolve_gates(g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                  gate_params: tuple[torch.Tensor, torch.Tensor] | None,
                  dt_limits: tuple[float, float] | None, skip: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' gates: the keywords checked, then ``g`` and ``beta`` as given, or made
    from the raw projections (:func:`gates_from_logits`; with ``dt_limits``
    :func:`mamba_gates`)."""
    _check_extras(v, gate_params, dt_limits, skip)
    if gate_params is None:
        return g, beta
    if dt_limits is None:
        return gates_from_logits(g, beta, *gate_params)
    return mamba_gates(g, *gate_params, dt_limits)


def check_triton_args(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, state_rows: torch.Tensor, state_table: torch.Tensor | None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None,
    dt_limits: tuple[float, float] | None, skip: torch.Tensor | None,
) -> int:
    """What both Triton forms of the delta rule check before launching (``op``: the name their
    errors give): shapes, metadata, the table and the keywords, the dtypes, the state's
    contiguous last dim, ``K <= MAX_K``. Returns the sequence count ``N``."""
    _check_gdr(q, k, v, g, beta, state)
    n = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    if gate_params is not None:
        _check_gate_params(g, *gate_params)
    _check_extras(v, gate_params, dt_limits, skip)
    for t in (q, k, v, beta):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"{op} takes fp32/bf16/fp16, got {t.dtype}")
    if state.stride(-1) != 1:
        raise ValueError("state must have a contiguous last dim")
    if q.shape[2] > MAX_K:
        raise ValueError(f"the key head dim must be at most {MAX_K}, got {q.shape[2]}")
    return n


@triton.jit
def raw_gates(gv: tl.tensor, bv: tl.tensor, neg_a: tl.tensor, dt_bias: tl.tensor,
              dt_lo: float, dt_hi: float, MAMBA_GATES: tl.constexpr
              ) -> tuple[tl.tensor, tl.tensor]:
    """Triton helper shared by both kernels: the log decay and write strength (fp32, scalars
    or vectors) from the raw ``g`` / ``beta`` values, ``neg_a = -exp(A_log[h])``:
    :func:`gates_from_logits`' arithmetic, or with ``MAMBA_GATES`` :func:`mamba_gates`' (``beta
    = clamp(softplus(g + dt_bias))``, ``g = neg_a * beta``; ``bv`` unused)."""
    xa = gv + dt_bias
    sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(xa)))  # softplus
    if MAMBA_GATES:
        step = tl.minimum(tl.maximum(sp, dt_lo), dt_hi)
        return neg_a * step, step
    return neg_a * sp, 1.0 / (1.0 + tl.exp(-bv))


def mamba_gates(dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                dt_limits: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba-2 mixer's decay and write strength from its raw ``dt`` projection: ``dt =
    clamp(softplus(dt + dt_bias), *dt_limits)``, ``g = -exp(A_log) * dt``, ``beta = dt``
    (fp32; per head)."""
    _check_gate_params(dt, a_log, dt_bias)
    step = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limits[0], max=dt_limits[1])
    return -a_log.float().exp() * step, step


def _check_extras(v: torch.Tensor, gate_params: tuple[torch.Tensor, torch.Tensor] | None,
                  dt_limits: tuple[float, float] | None, skip: torch.Tensor | None) -> None:
    if dt_limits is not None and gate_params is None:
        raise ValueError("dt_limits (Mamba-2 gates) needs gate_params=(A_log, dt_bias)")
    if skip is not None and skip.shape != (v.shape[1],):
        raise ValueError(f"skip must have shape ({v.shape[1]},) (one D per v head), got "
                         f"{tuple(skip.shape)}")


def _check_gate_params(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    hv = a.shape[-1]
    for name, t in (("A_log", a_log), ("dt_bias", dt_bias)):
        if t.shape != (hv,):
            raise ValueError(f"gate_params: {name} must have shape ({hv},), got "
                             f"{tuple(t.shape)}")


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _gated_delta_rule_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor,
    beta_ptr: tl.tensor, state_ptr: tl.tensor, out_ptr: tl.tensor,
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor, tbl_ptr: tl.tensor,
    a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor, skip_ptr: tl.tensor, dt_lo: float,
    dt_hi: float,
    num_seqs: int, num_tokens: int, scale: float, dim_k: int, dim_v: int, group: int,
    q_st: int, q_sh: int, k_st: int, k_sh: int, v_st: int, v_sh: int,
    g_st: int, g_sh: int, b_st: int, b_sh: int, o_st: int, o_sh: int,
    s_sr: int, s_sh: int, s_sk: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr, HAS_TABLE: tl.constexpr, RAW_GATES: tl.constexpr,
    MAMBA_GATES: tl.constexpr, HAS_SKIP: tl.constexpr, ROW_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    # Programs (i < N, v head, V block) run sequence i; programs (N, ...) zero the padding.
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < dim_k
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < dim_v
    if seq == num_seqs:
        _zero_tail(out_ptr + h * o_sh, qsl_ptr, num_seqs, num_tokens, o_st, vv, vmask,
                   BLOCK_T, BLOCK_V)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int32)
    if eos <= bos:  # padding: its row may be another sequence's
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - (eos - bos)
    has_init = start > 0
    row = tl.load(rows_ptr + seq).to(tl.int64)
    hk = h // group
    tile = h * s_sh + kk[:, None] * s_sk + vv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    # The table as scalars (rows and in-chunk counts): the snapshot stores below are scalar
    # branches, so no second or third [K, V] pointer tensor stays live through the token loop
    # (they spilled: 184 bytes at K = 128, V block 32).
    n = eos - bos
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
    s = tl.load(state_ptr + src_row * s_sr + tile, mask=smask & has_init, other=0.0)
    if RAW_GATES:  # g and beta from the raw projections: gates_from_logits / mamba_gates
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_SKIP:
        skip = tl.load(skip_ptr + h).to(tl.float32)
    bos64 = bos.to(tl.int64)
    for i in range(0, n):
        t64 = bos64 + i
        qt = tl.load(q_ptr + t64 * q_st + hk * q_sh + kk, mask=kmask, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + t64 * k_st + hk * k_sh + kk, mask=kmask, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + t64 * v_st + h * v_sh + vv, mask=vmask, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + t64 * g_st + h * g_sh).to(tl.float32)
        bt = tl.load(beta_ptr + t64 * b_st + h * b_sh).to(tl.float32)
        if RAW_GATES:
            gt, bt = raw_gates(gt, bt, neg_a, dt_bias, dt_lo, dt_hi, MAMBA_GATES)
        v_in = vt
        if L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        qt = qt * scale
        s = s * tl.exp(gt)
        if DELTA:
            vt = vt - tl.sum(s * kt[:, None], axis=0)  # v - S^T k: [BLOCK_V]
        s = s + kt[:, None] * (vt * bt)[None, :]
        o = tl.sum(s * qt[:, None], axis=0)
        if HAS_SKIP:
            o += skip * v_in
        tl.store(out_ptr + t64 * o_st + h * o_sh + vv, o.to(out_ptr.dtype.element_ty),
                 mask=vmask)
        if HAS_TABLE:
            if i + 1 == c0:
                tl.store(state_ptr + snap0 * s_sr + tile, s, mask=smask)
            if i + 1 == c1:
                tl.store(state_ptr + snap1 * s_sr + tile, s, mask=smask)
        if ROW_SLOTS > 1:  # noqa: SIM102 (constexpr: compiled out at 1)
            # the states after the chunk's last tokens but the final one
            if (i + ROW_SLOTS >= n) & (i + 1 < n):
                kept = base + (start + i + 1) % ROW_SLOTS
                tl.store(state_ptr + kept * s_sr + tile, s, mask=smask)
    tl.store(state_ptr + (base + (start + n) % ROW_SLOTS) * s_sr + tile, s, mask=smask)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True,
    *,
    delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
    block_v: int | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`gated_delta_rule`: one launch, grid ``(N + 1, Hv, V /
    block_v)``. Program ``(i, h, c)`` keeps its ``[K, block_v]`` state tile in fp32 registers
    (``K <= 256``, padded to a power of two) and walks sequence ``i``'s tokens in order, its
    loop bounds read on the device; programs ``(N, h, c)`` zero the padding tokens. q/k/v may
    be strided views (their last dim is made contiguous); ``state`` must have a contiguous
    last dim (it is updated in place)."""
    n = check_triton_args("gated_delta_rule_triton", q, k, v, g, beta, state, query_start_loc,
                          seq_lens, state_rows, state_table, gate_params, dt_limits, skip)
    slots = check_row_slots(row_slots)
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = _empty((num_tokens, hv, dv), out_dtype or v.dtype, v.device)
    if out.numel() == 0:
        return out
    block_k = next_power_of_2(dk)
    pow2 = next_power_of_2(dv)
    # [K, 16] state tiles in 4 warps at K = 128: ptxas (sm_90) gives them 219 registers and no
    # spills with the snapshot table; [K, 32] in 4 warps spilled 172 bytes (255 registers)
    bv = default_block(v, cuda=min(16, pow2), cpu=min(64, pow2), block=block_v)
    warps = max(1, min(8, block_k * bv // 512)) if v.is_cuda else 1
    _gated_delta_rule_kernel[(n + 1, hv, cdiv(dv, bv))](
        q, k, v, g, beta, state, out, query_start_loc, seq_lens, state_rows,
        state_rows if state_table is None else state_table,
        *(gate_params if gate_params is not None else (g, g)), g if skip is None else skip,
        *(dt_limits if dt_limits is not None else (0.0, 0.0)),
        n, num_tokens, float(scale), dk, dv, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=l2norm_qk, DELTA=delta, BLOCK_K=block_k, BLOCK_V=bv, BLOCK_T=8,
        HAS_TABLE=state_table is not None, RAW_GATES=gate_params is not None,
        MAMBA_GATES=dt_limits is not None, HAS_SKIP=skip is not None, ROW_SLOTS=slots,
        num_warps=warps,
        **pdl(v),
    )
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Varlen gated delta rule with a per-row fp32 matrix state (Qwen3-Next's linear attention).

    ``q``, ``k`` ``[T, Hk, K]``; ``v`` ``[T, Hv, V]`` with ``Hv`` a multiple of ``Hk`` (v head
    ``h`` reads q/k head ``h // (Hv // Hk)``); ``g`` ``[T, Hv]`` fp32 log decay (``<= 0``);
    ``beta`` ``[T, Hv]`` (already sigmoid-ed); ``state`` ``[R, Hv, K, V]`` fp32; the metadata as
    in the module docstring. Per sequence and v head, from ``S = state[row, h]`` if ``start >
    0`` else zeros, for each token in fp32: ``q, k`` l2-normalised (``rsqrt(sum(x^2) + 1e-6)``)
    when ``l2norm_qk``; ``q *= scale``; ``S *= exp(g)``; ``delta = (v - S^T k) * beta``; ``S +=
    outer(k, delta)``; ``o = S^T q``. ``delta=False`` drops the ``S^T k`` term (``S = exp(g) S +
    outer(k, beta v)``): Mamba-2's SSM with ``q = C``, ``k = B``, ``v = x``, ``g = dt A``,
    ``beta = dt``, ``l2norm_qk=False``, ``scale=1``. Returns ``o`` ``[T, Hv, V]`` in ``v``'s
    dtype (zero on padding tokens) and writes the final ``S`` into ``state[row, h]``, in place.
    ``state_table``: snapshots and resumed states (module docstring). ``gate_params`` ``(A_log,
    dt_bias)``: ``g`` and ``beta`` are the raw projections ``a`` and ``b``, turned into the decay
    and write strength inside the op (:func:`gates_from_logits`); with ``dt_limits`` both are
    the raw ``dt`` of a Mamba-2 mixer (:func:`mamba_gates`). ``skip`` ``[Hv]``: ``o += skip[h] *
    v`` (Mamba-2's ``D``). ``out_dtype``: the output's (default ``v``'s). ``row_slots``: the
    rows a sequence owns under speculative decoding (module docstring). Runs
    :func:`gated_delta_rule_triton` when :func:`use_triton` says so, else
    :func:`gated_delta_rule_ref`.
    """
    op = (gated_delta_rule_triton if use_triton(v) and all(
        t.dtype in _KERNEL_DTYPES for t in (q, k, v, beta)) else gated_delta_rule_ref)
    return op(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
              delta=delta, state_table=state_table, gate_params=gate_params,
              dt_limits=dt_limits, skip=skip, out_dtype=out_dtype, row_slots=row_slots)
