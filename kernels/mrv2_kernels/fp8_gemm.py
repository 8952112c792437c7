"""Block-quantized FP8 linear layers, as DeepSeek-V3 and GLM-4.x-FP8 checkpoints ship them.

Checkpoint format (``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bn, bk]}``, ``[128, 128]`` in practice):
a linear weight ``W [N, K]`` is stored as ``float8_e4m3fn`` plus ``weight_scale_inv
[ceil(N/bn), ceil(K/bk)]`` fp32, and the real weight is ``W_fp8 * scale`` of its block.
Activations are quantized on the fly, per token and per group of ``bk`` features
(``scale = max(amax, 1e-10) / 448``). Contract (``x`` ``[..., K]``)::

    x_q, x_s = per_token_group_quant_fp8_ref(x, bk)              # fp8 [M, K], fp32 [M, K/bk]
    y = (x_q * x_s) @ (W_fp8 * W_s).T  (+ bias)                   # fp32, then out_dtype

:func:`block_fp8_linear_ref` is that, in fp32 torch. :func:`block_fp8_linear_triton` quantizes
``x`` (:func:`per_token_group_quant_fp8_triton`, or inside the GEMM for a few rows) and runs a
GEMM whose ``BLOCK_K``-long steps lie in one scale group each (``BLOCK_K`` divides ``bk``): per
step it ``tl.dot``s the fp8 tiles, multiplies the fp32 result by the rows' activation scales and
the columns' weight scales and adds it to an fp32 accumulator. On sm90 (triton 3.6, checked in
the PTX) 64-row and larger tiles run ``wgmma ... e4m3.e4m3`` with fp32 results, which
accumulate within a step in reduced precision (promoting every 128 features is DeepSeek's
remedy); 16/32-row tiles run ``mma.sync`` on the fp8 values converted to fp16 (exact). It agrees
with the reference to fp32 summation order on the interpreter (whose fp32 -> bf16/fp16 output
conversion truncates: within one output ulp), and to the MMA's accumulation on the GPU.
:func:`block_fp8_linear_dequant` is what CPU engines do (dequantize the weight, ``F.linear`` in
``x``'s dtype, no activation quantization); :func:`block_fp8_linear` dispatches between it and
the kernel. A CPU layer should dequantize once at load, not per call.

Tiles (:func:`fp8_gemm_tiles`): up to 64 rows (decode) 16-64-row blocks of 64 output features
and split-K until the programs cover the SMs, ``x`` quantized by its own launch (the GEMM can
quantize its own steps, ``fuse_quant``: no launch, no fp8 copy of ``x``, but every program
then redoes the division on its critical path, slower on the H200); from 65 rows 64x128
tiles, 4 warps, 4 stages.

Triton's interpreter (CPU tests) loads, upcasts and ``tl.dot``s fp8 exactly, but its fp32 ->
fp8 conversion rounds wrongly (a carry out of the mantissa is dropped, subnormals are
truncated). There (``CPU``) the kernels round to the e4m3 grid in fp32 arithmetic (round to
nearest even, :func:`_round_e4m3`), which the conversion then keeps exactly, and the GEMM
upcasts the fp8 tiles to fp32 for an fp32 ``tl.dot``. On CUDA the conversion is the hardware's
(``cvt.rn.satfinite``) and the dot runs on fp8 tensor cores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import FP8_DTYPE, FP8_MAX, cdiv, next_power_of_2, sm_count, use_triton
from ._backend import FP8_MAX_C as _FP8_MAX_C
from ._backend import round_e4m3 as _round_e4m3

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Tiles",
    "block_fp8_linear",
    "block_fp8_linear_dequant",
    "block_fp8_linear_ref",
    "block_fp8_linear_triton",
    "dequantize_weight_block_fp8",
    "fp8_gemm_tiles",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "per_token_group_quant_fp8_triton",
    "quant_dequant_groups",
    "quantize_weight_block_fp8",
]

#: Floor of an activation group's amax (an all-zero group gets a tiny scale and zeros).
ACT_EPS = 1e-10
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INV_FP8_MAX_C = tl.constexpr(1.0 / FP8_MAX)
_EPS_C = tl.constexpr(ACT_EPS)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _pow2(name: str, value: int, minimum: int) -> int:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _blocks(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive sizes, got {tuple(block)}")
    return bn, bk


def _padded_blocks(t: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``t`` ``[N, K]`` zero-padded to whole blocks, viewed ``[N/bn, bn, K/bk, bk]``."""
    n, k = t.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    t = F.pad(t, (0, kb * bk - k, 0, nb * bn - n))
    return t.view(nb, bn, kb, bk)


