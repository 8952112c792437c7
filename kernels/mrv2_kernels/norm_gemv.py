"""Decode-step GEMV with the RMSNorm before it and the SwiGLU after it fused in.

A pre-norm decoder layer at decode time runs, per layer, ``residual add + RMSNorm -> qkv
GEMM`` and ``residual add + RMSNorm -> gate/up GEMM -> silu(gate) * up``: five launches for
a few token rows, each a few microseconds of mostly fixed latency. Here each chain is one
launch. A program owns ``BLOCK_N`` output features and the *whole* reduction dimension (``K``
up to :data:`NORM_GEMV_MAX_K`): it issues the loads of its ``[BLOCK_N, K]`` weight slice at
once (all the bytes in flight, no pipeline to fill), then for every token row recomputes that
row's norm from ``x`` (and ``residual``; a few KiB, cache hits after the first program) and
reduces. With ``gated``, the program also owns the matching ``up`` features (weight rows
``N + n``) and writes ``silu(gate) * up``. Program 0 writes the new residual.

Contract (``x``, ``residual`` ``[M, K]``; ``norm_weight`` ``[K]``; ``weight`` ``[N, K]``, or
``[2N, K]`` laid out ``[gate | up]`` with ``gated``), exactly the unfused chain::

    h, new_residual = rms_norm(x, norm_weight, eps, residual)   # or h = rms_norm(x, ...)
    y = (h.float() @ weight.float().T + bias.float()).to(x.dtype)   # fp32 accumulation
    y = silu_and_mul(y)                                          # with gated

with every intermediate rounded to ``x.dtype`` where the chain rounds it; results agree with
it to fp32 accumulation order (an output may differ by an ulp where a rounding flips).
Without ``norm_weight`` it is a plain GEMV (``residual`` then is not allowed).

With programmatic dependent launch the weight, bias and norm weight are requested before the
program waits for the previous kernel (:func:`~mrv2_kernels._backend.pdl_early_weights`, on by
default here; ``MRV2_PDL_EARLY_WEIGHTS=0`` turns it off): they must be parameters, which no
kernel of the stream writes (every caller passes a layer's). A batch-1 step is a chain of
small kernels, each mostly waiting on its first weight bytes; this way those bytes are in flight
while the kernel before it finishes (H200, Qwen3-0.6B: norm + qkv 4.42 -> 3.59 µs, norm +
gate/up 6.39 -> 5.50, o 2.64 -> 1.85, down 3.59 -> 2.48, back to back in a graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ._backend import (
    cdiv,
    next_power_of_2,
    pdl,
    pdl_early_weights,
    pdl_prologue,
    pdl_release,
    pdl_wait,
    use_triton,
)
from .cpu_linear import linear_cpu
from .norm import rms_norm, rms_norm_cpu, rms_norm_ref, silu_and_mul, silu_and_mul_ref
from .pdl_gemm import pdl_gemm, use_pdl_gemm
from .skinny_gemm import skinny_linear, skinny_linear_ref, use_skinny

__all__ = [
    "FUSED_NORM_MAX_ELEMS",
    "NORM_GEMV_MAX_K",
    "NORM_GEMV_MAX_M",
    "PLAIN_GEMV_MAX_K",
    "decode_linear",
    "norm_gemv",
    "norm_gemv_ref",
    "norm_gemv_triton",
    "use_norm_gemv",
]

#: Most token rows :func:`use_norm_gemv` sends to the kernel. It reduces on CUDA cores, one row
#: after the other: on the H200 it beats the unfused chain at 1 row (Qwen3-0.6B's norm + qkv
#: 6.4 -> 4.7 µs, norm + gate/up + SwiGLU 9.3 -> 6.9 µs) and loses from about 4 rows on
#: (12.5 against 7.1 µs at 8 rows), where the tensor-core GEMMs take over.
NORM_GEMV_MAX_M = 2
#: Widest reduction dimension the kernel takes (a program holds a whole weight row slice).
NORM_GEMV_MAX_K = 8192
#: What the dispatchers send to it. With a fused norm, at most this many input elements
#: (rows x K): every program recomputes its rows' norms, which stops paying off for wide or
#: many rows (H200: 0.6B's K 1024 wins at 1 and 2 rows, 1.7B's K 2048 at 1 row and loses at
#: 2 (norm + gate/up 24.4 against 20.0 µs), 8B's K 4096 loses at 1 (72 against 55 µs)): there
#: the norm runs first, as its own kernel, and the product (with the SwiGLU) here as a plain
#: GEMV. As a plain GEMV, products with ``K <= PLAIN_GEMV_MAX_K``, any ``N``: it beat the
#: skinny split-K kernel and cuBLAS there at 1 row with its weights requested early (H200,
#: back to back in a graph: 0.6B o_proj 2.64 -> 1.85 µs; 8B o_proj 13.0 -> 9.3 µs, qkv
#: 17.3 -> 13.6 µs, gate/up + SwiGLU 51.5 -> 46.6 µs, at 4.3 TB/s). Past K 4096 it loses:
#: 8B down_proj (K 12288, one output row per program) 34.7 against cuBLAS's 29.9 µs.
FUSED_NORM_MAX_ELEMS = 2048
PLAIN_GEMV_MAX_K = 4096

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _norm_gemv_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    nw_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    eps: float,
    x_s0: int,
    res_s0: int,
    w_s0: int,
    out_s0: int,
    res_out_s0: int,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_WEIGHTS: tl.constexpr = False,
) -> None:
    # EARLY_WEIGHTS: the weights (parameters no kernel writes) are requested before waiting
    # for the previous kernel, so their loads overlap its tail; x and residual after the wait.
    if EARLY_WEIGHTS:
        pdl_release(PDL)
    else:
        pdl_prologue(PDL)
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    w_mask = mask_n[:, None] & mask_k[None, :]
    # The whole weight slice first: every load in flight before any arithmetic waits on one.
    w_src = w_ptr + offs_n.to(tl.int64)[:, None] * w_s0 + offs_k[None, :]
    w = tl.load(w_src, mask=w_mask, other=0.0).to(tl.float32)
    if GATED:
        up_src = w_ptr + (offs_n + N).to(tl.int64)[:, None] * w_s0 + offs_k[None, :]
        w_up = tl.load(up_src, mask=w_mask, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if GATED:
            b_up = tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if EARLY_WEIGHTS:
        pdl_wait(PDL)
    for m in range(M):
        row = tl.full([], 0, tl.int64) + m
        h = tl.load(x_ptr + row * x_s0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if RESIDUAL:
            h += tl.load(res_ptr + row * res_s0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            if pid == 0:
                tl.store(res_out_ptr + row * res_out_s0 + offs_k, h.to(dt), mask=mask_k)
        if NORM:
            # rms_norm's roundings: normed value to the dtype, then the weight product.
            rstd = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
            h = (h * rstd).to(dt).to(tl.float32)
            h = (nw * h).to(dt).to(tl.float32)
        y = tl.sum(w * h[None, :], 1)
        if HAS_BIAS:
            y += b
        if GATED:
            gate = y.to(dt).to(tl.float32)
            up = tl.sum(w_up * h[None, :], 1)
            if HAS_BIAS:
                up += b_up
            up = up.to(dt).to(tl.float32)
            # silu_and_mul's roundings: silu in fp32 to the dtype, then the product.
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            y = act * up
        tl.store(out_ptr + row * out_s0 + offs_n, y.to(dt), mask=mask_n)


def norm_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch specification: the unfused chain. Returns ``(y, new_residual or None)``."""
    _check(x, weight, norm_weight, residual, gated, bias)
    return _chain(x, weight, bias, norm_weight, eps, residual, gated,
                  rms_norm_ref, skinny_linear_ref, silu_and_mul_ref)


