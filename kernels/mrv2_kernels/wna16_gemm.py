"""Weight-only integer linear layers (W4A16 / W8A16), the products of GPTQ and AWQ checkpoints.

Every checkpoint format is converted at load time to one layout (``mrv2.layers.int_quant``)::

    qweight  int32 [K / pack, N]   pack = 32 / bits; weight (k, n) is bits (k % pack) * bits
                                   onward of row k // pack (lowest bits first)
    scales   [K / G, N]            float16 / bfloat16 / float32, G the group size along K
    zeros    uint8 [K / G, N]      or None: symmetric, every zero point 2 ** (bits - 1)

and the real weight is ``W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.
Contract (``x`` ``[M, K]``)::

    y = x @ W.T (+ bias)            fp32 accumulation, one rounding to x's dtype

:func:`wna16_linear_ref` is that in fp32 torch (the weight dequantized first).
:func:`wna16_linear_triton` never materializes ``W``: a ``[BM, BN]`` output tile walks K in
``BK`` steps that each lie in one group (``BK`` divides ``G``), loads the ``[BK / pack,
BN]`` packed words of its weight tile once, shifts and masks each word's integers out along
K (a ``[BK / pack, pack, BN]`` tensor viewed ``[BK, BN]``), subtracts the zero points and
``tl.dot``\\ s ``x`` with those small integers (exact in bf16 / fp16: ``|q - z| <= 255``),
and scales the step's product by the group's scales into the fp32 accumulator. On the GPU
the dot runs in ``x``'s dtype on tensor cores; under the interpreter (CPU tests) in fp32,
where the bf16 arithmetic is wrong. Few rows (decode) split K across programs until they
cover the SMs; the last program of a tile to arrive sums the fp32 partials in split order
(deterministic) and adds the bias, one launch in all
(:func:`~mrv2_kernels._backend.last_to_arrive`).

Two variants, chosen by the tiles (:class:`WNA16Tiles`): ``fold`` scales each weight tile
and rounds it to ``x``'s dtype before its dot, which then accumulates in place (the weight
the dequantizing path hands cuBLAS, as HF's and other engines' int4 kernels round it; within
the contract's bf16 tolerance, not bit for bit the per-step scaling); ``gemv`` leaves tensor
cores for a few rows: each step's words stay ``[BK / pack, pack, BN]`` in registers,
multiplied by ``x`` and summed on the CUDA cores, one cross-thread reduction per program.
``magic`` makes the integers floats from their bits (:mod:`~mrv2_kernels.int_bits`) instead
of by integer-to-float conversions, a quarter-rate instruction on Hopper; the CUDA-core
kernel then has its own loop (:func:`_gemv_bits_steps`: no shift a weight, 16-bit ``x`` read
in pipelined 4-byte pairs).

Tiles (:func:`wna16_tiles`): the winners of ``python -m mrv2_kernels.bench_int --sweep``
(which times every variant against the byte floor) on an H100; not yet on an H200. From
:data:`DEQUANT_MIN_ROWS` rows on (prefill) :func:`wna16_linear` dequantizes the weight once
per call and hands the product to cuBLAS instead.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._backend import arrival_counters, cdiv, last_to_arrive, sm_count, use_triton
from .int_bits import TWO23_BITS, bias, biased, magic_by_default, pair_half

__all__ = [
    "DEQUANT_MIN_ROWS",
    "DEQUANT_ROWS_ENV_VAR",
    "WNA16Tiles",
    "dequantize_wna16",
    "dequantize_wna16_triton",
    "pack_along_k",
    "unpack_along_k",
    "wna16_linear",
    "wna16_linear_ref",
    "wna16_linear_triton",
    "wna16_tiles",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _pack(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 32 // bits


def pack_along_k(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` ``[K, N]`` (integers in ``[0, 2**bits)``) packed into int32 ``[K / pack, N]``:
    row ``k`` at bits ``(k % pack) * bits`` of row ``k // pack``. ``K`` must divide by the
    pack."""
    pack = _pack(bits)
    k, n = values.shape
    if k % pack:
        raise ValueError(f"pack_along_k: {k} rows do not divide into words of {pack}")
    v = values.to(torch.int64).reshape(k // pack, pack, n)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (v << shifts[None, :, None]).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement
    return words.to(torch.int32)


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers of ``qweight`` ``[K / pack, N]`` (:func:`pack_along_k`) as uint8
    ``[K, N]``."""
    pack = _pack(bits)
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    v = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return v.reshape(qweight.shape[0] * pack, qweight.shape[1]).to(torch.uint8)


def _check(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
           group_size: int) -> tuple[int, int]:
    """``(K, N)`` of a weight in the module's layout; a ValueError naming what does not fit."""
    pack = _pack(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int32 [K / {pack}, N], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size ({group_size}) must divide K ({k})")
    groups = k // group_size
    if scales.shape != (groups, n):
        raise ValueError(f"scales must be [{groups}, {n}] (K / group_size, N), got "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (zeros.shape != (groups, n) or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 [{groups}, {n}], got {zeros.dtype} "
                         f"{tuple(zeros.shape)}")
    return k, n


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bits: int, group_size: int, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """The real weight ``W`` ``[N, K]`` in ``dtype`` (fp32 products, one rounding)."""
    k, n = _check(qweight, scales, zeros, bits, group_size)
    q = unpack_along_k(qweight, bits).float()
    z = (zeros.float() if zeros is not None
         else torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32))
    s = scales.float()
    w = (q - z.repeat_interleave(group_size, 0)) * s.repeat_interleave(group_size, 0)
    return w.T.contiguous().to(dtype)


def wna16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bits: int, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch specification: ``x @ W.T (+ bias)`` in fp32, rounded to ``x``'s dtype."""
    w = dequantize_wna16(qweight, scales, zeros, bits, group_size)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class WNA16Tiles(NamedTuple):
    """A launch's tiles: rows, output columns, K step, K splits (1: none), warps, stages, and
    the kernel: ``gemv`` sums on the CUDA cores (a few rows; ``bm`` may be 1), else
    ``tl.dot`` (``bm`` and ``bk`` >= 16), ``fold``: its weight tiles scaled and rounded to
    ``x``'s dtype before the dot; ``magic``: the integers made floats from their bits
    (:mod:`~mrv2_kernels.int_bits`; with ``gemv``, :func:`_gemv_bits_steps`)."""

    bm: int
    bn: int
    bk: int
    splits: int = 1
    warps: int = 4
    stages: int = 3
    gemv: bool = False
    fold: bool = False
    magic: bool = False


def _largest_pow2_dividing(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def wna16_tiles(x: torch.Tensor, n: int, k: int, group_size: int) -> WNA16Tiles:
    """The tiles of a product: small ones under the interpreter; on the GPU the winners of
    ``bench_int --sweep`` / ``--magic`` on Qwen3-8B's projections (an H100, 2026-12-05;
    BENCHMARKS.md):

    - 1-2 rows: the CUDA-core kernel with the integers made floats from their bits
      (``magic``), 256 output columns by 64-long steps, K split until there are about three
      programs per SM, at most 16 ways (1 row: qkv 13.1 -> 10.2 µs, o 11.4 -> 8.1, gate_up
      30.4 -> 25.0, down 27.9 -> 15.1; 2 rows, against ``tl.dot``: 16.0 -> 12.8, 12.4 -> 9.7,
      50.3 -> 35.1, 27.5 -> 19.4; at 4 rows the two were even, at 8 ``tl.dot`` won;
      ``MRV2_INT_MAGIC=0``: one row's conversion tiles, 128 (256 from ``N`` = 16,384 on) by
      64 split 4 ways, and ``tl.dot`` from 2 rows);
    - 2-16 rows otherwise: ``tl.dot`` over 16-row blocks and 128-long steps, 64 columns
      (128, with the scales folded into the tiles, where ``N`` >= 16,384 or ``K`` >= 8,192),
      K split 8 ways where that leaves at most 64 column tiles, else 4 (gate_up 67.1 -> 50.4
      µs at 8 rows, down 31.6 -> 27.2, qkv 20.0 -> 16.0); ``magic`` measured no faster there;
    - more: 64 x 64 blocks, 128-long steps, 3 stages, K split 2 ways up to 128 column tiles
      (at 64 rows gate_up 111.5 -> 59.7 µs, down 74.7 -> 46.4, qkv 39.9 -> 25.0).

    ``BK`` is capped by the largest power of two dividing the group size."""
    if not x.is_cuda:
        return WNA16Tiles(16, 16, _largest_pow2_dividing(group_size, 32))
    m = x.shape[0]
    bk = _largest_pow2_dividing(group_size, 64)
    if m <= 2 and bk >= 8:  # (a packed word of 4-bit weights at least)
        if magic_by_default():
            splits = max(1, min(16, 3 * sm_count(x.device) // cdiv(n, 256), k // (2 * bk)))
            return WNA16Tiles(m, 256, bk, 1 << (splits.bit_length() - 1), 4, 3, gemv=True,
                              magic=True)
        if m == 1:  # the conversions' one-row tiles
            return WNA16Tiles(1, 256 if n >= 16384 else 128, bk, 4, 4, 3, gemv=True)
    bk = _largest_pow2_dividing(group_size, 128)
    if m <= 16:
        wide = n >= 16384 or k >= 8192
        bn = 128 if wide else 64
        splits = max(1, min(8 if cdiv(n, bn) <= 64 else 4, k // (2 * bk)))
        return WNA16Tiles(16, bn, bk, splits, 4, 4, fold=wide)
    return WNA16Tiles(64, 64, bk, 2 if cdiv(n, 64) <= 128 else 1, 4, 3)


@triton.jit
def _dot(x: tl.tensor, w: tl.tensor, acc: tl.tensor, DOT_F32: tl.constexpr) -> tl.tensor:
    """``x @ w`` (``+ acc``): in fp32 (``ieee``) with ``DOT_F32``, else with ``w`` rounded
    to ``x``'s dtype."""
    if DOT_F32:
        out = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(x, w.to(x.dtype), acc)
    return out


@triton.jit
def _dot_steps(x_ptr: tl.tensor, qw_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor,
               rows: tl.tensor, cols: tl.tensor, row_ok: tl.tensor, col_ok: tl.tensor,
               k0: int, k_end: int, N: int, stride_x: int, GROUP: tl.constexpr,
               BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               DOT_F32: tl.constexpr, FOLD: tl.constexpr, MAGIC: tl.constexpr,
               two23: tl.tensor) -> tl.tensor:
    """The ``[BM, BN]`` fp32 sum over ``[k0, k_end)`` on tensor cores: each step's packed
    words unpacked along K into a ``[BK, BN]`` tile of small integers, ``tl.dot`` with ``x``,
    the product scaled by the step's group scales; ``FOLD``: the tile scaled first and rounded
    to ``x``'s dtype (the weight as the dequantizing path gives cuBLAS), so the dots
    accumulate in place. ``MAGIC``: the integers become floats by bits
    (:mod:`~mrv2_kernels.int_bits`), not conversions: folded, ``biased(q) - (bias + z)`` in
    fp32; else the dot takes ``bias + q`` as is (bf16 / fp16, exact) and the step's product
    loses ``(bias + z)`` times the sum of ``x``'s step."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 1 << (BITS - 1)
    # the biased tile's dtype: x's, except bf16's 7-bit mantissa for 8-bit integers
    BDT: tl.constexpr = tl.float16 if BITS > 7 or x_ptr.dtype.element_ty == tl.float16 \
        else tl.bfloat16
    # bit-built and unfolded with x in that dtype (or fp32 dots): bias + q as is
    SUMS: tl.constexpr = MAGIC and not FOLD and (DOT_F32 or x_ptr.dtype.element_ty == BDT)
    kk = tl.arange(0, BK)
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    wk = tl.arange(0, BK // PACK)
    acc = tl.zeros([BM, BN], tl.float32)
    for kt in tl.range(0, tl.cdiv(k_end - k0, BK), num_stages=STAGES):
        ks = k0 + kt * BK + kk
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=row_ok[:, None], other=0.0)
        # each packed word once: [BK / PACK, BN], its PACK integers spread along K
        word_rows = (k0 + kt * BK) // PACK + wk
        words = tl.load(qw_ptr + word_rows[:, None].to(tl.int64) * N + cols[None, :],
                        mask=col_ok[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts) & MASK, (BK, BN))
        group = (k0 + kt * BK) // GROUP  # the step lies in one group (BK divides GROUP)
        if HAS_ZEROS:
            z = tl.load(z_ptr + group * N + cols, mask=col_ok, other=0).to(tl.int32)
        else:
            z = tl.full([BN], ZERO, tl.int32)
        s = tl.load(s_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SUMS:  # the dot of bias + q, less (bias + z) * sum(x)
            part = _dot(x, biased(q, BDT, two23), None, DOT_F32)
            part -= tl.sum(x.to(tl.float32), axis=1)[:, None] \
                * (bias(BDT) + z.to(tl.float32))[None, :]
            acc += part * s[None, :]
        else:
            if MAGIC:  # noqa: SIM108 (a constexpr branch) q - z from fp32 bits, exact
                w = biased(q, tl.float32, two23) - (bias(tl.float32) + z.to(tl.float32))[None, :]
            else:
                w = q - z[None, :]
            if FOLD:  # the scaled tile, rounded to x's dtype once, accumulates in place
                acc = _dot(x, w.to(tl.float32) * s[None, :], acc, DOT_F32)
            else:
                acc += _dot(x, w, None, DOT_F32) * s[None, :]
    return acc


@triton.jit
def _gemv_steps(x_ptr: tl.tensor, qw_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor,
                rows: tl.tensor, cols: tl.tensor, row_ok: tl.tensor, col_ok: tl.tensor,
                k0: int, k_end: int, N: int, stride_x: int, GROUP: tl.constexpr,
                BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr) -> tl.tensor:
    """:func:`_dot_steps`' sum for a few rows on the CUDA cores: each step's words stay
    ``[BK / PACK, PACK, BN]`` (no reshape, no tensor-core layout), multiplied by ``x``'s
    matching ``[BM, BK / PACK, PACK]`` and summed over the pack in registers; the sums over
    the word rows wait in a ``[BM, BK / PACK, BN]`` accumulator until the end (one cross-thread
    reduction a program, not one a step)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 1 << (BITS - 1)
    BKW: tl.constexpr = BK // PACK
    wk = tl.arange(0, BKW)
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BKW, BN], tl.float32)
    for kt in tl.range(0, tl.cdiv(k_end - k0, BK), num_stages=STAGES):
        kb = k0 + kt * BK
        words = tl.load(qw_ptr + (kb // PACK + wk)[:, None].to(tl.int64) * N + cols[None, :],
                        mask=col_ok[None, :], other=0)
        q = (words[:, None, :] >> shifts) & MASK  # [BKW, PACK, BN]
        group = kb // GROUP
        if HAS_ZEROS:
            z = tl.load(z_ptr + group * N + cols, mask=col_ok, other=0).to(tl.float32)
        else:
            z = tl.full([BN], ZERO, tl.float32)
        q = q.to(tl.float32) - z[None, None, :]
        # converted where each value has one thread, then spread to the columns' threads
        x = tl.reshape(tl.load(x_at + kb, mask=row_ok[:, None], other=0.0).to(tl.float32),
                       (BM, BKW, PACK))
        part = tl.sum(x[:, :, :, None] * q[None, :, :, :], axis=2)  # [BM, BKW, BN]
        s = tl.load(s_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += part * s[None, None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_bits_steps(x_ptr: tl.tensor, qw_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor,
                     rows: tl.tensor, cols: tl.tensor, row_ok: tl.tensor, col_ok: tl.tensor,
                     k0: int, k_end: int, N: int, stride_x: int, two23: tl.tensor,
                     GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr) -> tl.tensor:
    """:func:`_gemv_steps` with each weight a float by one ``LOP3`` and one exact ``FADD``
    (:mod:`~mrv2_kernels.int_bits`): the integer at bits ``BITS * p`` of a word's low half
    (``p < PACK / 2``; the high half is shifted down once a word) is masked in place and
    OR-ed under ``2 ** 23``'s exponent, so the float reads ``2 ** 23 + q * 2 ** (BITS * p)``;
    less ``2 ** 23 + z * 2 ** (BITS * p)`` that is ``(q - z) * 2 ** (BITS * p)``, and ``x``
    comes scaled by ``2 ** -(BITS * p)`` (exact: powers of two). No shift a weight, no
    integer-to-float conversion, and the words keep the layout they are loaded in (``[1, BK /
    PACK, BN]``, broadcast over the ``BM`` rows: a thread's columns share its ``x`` values,
    each weight serves every row from registers). bf16 / fp16 ``x`` is read as int32 pairs
    (:func:`~mrv2_kernels.int_bits.pair_half`): 4-byte loads, which the compiler pipelines
    like the words (not 2-byte ones); the host keeps ``x``'s rows 4-byte aligned.
    Returns the ``[BM, BN]`` fp32 sums."""
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 1 << (BITS - 1)
    BKW: tl.constexpr = BK // PACK
    X_DT: tl.constexpr = x_ptr.dtype.element_ty
    X_PAIRS: tl.constexpr = X_DT.is_bf16() or X_DT.is_fp16()
    # [BM, BKW, 1] row and word-row offsets: the products are [BM, BKW, BN], the rows a
    # thread's own (the words' load layout, broadcast along the rows)
    wk3 = tl.arange(0, BKW)[None, :, None]
    rows3 = rows[:, None, None].to(tl.int64)
    ok3 = row_ok[:, None, None]
    x_at = x_ptr + rows3 * stride_x + wk3 * PACK
    x2_at = x_ptr.to(tl.pointer_type(tl.int32)) + rows3 * (stride_x // 2) + wk3 * (PACK // 2)
    w_at = qw_ptr + wk3.to(tl.int64) * N + cols[None, None, :]  # [1, BKW, BN]
    w_ok = col_ok[None, None, :]
    acc = tl.zeros([BM, BKW, BN], tl.float32)
    for kt in tl.range(0, tl.cdiv(k_end - k0, BK), num_stages=STAGES):
        kb = k0 + kt * BK
        words = tl.load(w_at + (kb // PACK) * N, mask=w_ok, other=0)
        upper = words >> 16  # the high half's integers at the low half's places
        group = kb // GROUP
        if HAS_ZEROS:
            z = tl.load(z_ptr + group * N + cols, mask=col_ok, other=0).to(tl.float32)
        else:
            z = tl.full([BN], ZERO, tl.float32)
        part = tl.zeros([BM, BKW, BN], tl.float32)
        for j in tl.static_range(HALF // 2):  # places 2j and 2j + 1 of both halves
            if X_PAIRS:  # x's 16-bit pairs as int32: 4-byte loads the compiler pipelines
                lo2 = tl.load(x2_at + (kb // 2 + j), mask=ok3, other=0)
                hi2 = tl.load(x2_at + (kb // 2 + HALF // 2 + j), mask=ok3, other=0)
            for h in tl.static_range(2):
                p = 2 * j + h
                place = 1 << (BITS * p)  # the integer's unit at its place
                zp = (bias(tl.float32) + z * place)[None, None, :]  # 2 ** 23 + z * place
                lo = biased(words & (MASK << (BITS * p)), tl.float32, two23) - zp
                hi = biased(upper & (MASK << (BITS * p)), tl.float32, two23) - zp
                if X_PAIRS:
                    x_lo = pair_half(lo2, h == 1, X_DT)
                    x_hi = pair_half(hi2, h == 1, X_DT)
                else:
                    x_lo = tl.load(x_at + (kb + p), mask=ok3, other=0.0).to(tl.float32)
                    x_hi = tl.load(x_at + (kb + p + HALF), mask=ok3, other=0.0).to(tl.float32)
                part += (x_lo * (1.0 / place)) * lo
                part += (x_hi * (1.0 / place)) * hi
        s = tl.load(s_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += part * s[None, None, :]
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["M"])
def _wna16_kernel(
    x_ptr: tl.tensor, qw_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor,
    bias_ptr: tl.tensor, out_ptr: tl.tensor, ws_ptr: tl.tensor, cnt_ptr: tl.tensor,
    M: int, N: int, K: int, K_CHUNK: int, stride_x: int, stride_o: int, two23: int,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr, DOT_F32: tl.constexpr, GEMV: tl.constexpr = False,
    FOLD: tl.constexpr = False, MAGIC: tl.constexpr = False,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    k0 = pid_s * K_CHUNK  # this program's reduction range [k0, k_end), whole BK steps
    k_end = tl.minimum(k0 + K_CHUNK, K)
    if GEMV and MAGIC:
        acc = _gemv_bits_steps(x_ptr, qw_ptr, s_ptr, z_ptr, rows, cols, row_ok, col_ok, k0,
                               k_end, N, stride_x, two23, GROUP, BITS, HAS_ZEROS, BM, BN, BK,
                               STAGES)
    elif GEMV:
        acc = _gemv_steps(x_ptr, qw_ptr, s_ptr, z_ptr, rows, cols, row_ok, col_ok, k0, k_end,
                          N, stride_x, GROUP, BITS, HAS_ZEROS, BM, BN, BK, STAGES)
    else:
        acc = _dot_steps(x_ptr, qw_ptr, s_ptr, z_ptr, rows, cols, row_ok, col_ok, k0, k_end,
                         N, stride_x, GROUP, BITS, HAS_ZEROS, BM, BN, BK, STAGES, DOT_F32, FOLD,
                         MAGIC, two23)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    out_at = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    if SPLIT_K > 1:
        tile_at = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(ws_ptr + pid_s * M * N + tile_at, acc, mask=tile_ok)
        if last_to_arrive(cnt_ptr + pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
            acc = tl.zeros([BM, BN], tl.float32)
            for sp in range(SPLIT_K):
                acc += tl.load(ws_ptr + sp * M * N + tile_at, mask=tile_ok, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


def wna16_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, bits: int, group_size: int,
                        bias: torch.Tensor | None = None, tiles: WNA16Tiles | None = None
                        ) -> torch.Tensor:
    """The module docstring's contract in one launch; ``tiles``: :func:`wna16_tiles` when
    None (``bk`` must divide ``group_size``)."""
    k, n = _check(qweight, scales, zeros, bits, group_size)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"x must be [M, {k}] float32 / bfloat16 / float16, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    tiles = tiles or wna16_tiles(x, n, k, group_size)
    least = 32 // bits if tiles.gemv else 16
    if group_size % tiles.bk or tiles.bk < least:
        raise ValueError(f"tile bk ({tiles.bk}) must be >= {least} and divide group_size "
                         f"({group_size})")
    m = x.shape[0]
    if tiles.gemv and tiles.bm < m:
        raise ValueError(f"a gemv launch takes every row in one block: bm ({tiles.bm}) < "
                         f"{m} rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    # the kernel indexes the weight's tensors (and the bias) as contiguous: a strided view
    # (a transposed or sliced one) is copied, a contiguous tensor passes as it is
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    bias = None if bias is None else bias.contiguous()
    if tiles.magic and tiles.gemv and x.dtype != torch.float32 and (
            x.data_ptr() % 4 or x.stride(0) % 2):  # the kernel reads 16-bit pairs as int32
        x = torch.empty((m, k), dtype=x.dtype, device=x.device).copy_(x)
    out = _empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    chunk = cdiv(cdiv(k, max(tiles.splits, 1)), tiles.bk) * tiles.bk
    splits = cdiv(k, chunk)
    grid_mn = (cdiv(m, tiles.bm), cdiv(n, tiles.bn))
    cnt = arrival_counters(x.device, grid_mn[0] * grid_mn[1]) if splits > 1 else None
    if cnt is None:  # no split, or a capture found no counters: all of K in each program
        chunk, splits = k, 1
        ws = cnt = out  # unused
    else:
        ws = _empty((splits, m, n), torch.float32, x.device)
    _wna16_kernel[(*grid_mn, splits)](
        x, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, out, ws, cnt, m, n, k, chunk, x.stride(0),
        out.stride(0), TWO23_BITS, GROUP=group_size, BITS=bits, HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None, BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, SPLIT_K=splits,
        STAGES=tiles.stages, DOT_F32=not x.is_cuda or x.dtype == torch.float32,
        GEMV=tiles.gemv, FOLD=tiles.fold, MAGIC=tiles.magic, num_warps=tiles.warps,
    )
    return out


@triton.jit
def _dequant_kernel(
    qw_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor, w_ptr: tl.tensor, N: int,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BK: tl.constexpr,
    BN: tl.constexpr,
) -> None:
    """One ``[BK, BN]`` tile of the real weight, written ``[K, N]`` (rows: inputs)."""
    PACK: tl.constexpr = 32 // BITS
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    word_rows = pid_k * (BK // PACK) + tl.arange(0, BK // PACK)
    words = tl.load(qw_ptr + word_rows[:, None].to(tl.int64) * N + cols[None, :],
                    mask=col_ok[None, :], other=0)
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    q = tl.reshape((words[:, None, :] >> shifts) & ((1 << BITS) - 1), (BK, BN))
    group = (pid_k * BK) // GROUP
    if HAS_ZEROS:
        q = q - tl.load(z_ptr + group * N + cols, mask=col_ok, other=0).to(tl.int32)[None, :]
    else:
        q = q - (1 << (BITS - 1))
    s = tl.load(s_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    rows = pid_k * BK + tl.arange(0, BK)
    tl.store(w_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
             (q.to(tl.float32) * s[None, :]).to(w_ptr.dtype.element_ty), mask=col_ok[None, :])


def dequantize_wna16_triton(qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor | None, bits: int, group_size: int,
                            dtype: torch.dtype, block_k: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """The real weight **transposed**, ``[K, N]`` in ``dtype`` (``x @ W.T`` is then ``x @``
    this), in one pass over the packed words: :func:`dequantize_wna16`'s values."""
    k, n = _check(qweight, scales, zeros, bits, group_size)
    bk = block_k or min(64 if qweight.is_cuda else 16, group_size & -group_size)
    bn = block_n or (128 if qweight.is_cuda else 16)
    if group_size % bk or bk < 32 // bits:
        raise ValueError(f"block_k ({bk}) must divide group_size ({group_size}) and hold a "
                         "packed word")
    qweight, scales = qweight.contiguous(), scales.contiguous()  # (indexed as contiguous)
    zeros = None if zeros is None else zeros.contiguous()
    out = _empty((k, n), dtype, qweight.device)
    _dequant_kernel[(k // bk, cdiv(n, bn))](
        qweight, scales, zeros if zeros is not None else scales, out, n, GROUP=group_size,
        BITS=bits, HAS_ZEROS=zeros is not None, BK=bk, BN=bn, num_warps=4)
    return out


#: Environment variable: the row count from which :func:`wna16_linear` dequantizes the weight
#: (one Triton pass into a ``[K, N]`` buffer) and multiplies with cuBLAS instead of the fused
#: kernel; ``0`` never. Default :data:`DEQUANT_MIN_ROWS`.
DEQUANT_ROWS_ENV_VAR = "MRV2_WNA16_DEQUANT_ROWS"
#: 256: vLLM's rule for its AWQ kernel (prefill-sized products are compute bound, where
#: cuBLAS's bf16 GEMM beats unpacking every weight tile once per row block). Not yet measured
#: here (2026-12-05, no GPU): the next H200 session A/Bs it.
DEQUANT_MIN_ROWS = 256


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` times the weight (module docstring): on the GPU the fused Triton
    kernel up to :data:`DEQUANT_MIN_ROWS` rows and, from there, the weight dequantized
    (:func:`dequantize_wna16_triton`) and multiplied by cuBLAS; under a forced Triton backend
    on the CPU the fused kernel; else the reference."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if use_triton(flat):
        threshold = int(os.environ.get(DEQUANT_ROWS_ENV_VAR, DEQUANT_MIN_ROWS))
        if flat.is_cuda and 0 < threshold <= flat.shape[0]:
            w = dequantize_wna16_triton(qweight, scales, zeros, bits, group_size, flat.dtype)
            y = flat @ w if bias is None else torch.addmm(bias, flat, w)
        else:
            y = wna16_linear_triton(flat, qweight, scales, zeros, bits, group_size, bias)
    else:
        y = wna16_linear_ref(flat, qweight, scales, zeros, bits, group_size, bias)
    return y.reshape(*lead, y.shape[-1])