# ------------------------------------------------------------------------- weights (load time)


def quantize_weight_block_fp8(
    w: torch.Tensor, block: tuple[int, int] | list[int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [N, K] e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] fp32)`` of a ``[N, K]``
    weight: each block scaled by ``amax / 448`` (1 for an all-zero block), rounded to nearest.
    Load-time quantization of a bf16 checkpoint; an fp32 copy of ``w`` is made on its device."""
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got {tuple(w.shape)}")
    bn, bk = _blocks(block)
    n, k = w.shape
    blocks = _padded_blocks(w.float(), bn, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(scale.shape[0] * bn, scale.shape[1] * bk)[:n, :k].contiguous()
    return q, scale


def dequantize_weight_block_fp8(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] | list[int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The real weight ``w_fp8 * scale_inv[block]`` (fp32 product, one rounding to ``dtype``)."""
    bn, bk = _blocks(block)
    _check_weight(w_fp8, scale_inv, bn, bk)
    n, k = w_fp8.shape
    blocks = _padded_blocks(w_fp8.float(), bn, bk) * scale_inv.float()[:, None, :, None]
    return blocks.view(blocks.shape[0] * bn, blocks.shape[2] * bk)[:n, :k].to(dtype).contiguous()


def _check_weight(w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> None:
    if w.dim() != 2 or w.dtype != FP8_DTYPE:
        raise ValueError(f"w_fp8 must be [N, K] float8_e4m3fn, got {tuple(w.shape)} {w.dtype}")
    want = (cdiv(w.shape[0], bn), cdiv(w.shape[1], bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"w_scale_inv must be {want} for w {tuple(w.shape)} and block "
                         f"({bn}, {bk}), got {tuple(scale.shape)}")


# ------------------------------------------------------------------- activations (per step)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group: int = 128, eps: float = ACT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification: ``x`` ``[..., K]`` to ``(x_fp8 [..., K], x_scale [...,
    ceil(K/group)] fp32)``, ``scale = max(amax of the group, eps) / 448``, ``x_fp8 =
    clamp(x / scale, +-448)`` rounded to nearest even (fp32 arithmetic)."""
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    groups = cdiv(k, group)
    xp = F.pad(x2, (0, groups * group - k)).view(-1, groups, group)
    # times the fp32 reciprocal, not a division: torch's CUDA division by a scalar multiplies
    # by its reciprocal while its CPU one divides; the kernel multiplies on both
    scale = xp.abs().amax(dim=-1).clamp(min=eps) * (1.0 / FP8_MAX)
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(-1, groups * group)[:, :k].contiguous()
    return q.view(*lead, k), scale.view(*lead, groups)


@triton.jit
def _quant_rows(x: tl.tensor, CPU: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """``(q, scale)`` of an fp32 ``[rows, group]`` tile, bit for bit the reference: ``q`` is fp8
    on the GPU and the fp32 value of the fp8 on the interpreter (``CPU``). On the GPU ``x /
    scale`` is not ``div.rn`` per element (~17 instructions with a slow-path branch: a GEMM
    quantizing its own steps ran 3.5x longer) but ``q0 = x * RN(1/scale)`` and one fma
    correction ``q0 + (x - q0 * scale) * RN(1/scale)``: correctly rounded by Markstein's
    theorem (``|x| <= amax``: no overflow; a quotient too small for it is far below e4m3's
    smallest subnormal and becomes 0 either way; 10^5 random cases checked in exact
    arithmetic; the GPU tests compare the bits with the reference's). The interpreter's
    ``fma`` rounds twice, so there the division stays (and the e4m3 rounding is done in fp32
    arithmetic, :func:`_round_e4m3`)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, _EPS_C) * _INV_FP8_MAX_C  # as the reference: see there
    if CPU:
        q = tl.math.div_rn(x, scale[:, None])  # IEEE division, as torch's
        q = _round_e4m3(tl.minimum(tl.maximum(q, -_FP8_MAX_C), _FP8_MAX_C))
    else:
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
        q0 = x * inv
        q = tl.fma(tl.fma(-q0, scale[:, None], x), inv, q0)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX_C), _FP8_MAX_C).to(tl.float8e4nv)
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _group_quant_kernel(
    x_ptr: tl.tensor,
    q_ptr: tl.tensor,
    s_ptr: tl.tensor,
    M: int,
    K: int,
    x_s0: int,
    q_s0: int,
    s_s0: int,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    CPU: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * x_s0 + cols[None, :], mask=mask, other=0.0)
    q, scale = _quant_rows(x.to(tl.float32), CPU)
    tl.store(q_ptr + rows64[:, None] * q_s0 + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows64 * s_s0 + g, scale, mask=rows < M)


