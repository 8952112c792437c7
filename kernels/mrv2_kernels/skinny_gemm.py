"""``x @ weight.T (+ bias)`` for a few rows of ``x``: the decode-step linear layers.

At decode time a linear layer multiplies a handful of token rows by a weight matrix that is
read once from memory; the step is bound by the weight bytes, so all that matters is streaming
the weight at full bandwidth. For weights at least as wide as tall (output projections), cuBLAS
picks tiles that leave SMs idle (on an H200, Qwen3-0.6B's ``o_proj`` at one token took 12.8 µs
where this kernel takes 5.3 µs, inside a CUDA graph, weights from HBM), so this kernel cuts
the output features into ``BLOCK_N`` slices and, when that gives too few programs to keep every
SM streaming, the reduction dimension into ``split_k`` slices too. Each program walks its
``[BLOCK_N, K/split_k]`` weight slice in ``BLOCK_K`` tiles (pipelined loads) against the
``[BLOCK_M, BLOCK_K]`` tile of ``x`` and accumulates in fp32 with ``tl.dot``. Split partials go
to an fp32 scratch buffer; the last split program of each output slice to finish (an atomic
arrival count) adds them in split order (deterministic), adds the bias and rounds to the output
dtype, so a split product is still one launch (a reduce kernel is the fallback).

Contract (``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None)::

    out = (x.float() @ weight.float().T + bias.float()).to(x.dtype)     # fp32 accumulation

It agrees with ``F.linear`` to fp32 accumulation order (rounded to bf16/fp16 at the end).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import (
    arrival_counters,
    cdiv,
    last_to_arrive,
    next_power_of_2,
    pdl,
    pdl_early_weights,
    pdl_prologue,
    pdl_release,
    pdl_wait,
    sm_count,
    use_triton,
)

__all__ = ["SKINNY_MAX_M", "SKINNY_MAX_M_ENV_VAR", "skinny_linear", "skinny_linear_ref",
           "skinny_linear_triton", "use_skinny"]

#: Environment override of :data:`SKINNY_MAX_M` (read at import).
SKINNY_MAX_M_ENV_VAR = "MRV2_SKINNY_MAX_M"
#: Largest number of rows :func:`use_skinny` sends to the kernel. At 1-2 rows the fused GEMV
#: (:mod:`~mrv2_kernels.norm_gemv`) takes every product with ``K <= 4096``, so this kernel
#: keeps the wide reductions (Qwen3-8B's down_proj, K 12,288: its batch-1 decode graph 3.99
#: against 4.06 ms with cuBLAS). From 3 rows on, cuBLAS (or :mod:`~mrv2_kernels.pdl_gemm` on a
#: small model) in the PDL chain of a decode graph beats it: H200, ``mrv2 bench latency``, two
#: rounds (BENCHMARKS.md, twenty-first session), time per output token with this kernel up to
#: 16 rows against 2: Qwen3-8B 5.23 -> 4.72 ms at 4 requests, 4.87 -> 4.84 at 8, 5.52 -> 5.07
#: at 16; Qwen3-0.6B 1.02-1.03 -> 0.99, 1.07 -> 1.03, 1.30 -> 1.19.
SKINNY_MAX_M = int(os.environ.get(SKINNY_MAX_M_ENV_VAR, "2"))

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch specification: fp32 accumulation, one rounding to ``x.dtype``."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    counters_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    x_s0: int,
    w_s0: int,
    out_s0: int,
    k_per_split: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_WEIGHTS: tl.constexpr = False,
) -> None:
    if EARLY_WEIGHTS:  # the first weight tile is requested before waiting (see the launcher)
        pdl_release(PDL)
    else:
        pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_s0
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_s0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    loop_start = k_start
    if EARLY_WEIGHTS:  # the first iteration, its weight load before the wait
        k = k_start + offs_k
        mask_k = k < k_end
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        pdl_wait(PDL)
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        loop_start = k_start + BLOCK_K
    for k0 in range(loop_start, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_end
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter's bf16 arithmetic is wrong: convert at once there
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    if SPLIT:
        part = part_ptr + (pid_k * M + offs_m)[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=mask_m[:, None] & mask_n[None, :])
        if FUSED_REDUCE:
            # The last split of this output slice to finish adds the partials (in split order:
            # deterministic), then resets the slice's arrival counter for the next launch.
            num_splits = tl.num_programs(1)
            if last_to_arrive(counters_ptr + pid_n, num_splits):
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
                for s in range(0, num_splits):
                    total += tl.load(part_ptr + s * M * N + rows,
                                     mask=mask_m[:, None] & mask_n[None, :], other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=mask_n,
                                     other=0.0).to(tl.float32)[None, :]
                out = out_ptr + offs_m.to(tl.int64)[:, None] * out_s0 + offs_n[None, :]
                tl.store(out, total.to(out_ptr.dtype.element_ty),
                         mask=mask_m[:, None] & mask_n[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * out_s0 + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(
    part_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: int,
    N: int,
    out_s0: int,
    num_splits: int,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(0, num_splits):  # fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * out_s0 + offs_n, acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def _plan(m: int, n: int, k: int, cuda: bool, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, split_k)`` for an ``[m, k] x [n, k]^T`` product.

    On the GPU: 32-feature slices in 128-wide tiles (the best of a sweep over 16/32/64 x
    128/256/512 x splits 1-8 on the H200, BENCHMARKS.md), split along K until the programs
    about fill the SMs and no split spans more than 4,096 of K.
    """
    block_m = max(16, next_power_of_2(m))
    if not cuda:
        return block_m, 16, 32, (2 if k >= 64 else 1)
    block_n, block_k = 32, 128
    programs = cdiv(n, block_n)
    target = 0.9 * sm_count(device)
    split = 1
    while (programs * split < target or k // split > 4096) and k // (2 * split) >= 2 * block_k:
        split *= 2
    return block_m, block_n, block_k, split


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_stages: int = 4,
    fused_reduce: bool = True,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton implementation of :func:`skinny_linear`; tile arguments override the plan.

    With split-K, the last split program of each output slice adds the partials
    (``fused_reduce``, an atomic arrival count in a small persistent buffer that each reduction
    resets) instead of a second kernel; the sum runs in split order either way.
    """
    if x.shape[-1] != weight.shape[1] or weight.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    block_m, plan_n, plan_k, plan_split = _plan(m, n, k, x.is_cuda, x.device)
    block_n = block_n or plan_n
    block_k = block_k or plan_k
    split = max(1, min(split_k or plan_split, cdiv(k, block_k)))
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)
    part = out
    counters = None
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        if fused_reduce:
            counters = arrival_counters(x.device, cdiv(n, block_n))
    has_bias = bias is not None
    bias_arg = bias if bias is not None else weight
    _skinny_kernel[(cdiv(n, block_n), split)](
        x2, weight, bias_arg, out, part, counters if counters is not None else out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), k_per_split, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split > 1, HAS_BIAS=has_bias,
        UPCAST=not x.is_cuda, FUSED_REDUCE=counters is not None, num_warps=num_warps,
        num_stages=num_stages, EARLY_WEIGHTS=pdl_early_weights(x), **pdl(x),
    )
    if split > 1 and counters is None:
        reduce_n = 256 if x.is_cuda else 32
        _split_reduce_kernel[(m, cdiv(n, reduce_n))](
            part, bias_arg, out, m, n, out.stride(0), split, BLOCK_N=reduce_n, HAS_BIAS=has_bias,
        )
    return out.view(*lead, n)


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`skinny_linear` should run the Triton kernel for this product: a CUDA
    (or forced-Triton) bf16/fp16 input of at most :data:`SKINNY_MAX_M` rows and a weight at
    least as wide as it is tall (``K >= N``: the down-projections, where cuBLAS's few-row
    kernels leave SMs idle; for ``K < N`` they were as fast on the H200). Metadata only."""
    return (use_triton(x) and x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype
            and weight.shape[1] >= weight.shape[0]
            and x.numel() <= SKINNY_MAX_M * x.shape[-1] and weight.stride(-1) == 1)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the skinny kernel when :func:`use_skinny`."""
    if use_skinny(x, weight):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