def _chain(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    norm: Callable[..., Any],
    linear: Callable[..., torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused chain through the given ops: the references (the specification) or the
    CPU's ops. ``(y, new_residual or None)``."""
    h, new_res = _normed(x, norm_weight, eps, residual, norm)
    y = linear(h, weight, bias)
    return (act(y) if gated else y), new_res


def _normed(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    norm: Callable[..., Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual), x + residual)`` through ``norm``; ``(x, None)`` without a norm
    weight, ``(norm(x), None)`` without a residual."""
    if norm_weight is None:
        return x, None
    if residual is None:
        return norm(x, norm_weight, eps), None
    h, new_res = norm(x, norm_weight, eps, residual)
    return h, new_res


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    gated: bool,
    bias: torch.Tensor | None = None,
) -> None:
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if gated and weight.shape[0] % 2:
        raise ValueError(
            f"gated weight needs an even row count ([gate | up]), got {weight.shape[0]}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (one per weight row), got "
                         f"{tuple(bias.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (k,):
        raise ValueError(f"norm_weight must have shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None:
        if norm_weight is None:
            raise ValueError("residual needs norm_weight (the residual add precedes the norm)")
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape "
                             f"{tuple(x.shape)}")


def _plan(k: int, gated: bool, cuda: bool) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``: about 8K weight elements per program on the GPU."""
    block_k = next_power_of_2(k)
    if not cuda:
        return 4, block_k, 1
    per_row = block_k * (2 if gated else 1)
    return max(1, 8192 // per_row), block_k, 4


def norm_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton implementation of :func:`norm_gemv` (one launch); tile arguments override the
    plan. The new residual is a fresh tensor (other programs still read ``residual``)."""
    _check(x, weight, norm_weight, residual, gated, bias)
    k = x.shape[-1]
    if k > NORM_GEMV_MAX_K:
        raise ValueError(f"norm_gemv_triton takes K <= {NORM_GEMV_MAX_K}, got {k}")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n = weight.shape[0] // (2 if gated else 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r2 = res_out = None
    if residual is not None:
        r2 = residual.reshape(-1, k)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n), (None if res_out is None else res_out.view(*lead, k))
    plan_n, block_k, plan_warps = _plan(k, gated, x.is_cuda)
    bn = block_n or plan_n
    _norm_gemv_kernel[(cdiv(n, bn),)](
        x2, r2 if r2 is not None else x2,
        norm_weight if norm_weight is not None else x2,
        weight, bias if bias is not None else weight, out,
        res_out if res_out is not None else out,
        m, n, k, float(eps), x2.stride(0), (r2 if r2 is not None else x2).stride(0),
        weight.stride(0), out.stride(0), (res_out if res_out is not None else out).stride(0),
        BLOCK_N=bn, BLOCK_K=block_k, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, GATED=gated, HAS_BIAS=bias is not None,
        num_warps=num_warps or plan_warps, EARLY_WEIGHTS=pdl_early_weights(x, default=True),
        **pdl(x),
    )
    return out.view(*lead, n), (None if res_out is None else res_out.view(*lead, k))


def use_norm_gemv(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None
) -> bool:
    """True when the fused kernel should run for this product: a CUDA (or forced-Triton)
    bf16/fp16 input of at most :data:`NORM_GEMV_MAX_M` rows, weights of the same dtype with
    contiguous rows; with a norm, at most :data:`FUSED_NORM_MAX_ELEMS` input elements; without
    one, a plain product with ``K <= PLAIN_GEMV_MAX_K`` (cuBLAS keeps the wider reductions).
    Metadata only."""
    k = x.shape[-1]
    if norm_weight is None:
        fits = k <= PLAIN_GEMV_MAX_K
    else:
        fits = x.numel() <= FUSED_NORM_MAX_ELEMS and norm_weight.dtype == x.dtype
    return (fits and k > 0 and use_triton(x) and x.dtype in _KERNEL_DTYPES
            and weight.dtype == x.dtype and x.numel() <= NORM_GEMV_MAX_M * k
            and weight.stride(-1) == 1)


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest kernel for its shape: this GEMV
    (:func:`use_norm_gemv`), else :func:`~mrv2_kernels.skinny_gemm.skinny_linear` (the skinny
    split-K kernel, or cuBLAS; :func:`~mrv2_kernels.pdl_gemm.pdl_gemm` instead of cuBLAS
    where :func:`~mrv2_kernels.pdl_gemm.use_pdl_gemm`); on the torch path
    (CPU), :func:`~mrv2_kernels.cpu_linear.linear_cpu`."""
    if not use_triton(x):
        return linear_cpu(x, weight, bias)
    if use_norm_gemv(x, weight):
        return norm_gemv_triton(x, weight, bias)[0]
    if use_pdl_gemm(x, weight) and not use_skinny(x, weight):
        return pdl_gemm(x, weight, bias)
    return skinny_linear(x, weight, bias)


def norm_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul?(linear(rms_norm(x + residual)))`` and the residual for the next layer.

    Returns ``(y, new_residual)``: ``new_residual`` is ``x + residual`` rounded to the dtype,
    or ``x`` itself when ``residual`` is None. One fused launch when :func:`use_norm_gemv`;
    otherwise :func:`~mrv2_kernels.norm.rms_norm`, then the product with the SwiGLU fused in
    when the plain GEMV takes it (a decode row of a wide model), else :func:`decode_linear`
    and :func:`~mrv2_kernels.norm.silu_and_mul`; the norm's residual aliasing rules apply:
    treat ``residual`` as consumed. On the torch path (CPU) the chain is
    :func:`~mrv2_kernels.norm.rms_norm_cpu`, :func:`~mrv2_kernels.cpu_linear.linear_cpu` and
    the SwiGLU reference, called directly.
    """
    if not use_triton(x):
        _check(x, weight, norm_weight, residual, gated, bias)
        y, new_res = _chain(x, weight, bias, norm_weight, eps, residual, gated,
                            rms_norm_cpu, linear_cpu, silu_and_mul_ref)
        return y, (x if new_res is None else new_res)
    if use_norm_gemv(x, weight, norm_weight):
        y, new_res = norm_gemv_triton(
            x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, gated=gated
        )
        return y, (x if new_res is None else new_res)
    _check(x, weight, norm_weight, residual, gated, bias)
    h, new_res = _normed(x, norm_weight, eps, residual, rms_norm)
    if gated and use_norm_gemv(h, weight):  # the norm did not fit; the SwiGLU still does
        y = norm_gemv_triton(h, weight, bias, gated=True)[0]
    elif gated and use_pdl_gemm(h, weight):  # the SwiGLU in the GEMM's epilogue
        y = pdl_gemm(h, weight, bias, gated=True)
    else:
        y = decode_linear(h, weight, bias)
        y = silu_and_mul(y) if gated else y
    return y, (x if new_res is None else new_res)