def per_token_group_quant_fp8_triton(
    x: torch.Tensor, group: int = 128, *, block_m: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`per_token_group_quant_fp8` (``group`` a power of two);
    one program per ``block_m`` rows and group. Outputs are contiguous."""
    _pow2("group", group, 1)
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    groups = cdiv(k, group)
    q = _empty((m, k), FP8_DTYPE, x.device)
    scale = _empty((m, groups), torch.float32, x.device)
    if m and k:
        bm = _pow2("block_m", block_m or (16 if x.is_cuda else 32), 1)
        _group_quant_kernel[(cdiv(m, bm), groups)](
            x2, q, scale, m, k, x2.stride(0), q.stride(0), scale.stride(0), BLOCK_M=bm,
            GROUP=group, CPU=not x.is_cuda, num_warps=4,
        )
    return q.view(*lead, k), scale.view(*lead, groups)


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, x_scale)`` per token and group of ``group`` features (see the reference):
    Triton when :func:`use_triton` says so, else :func:`per_token_group_quant_fp8_ref`."""
    if use_triton(x) and x.dtype in _KERNEL_DTYPES and group & (group - 1) == 0:
        return per_token_group_quant_fp8_triton(x, group)
    return per_token_group_quant_fp8_ref(x, group)


# ------------------------------------------------------------------------------- the linear


def _check_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, block: tuple[int, int] | list[int]
                  ) -> tuple[int, int]:
    bn, bk = _blocks(block)
    _check_weight(w, scale, bn, bk)
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match w_fp8 {tuple(w.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    return bn, bk


def quant_dequant_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` ``[M, K]`` as the FP8 GEMMs see it, in fp32: quantized per row and group of
    ``group`` features (:func:`per_token_group_quant_fp8_ref`), times
    the group's scale."""
    q, s = per_token_group_quant_fp8_ref(x, group)
    m, k = q.shape
    groups = s.shape[1]
    padded = torch.nn.functional.pad(q.float(), (0, groups * group - k))
    return (padded.view(m, groups, group) * s[..., None]).view(m, groups * group)[:, :k]


def block_fp8_linear_ref(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = (128, 128),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch specification (module docstring): ``x`` quantized per token and group of
    ``bk``, dequantized, times the dequantized weight, in fp32; one rounding to ``out_dtype``
    (default ``x.dtype``)."""
    bn, bk = _check_linear(x, w_fp8, w_scale_inv, bias, block)
    lead, k = x.shape[:-1], x.shape[-1]
    w = dequantize_weight_block_fp8(w_fp8, w_scale_inv, (bn, bk), torch.float32)
    out = quant_dequant_groups(x.reshape(-1, k), bk) @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).view(*lead, w_fp8.shape[0])


def block_fp8_linear_dequant(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = (128, 128),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The CPU engines' path: ``F.linear(x, dequantized weight in x.dtype, bias)``. Weight-only
    quantization: differs from the reference by the activation rounding (~2^-5 relative)."""
    bn, bk = _check_linear(x, w_fp8, w_scale_inv, bias, block)
    w = dequantize_weight_block_fp8(w_fp8, w_scale_inv, (bn, bk), x.dtype)
    out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
    return out if out_dtype is None else out.to(out_dtype)


@triton.jit
def _tile_of(pid: int, num_pid_m: int, num_pid_n: int,
             GROUP_M: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """``(pid_m, pid_n)``: ``GROUP_M`` row blocks walk the column slices together (L2 reuse)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _fp8_gemm_kernel(
    a_ptr: tl.tensor,
    as_ptr: tl.tensor,
    b_ptr: tl.tensor,
    bs_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    a_s0: int,
    as_s0: int,
    b_s0: int,
    bs_s0: int,
    out_s0: int,
    tiles_per_split: int,
    W_BN: tl.constexpr,
    W_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    CPU: tl.constexpr,
) -> None:
    """``out`` (or, with ``SPLIT``, this split's fp32 partial ``out[pid_k]``) of one
    ``[BLOCK_M, BLOCK_N]`` tile. ``a`` is fp8 ``x`` with scales ``as`` or, with
    ``FUSE_QUANT`` (``BLOCK_K == W_BK``), ``x`` itself, quantized step by step here."""
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * a_s0
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * b_s0
    as_rows = as_ptr + offs_m.to(tl.int64) * as_s0
    bs_rows = bs_ptr + (offs_n // W_BN) * bs_s0
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        k = t * BLOCK_K + offs_k
        if EVEN_K:
            a = tl.load(a_rows + k[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(b_rows + k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(b_rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
        group = (t * BLOCK_K) // W_BK
        if FUSE_QUANT:
            a, a_scale = _quant_rows(a.to(tl.float32), CPU)
        else:
            a_scale = tl.load(as_rows + group, mask=mask_m, other=0.0)
            if CPU:
                a = a.to(tl.float32)
        b_scale = tl.load(bs_rows + group, mask=mask_n, other=0.0)
        if CPU:  # fp8 values in fp32: exact products, fp32 sums
            part = tl.dot(a, tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:  # fp8 tensor cores
            part = tl.dot(a, tl.trans(b))
        acc += part * a_scale[:, None] * b_scale[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        dst = out_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(dst, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * out_s0 + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _split_sum_kernel(
    part_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: int,
    N: int,
    out_s0: int,
    num_splits: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, num_splits):  # split order: deterministic
        src = part_ptr + (s * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
        acc += tl.load(src, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * out_s0 + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Fp8Tiles(NamedTuple):
    """Tile choices of :func:`block_fp8_linear_triton` (block sizes are powers of two)."""

    block_m: int
    block_n: int
    block_k: int  # divides the weight block's K (one scale group per step)
    group_m: int  # row blocks that walk the column slices together
    split_k: int  # K slices (fp32 partials, summed by a second kernel)
    num_warps: int
    num_stages: int
    fuse_quant: bool  # quantize x inside the GEMM (block_k == the weight block's K)


def fp8_gemm_tiles(m: int, n: int, k: int, block: tuple[int, int] | list[int],
                   device: torch.device) -> Fp8Tiles:
    """Default tiles for ``[m, k] x [n, k]^T`` with weight blocks ``block`` (module docstring).

    ``block_k`` is the weight block's K when it is a power of two up to 128 (else its largest
    power-of-two divisor up to 128). Decode (``m <= 64``) on CUDA, from ``bench_fp8 --sweep``
    on an H200 (2026-12-01, GLM-4.5-Air's qkv / o_proj / shared-expert shapes at 1-64 rows):
    64 output features per program, ``x`` quantized by its own launch (quantizing inside the
    GEMM, every program redoing it on the loop's critical path, was 4-5x slower at one row
    with a division per element and is still no faster with the reciprocal of
    :func:`_quant_rows`, except by 5% on the smallest weight), K split in halves while the
    programs do not cover the SMs once and each split keeps >= 2 steps (qkv: none; o_proj: 4;
    shared down: 4), 4 stages: within 10% of the sweep's best everywhere. Beyond 64 rows:
    64x128 tiles, 4 warps, 4 stages (as fast as 128x128 with 8 warps within the runs' noise).
    """
    _, bk = _blocks(block)
    block_k = min(128, bk & -bk)
    cuda = device.type == "cuda"
    block_m = min(64, max(16, next_power_of_2(max(m, 1))))
    if not cuda:
        return Fp8Tiles(block_m, 64, block_k, 1, 1, 4, 1, m <= 16 and block_k == bk)
    if m <= 64:
        programs = cdiv(n, 64) * cdiv(m, block_m)
        steps = cdiv(k, block_k)
        split = 1
        while programs * split < sm_count(device) and steps // (2 * split) >= 2:
            split *= 2
        return Fp8Tiles(block_m, 64, block_k, 1, split, 4, 4, False)
    return Fp8Tiles(64, 128, block_k, 8, 1, 4, 4, False)


def block_fp8_linear_triton(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = (128, 128),
    out_dtype: torch.dtype | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    group_m: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fuse_quant: bool | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`block_fp8_linear` (``x`` fp32/bf16/fp16, the weight
    block's K a power of two); tile arguments override :func:`fp8_gemm_tiles`. Never
    synchronizes with the host; allocates ``out`` (and, split, ``[split, M, N]`` fp32
    partials; unfused, the fp8 copy of ``x`` and its scales)."""
    bn, bk = _check_linear(x, w_fp8, w_scale_inv, bias, block)
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    _pow2("block[1]", bk, 1)
    if w_fp8.shape[1] > 1 and w_fp8.stride(1) != 1:
        raise ValueError("w_fp8 rows must be contiguous")
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_fp8.shape[0]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = _empty((m, n), out_dtype, x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        if bias is None:
            out.zero_()
        else:
            out.copy_(bias.expand(m, n))
        return out.view(*lead, n)
    plan = fp8_gemm_tiles(m, n, k, (bn, bk), x.device)
    minimum = 16 if x.is_cuda else 1  # tl.dot's smallest tile on the GPU
    bm = _pow2("block_m", block_m or plan.block_m, minimum)
    bnt = _pow2("block_n", block_n or plan.block_n, minimum)
    bkt = _pow2("block_k", block_k or plan.block_k, max(minimum, 16 if x.is_cuda else 1))
    if bk % bkt:
        raise ValueError(f"block_k must divide the weight block's K {bk}, got {bkt}")
    fuse = plan.fuse_quant if fuse_quant is None else fuse_quant
    if fuse and bkt != bk:
        raise ValueError(f"fuse_quant needs block_k == the weight block's K {bk}, got {bkt}")
    steps = cdiv(k, bkt)
    split = max(1, min(split_k or plan.split_k, steps))
    per_split = cdiv(steps, split)
    split = cdiv(steps, per_split)
    # the kernel reads a row of scales (and the bias) as contiguous: a strided view is copied
    scale_b = w_scale_inv.to(torch.float32).contiguous()
    bias = None if bias is None else bias.contiguous()
    if fuse:
        a, scale_a = x2, scale_b  # scale_a unused
    else:
        a, scale_a = per_token_group_quant_fp8_triton(x2, bk)
    dst = _empty((split, m, n), torch.float32, x.device) if split > 1 else out
    has_bias = bias is not None
    bias_arg = bias if bias is not None else scale_b
    grid = (cdiv(m, bm) * cdiv(n, bnt), split)
    _fp8_gemm_kernel[grid](
        a, scale_a, w_fp8, scale_b, bias_arg, dst, m, n, k, a.stride(0), scale_a.stride(0),
        w_fp8.stride(0), scale_b.stride(0), out.stride(0), per_split, W_BN=bn, W_BK=bk,
        BLOCK_M=bm, BLOCK_N=bnt, BLOCK_K=bkt, GROUP_M=group_m or plan.group_m, SPLIT=split > 1,
        HAS_BIAS=has_bias, EVEN_K=k % bkt == 0, FUSE_QUANT=fuse, CPU=not x.is_cuda,
        num_warps=num_warps or plan.num_warps, num_stages=num_stages or plan.num_stages,
    )
    if split > 1:
        rm = min(16, next_power_of_2(m))
        rn = 256 if x.is_cuda else 128
        _split_sum_kernel[(cdiv(m, rm), cdiv(n, rn))](
            dst, bias_arg, out, m, n, out.stride(0), split, BLOCK_M=rm, BLOCK_N=rn,
            HAS_BIAS=has_bias, num_warps=4,
        )
    return out.view(*lead, n)


def block_fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = (128, 128),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y = x @ W.T (+ bias)`` for a block-quantized FP8 weight: :func:`block_fp8_linear_triton`
    when :func:`use_triton` says so (fp32/bf16/fp16 ``x``, power-of-two block K), else the CPU
    engines' :func:`block_fp8_linear_dequant`."""
    bk = _blocks(block)[1]
    if use_triton(x) and x.dtype in _KERNEL_DTYPES and bk & (bk - 1) == 0:
        return block_fp8_linear_triton(x, w_fp8, w_scale_inv, bias, block, out_dtype)
    return block_fp8_linear_dequant(x, w_fp8, w_scale_inv, bias, block, out_dtype)
