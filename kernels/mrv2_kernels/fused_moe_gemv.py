"""Decode-sized fused MoE on integer and MXFP4 experts, on the CUDA cores.

:mod:`~mrv2_kernels.fused_moe`'s GEMMs pad each expert's rows to a 16-row ``tl.dot`` block
and hand every unpacked weight tile to the tensor cores through shared memory, one 16-bit
store a weight; with one or two tokens that is most of their time (gpt-oss-20b's MXFP4 layer
at 0.15 of its byte floor, Qwen3-30B-A3B's as 4-bit GPTQ at 0.13: ``bench_int``). Here one
program takes one (token, expert) pair and a slice of output features, the pair's row of
``x`` against the expert's packed rows ``[BLOCK_N, BLOCK_K / pack]`` in the layout they are
loaded in: each word's integers (or e2m1 codes) become floats from their bits
(:mod:`~mrv2_kernels.int_bits`: an OR and an exact subtraction, or an exact multiplication),
are multiplied by the matching ``x`` values (bf16 / fp16 ``x`` read as int32 pairs, which
the compiler pipelines) and summed per word; each word's sum is scaled by its group's scale, and
the words' sums of a row are added once at the end.

- ``_moe_gemv_gate_up_kernel``: grid ``(pairs, I / BLOCK_N)``, the gate and up rows of the
  slice, biases, the rounding to ``x``'s dtype and the gated activation, as the ``tl.dot``
  kernel's epilogue; ``act [pairs, I]``.
- ``_moe_gemv_down_kernel``: grid ``(pairs, H / BLOCK_N)``, the down rows, bias and routing
  weight, the pair's fp32 row of ``y``; the last of a token's ``top_k`` programs to arrive at
  a slice adds the rows in slot order (deterministic) into ``out`` and resets its count.

No sorting or alignment: a pair is ``(token, slot)``, its expert ``topk_ids[token, slot]``.
Padding tokens (``valid_tokens``) read no weights. Same contract as
:func:`~mrv2_kernels.fused_moe.fused_moe_triton` for integer experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._backend import cdiv, last_to_arrive
from .fused_moe_int import IntExperts, _int_scale
from .fused_moe_kernels import _glu
from .fused_moe_ref import ACTIVATIONS, PLAIN, Epilogue
from .int_bits import TWO23_BITS, bias, biased, e2m1, pair_half

__all__ = ["GemvTiles", "fused_moe_gemv", "gemv_fits"]


class GemvTiles(NamedTuple):
    """Output features per program of the gate/up and down kernels, the widest K step (the
    launch halves it until it divides K), rows a thread holds for each ``x`` value it loads
    (``rows`` divides both slices), warps and pipeline stages. The defaults: the best of
    ``bench_int --magic`` on an H100 (2026-12-05) at 1 and 2 tokens, within 2% of each
    layer's best (gpt-oss-20b's MXFP4 layer 116.1 -> 82.8 µs at 1 token, 182.4 -> 135.1 at
    2; Qwen3-30B-A3B's as 4-bit GPTQ 51.1 -> 28.0 and 71.2 -> 38.4); 64-wide slices were
    10-45% slower."""

    block_n1: int = 32
    block_n2: int = 32
    block_k: int = 128
    rows: int = 2
    num_warps: int = 4
    num_stages: int = 3


def gemv_fits(ints: IntExperts) -> bool:
    """Whether the kernels take these experts: each group whole words."""
    return ints.group_size % (32 // ints.bits) == 0


@triton.jit
def _place_values(words: tl.tensor, p: tl.constexpr, BITS: tl.constexpr, FP4: tl.constexpr,
                  two23: tl.tensor) -> tl.tensor:
    """fp32 values at place ``p`` (bits ``BITS * p`` on) of each word: e2m1 values (``FP4``),
    else ``2 ** 23 + q`` (the caller subtracts ``2 ** 23 + zero``)."""
    t = words >> (BITS * p)
    if FP4:  # noqa: SIM108 (a constexpr branch)
        out = e2m1(t & 15)
    else:
        out = biased(t & ((1 << BITS) - 1), tl.float32, two23)
    return out


@triton.jit
def _rows_dot(x_row: tl.tensor, w_at: tl.tensor, s_at: tl.tensor, z_at: tl.tensor,
              s_s2: int, row_ok: tl.tensor, K: int, two23: tl.tensor, BITS: tl.constexpr,
              HAS_ZEROS: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_K: tl.constexpr, X_PAIRS: tl.constexpr, STAGES: tl.constexpr,
              R: tl.constexpr, NR: tl.constexpr) -> tl.tensor:
    """The fp32 dot products of the row at ``x_row`` (``K`` values) with the packed rows at
    ``w_at`` (``[R, NR, 1]`` pointers to each row's first word: the leading ``R`` rows
    of a column are one thread's, so each ``x`` value it loads serves ``R`` rows), their
    group scales and zero points at ``s_at`` / ``z_at`` (same shape, ``s_s2`` apart along
    the row); ``BLOCK_K`` divides ``K``. Returns ``[R, NR]``."""
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = GROUP % BLOCK_K == 0  # a step in one group: a scale a row
    wk = tl.arange(0, BKW)
    wk3 = wk[None, None, :]
    x_at = x_row + wk3 * PACK  # [1, 1, BKW]: each word's first x value
    x2_at = x_row.to(tl.pointer_type(tl.int32)) + wk3 * (PACK // 2)  # 16-bit pairs
    acc = tl.zeros([R, NR, BKW], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w_idx = k0 // PACK + wk3
        words = tl.load(w_at + w_idx, mask=row_ok, other=0)
        if ONE_GROUP:  # noqa: SIM108 (a constexpr branch)
            grp = (k0 // GROUP) * s_s2
        else:
            grp = (w_idx // (GROUP // PACK)) * s_s2
        scale = _int_scale(s_at + grp, row_ok, FP4)  # (e8m0 read as an fp32's exponent)
        if not FP4:
            if HAS_ZEROS:  # 2 ** 23 + z, from bits too
                zp = biased(tl.load(z_at + grp, mask=row_ok, other=0).to(tl.int32), tl.float32,
                            two23)
            else:
                zp = bias(tl.float32) + (1 << (BITS - 1))
        part = tl.zeros([R, NR, BKW], tl.float32)
        for p in tl.static_range(PACK):
            if X_PAIRS:  # two 16-bit values a 4-byte load
                if p % 2 == 0:
                    pairs = tl.load(x2_at + (k0 // 2 + p // 2))
                xv = pair_half(pairs, p % 2 == 1, x_row.dtype.element_ty)
            else:
                xv = tl.load(x_at + (k0 + p)).to(tl.float32)
            v = _place_values(words, p, BITS, FP4, two23)
            if not FP4:
                v = v - zp  # q - z, exact
            part += xv * v
        acc += part * scale
    return tl.sum(acc, axis=2)


@triton.jit
def _slice_rows(pid: tl.tensor, BLOCK_N: tl.constexpr, R: tl.constexpr) -> tl.tensor:
    """Slice ``pid``'s output rows as ``[R, BLOCK_N / R]``: row ``i * (BLOCK_N / R) + j`` at
    ``[i, j]``, so the ``R`` rows of a column are one thread's (:func:`_rows_dot`)."""
    return pid * BLOCK_N + (tl.arange(0, R)[:, None] * (BLOCK_N // R)
                            + tl.arange(0, BLOCK_N // R)[None, :])


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, ws_ptr: tl.tensor, wz_ptr: tl.tensor,
    ids_ptr: tl.tensor, act_ptr: tl.tensor, valid_ptr: tl.tensor, b_ptr: tl.tensor,
    top_k: int, hidden: int, inter: int, first_token: int, x_s0: int, w_s0: int, w_s1: int,
    ws_s0: int, ws_s1: int, ws_s2: int, up_w: int, up_s: int, act_s0: int, b_s0: int,
    two23: int, act_limit: float,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_PAIRS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STAGES: tl.constexpr,
    R: tl.constexpr = 1,
) -> None:
    pair = tl.program_id(0)
    token = pair // top_k
    if HAS_VALID:  # noqa: SIM102 (a constexpr branch, then a run-time one)
        if first_token + token >= tl.load(valid_ptr):
            return
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = _slice_rows(tl.program_id(1), BLOCK_N, R)
    row_ok = rows < inter
    r64 = rows.to(tl.int64)[:, :, None]
    w_at = w_ptr + expert * w_s0 + r64 * w_s1
    s_at = ws_ptr + expert * ws_s0 + r64 * ws_s1
    z_at = wz_ptr + expert * ws_s0 + r64 * ws_s1
    x_row = x_ptr + token.to(tl.int64) * x_s0
    ok3 = row_ok[:, :, None]
    gate = _rows_dot(x_row, w_at, s_at, z_at, ws_s2, ok3, hidden, two23, BITS, HAS_ZEROS, FP4,
                     GROUP, BLOCK_K, X_PAIRS, STAGES, R, BLOCK_N // R)
    up = _rows_dot(x_row, w_at + up_w, s_at + up_s, z_at + up_s, ws_s2, ok3, hidden, two23,
                   BITS, HAS_ZEROS, FP4, GROUP, BLOCK_K, X_PAIRS, STAGES, R,
                   BLOCK_N // R)
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * b_s0 + rows, mask=row_ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + expert * b_s0 + inter + rows, mask=row_ok, other=0.0).to(
            tl.float32)
    # as the unfused layers: gate and up rounded to the dtype, the activation in fp32
    dtype = act_ptr.dtype.element_ty
    act = _glu(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), ACT, act_limit)
    tl.store(act_ptr + pair.to(tl.int64) * act_s0 + rows, act.to(dtype), mask=row_ok)


@triton.jit
def _moe_gemv_down_kernel(
    act_ptr: tl.tensor, w_ptr: tl.tensor, ws_ptr: tl.tensor, wz_ptr: tl.tensor,
    ids_ptr: tl.tensor, tw_ptr: tl.tensor, y_ptr: tl.tensor, out_ptr: tl.tensor,
    counters_ptr: tl.tensor, valid_ptr: tl.tensor, b_ptr: tl.tensor,
    top_k: int, hidden: int, inter: int, first_token: int, act_s0: int, w_s0: int, w_s1: int,
    ws_s0: int, ws_s1: int, ws_s2: int, tw_s0: int, tw_s1: int, y_s0: int, out_s0: int,
    b_s0: int, two23: int,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_PAIRS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr,
    R: tl.constexpr = 1,
) -> None:
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // top_k
    if HAS_VALID:  # noqa: SIM102 (a constexpr branch, then a run-time one)
        if first_token + token >= tl.load(valid_ptr):
            return
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = _slice_rows(pid_n, BLOCK_N, R)
    col_ok = cols < hidden
    c64 = cols.to(tl.int64)[:, :, None]
    y = _rows_dot(act_ptr + pair.to(tl.int64) * act_s0, w_ptr + expert * w_s0 + c64 * w_s1,
                  ws_ptr + expert * ws_s0 + c64 * ws_s1, wz_ptr + expert * ws_s0 + c64 * ws_s1,
                  ws_s2, col_ok[:, :, None], inter, two23, BITS, HAS_ZEROS, FP4, GROUP,
                  BLOCK_K, X_PAIRS, STAGES, R, BLOCK_N // R)
    if HAS_BIAS:
        y += tl.load(b_ptr + expert * b_s0 + cols, mask=col_ok, other=0.0).to(tl.float32)
    slot = pair - token * top_k
    y = y * tl.load(tw_ptr + token.to(tl.int64) * tw_s0 + slot * tw_s1).to(tl.float32)
    tl.store(y_ptr + pair.to(tl.int64) * y_s0 + cols, y, mask=col_ok)
    # the last of the token's top_k programs at this slice adds its rows in slot order
    if last_to_arrive(counters_ptr + token * tl.num_programs(1) + pid_n, top_k):
        total = tl.zeros([R, BLOCK_N // R], tl.float32)
        for j in range(0, top_k):
            total += tl.load(y_ptr + (token * top_k + j).to(tl.int64) * y_s0 + cols,
                             mask=col_ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token.to(tl.int64) * out_s0 + cols,
                 total.to(out_ptr.dtype.element_ty), mask=col_ok)


def _pairs_ok(t: torch.Tensor) -> bool:
    """16-bit rows the kernels may read as int32 pairs: 4-byte aligned rows."""
    return t.dtype != torch.float32 and t.data_ptr() % 4 == 0 and t.stride(0) % 2 == 0


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                   ints: IntExperts, counters: torch.Tensor,
                   tiles: GemvTiles | None = None, valid_tokens: torch.Tensor | None = None,
                   first_token: int = 0, epilogue: Epilogue = PLAIN) -> None:
    """The module's two launches for ``x`` ``[T, H]`` into ``out`` ``[T, H]`` (checked
    arguments, :func:`~mrv2_kernels.fused_moe.fused_moe_triton`'s; ``counters``: at least
    ``T * H / block_n2`` zeroed arrival counts, left zeroed)."""
    tiles = tiles or GemvTiles()
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    z13 = ints.w13_zeros if ints.w13_zeros is not None else ints.w13_scale
    z2 = ints.w2_zeros if ints.w2_zeros is not None else ints.w2_scale
    valid = valid_tokens if valid_tokens is not None else ids
    pack = 32 // ints.bits
    common = dict(BITS=ints.bits, HAS_ZEROS=ints.w13_zeros is not None, FP4=ints.fp4,
                  GROUP=ints.group_size, HAS_VALID=valid_tokens is not None,
                  STAGES=tiles.num_stages, R=tiles.rows, num_warps=tiles.num_warps)

    def k_step(k: int) -> dict[str, object]:  # the widest step <= block_k that divides k
        step = tiles.block_k  # (k is whole words: a step of one word at worst)
        while step > pack and k % step:
            step //= 2
        return {"BLOCK_K": step}

    w13_bias, w2_bias = epilogue.w13_bias, epilogue.w2_bias
    b13 = w13_bias if w13_bias is not None else x
    _moe_gemv_gate_up_kernel[(num_pairs, cdiv(inter, tiles.block_n1))](
        x, w13, ints.w13_scale, z13, ids, act, valid, b13, top_k, hidden, inter, first_token,
        x.stride(0), w13.stride(0), w13.stride(1), *ints.w13_scale.stride(),
        inter * w13.stride(1), inter * ints.w13_scale.stride(1), act.stride(0),
        b13.stride(0), TWO23_BITS, epilogue.swiglu_limit,
        BLOCK_N=tiles.block_n1, X_PAIRS=_pairs_ok(x), HAS_BIAS=w13_bias is not None,
        ACT=ACTIVATIONS.index(epilogue.activation), **common, **k_step(hidden))
    b2 = w2_bias if w2_bias is not None else x
    _moe_gemv_down_kernel[(num_pairs, cdiv(hidden, tiles.block_n2))](
        act, w2, ints.w2_scale, z2, ids, topk_weights, y, out, counters, valid, b2, top_k,
        hidden, inter, first_token, act.stride(0), w2.stride(0), w2.stride(1),
        *ints.w2_scale.stride(), topk_weights.stride(0),
        topk_weights.stride(1), y.stride(0), out.stride(0), b2.stride(0), TWO23_BITS,
        BLOCK_N=tiles.block_n2, X_PAIRS=_pairs_ok(act), HAS_BIAS=w2_bias is not None,
        **common, **k_step(inter))
