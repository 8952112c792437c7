"""``x @ weight.T`` for a large decode batch (3-256 rows) as a Triton kernel that takes part in
programmatic dependent launch, optionally with the SwiGLU fused in. **Opt-in**
(``MRV2_PDL_GEMM=1``) until measured on a GPU.

Why: a decode step runs, per layer, ``rms_norm -> qkv -> attention -> o -> rms_norm -> gate/up
-> silu_and_mul -> down``. Everything but the four products is a Triton kernel launched with
PDL, whose launch and start-up overlap the previous kernel's tail. The products go to cuBLAS
above :data:`~mrv2_kernels.skinny_gemm.SKINNY_MAX_M` rows, and cuBLAS kernels take no part in
PDL: each product then pays a full launch and ramp (~2 µs; a Qwen3-0.6B step of 128 requests
spends 0.70 ms in GEMMs that move ~0.25 ms of bytes, BENCHMARKS.md sixteenth session). Alone,
a Triton GEMM lost to cuBLAS by 5-20% on Qwen3-8B shapes (``scripts/proto_gemm.py``, tenth
session); whether it wins *in the chain* is what ``scripts/proto_pdl_chain.py`` measures, and
``ab_env.sh MRV2_PDL_GEMM=1`` at engine level.

The kernel: a program owns ``BM`` rows and ``BN`` output features over the whole ``K`` (no
split), row tiles of one weight tile adjacent in launch order (the second reads it from L2).
``EARLY``: the program lets the next kernel launch, loads its first weight tile, and only then
waits for the previous kernel (weights are parameters no kernel writes: the
:func:`~mrv2_kernels._backend.pdl_early_weights` rule); otherwise it waits first and runs one
pipelined loop (the skinny kernel lost with its first tile outside its loop). ``gated``:
``weight`` is ``[gate | up]`` (``[2N, K]``), the program also owns the matching up rows and
writes ``silu(gate) * up``, with gate and up rounded to the output dtype first and the SiLU
rounded before the product, as ``silu_and_mul`` after an unfused product.

Contract (``x`` ``[M, K]``, ``weight`` ``[N, K]`` or ``[2N, K]``, ``bias`` ``[N]`` / ``[2N]``)::

    y = (x.float() @ weight.float().T + bias.float()).to(x.dtype)   # fp32 accumulation
    y = silu_and_mul(y)                                              # with gated
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._backend import pdl, pdl_early_weights, pdl_release, pdl_wait, use_triton

__all__ = ["PDL_GEMM_ENV_VAR", "PDL_GEMM_MAX_M", "GemmTiles", "pdl_gemm", "pdl_gemm_ref",
           "use_pdl_gemm"]

#: ``1`` sends decode products of 3-:data:`PDL_GEMM_MAX_M` rows that no other decode kernel
#: takes to :func:`pdl_gemm` instead of cuBLAS (off by default: not yet measured on a GPU).
PDL_GEMM_ENV_VAR = "MRV2_PDL_GEMM"
#: Most rows :func:`use_pdl_gemm` sends to the kernel (a decode batch; prefill stays cuBLAS).
PDL_GEMM_MAX_M = 256

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmTiles:
    """One launch's tiles: rows, output features and reduction per tile, pipeline depth,
    warps."""

    bm: int
    bn: int
    bk: int
    stages: int
    warps: int

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps}"


@triton.jit
def _weight_tiles(w_at: tl.tensor, u_at: tl.tensor, col_ok: tl.tensor, k_ok: tl.tensor,
                  GATED: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    # The weight tile and, with GATED, the matching up tile (else the weight tile again).
    b = tl.load(w_at, mask=col_ok[:, None] & k_ok, other=0.0)
    u = b
    if GATED:
        u = tl.load(u_at, mask=col_ok[:, None] & k_ok, other=0.0)
    return b, u


@triton.jit
def _accumulate(a: tl.tensor, b: tl.tensor, u: tl.tensor, acc: tl.tensor, acc_up: tl.tensor,
                GATED: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    acc = tl.dot(a, b.T, acc)
    if GATED:
        acc_up = tl.dot(a, u.T, acc_up)
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _pdl_gemm_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, bias_ptr: tl.tensor, out_ptr: tl.tensor, M: int,
    N: int, K: int, stride_x: int, stride_w: int, stride_o: int,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    row_ok = rows < M
    col_ok = cols < N
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]
    w_at = w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :]
    u_at = w_at + N * stride_w
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    start = 0
    if EARLY:  # the first weight tile in flight before the previous kernel ends
        pdl_release(PDL)
        k_ok = kk[None, :] < K
        b0, u0 = _weight_tiles(w_at, u_at, col_ok, k_ok, GATED)
        pdl_wait(PDL)
        a0 = tl.load(x_at, mask=row_ok[:, None] & k_ok, other=0.0)
        acc, acc_up = _accumulate(a0, b0, u0, acc, acc_up, GATED)
        x_at += BK
        w_at += BK
        u_at += BK
        start = 1
    else:
        pdl_wait(PDL)
        pdl_release(PDL)
    for kt in tl.range(start, tl.cdiv(K, BK), num_stages=STAGES):
        k_ok = (kt * BK + kk[None, :]) < K
        a = tl.load(x_at, mask=row_ok[:, None] & k_ok, other=0.0)
        b, u = _weight_tiles(w_at, u_at, col_ok, k_ok, GATED)
        acc, acc_up = _accumulate(a, b, u, acc, acc_up, GATED)
        x_at += BK
        w_at += BK
        u_at += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:  # the unfused chain's roundings: the product, then the SiLU, then the result
        g = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up
    out_at = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out_at, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def default_tiles(x: torch.Tensor, n: int, k: int, gated: bool) -> GemmTiles:
    """The tiles of a product: a first guess until ``scripts/proto_pdl_chain.py`` has picked
    per shape on a GPU (narrow column tiles for a memory-bound product, 128-value reductions);
    small tiles for the interpreter."""
    if not x.is_cuda:
        return GemmTiles(16, 16, 16, 2, 4)
    bm = 64 if x.shape[0] <= 64 else 128
    return GemmTiles(bm, 64, 64 if gated else 128, 4 if gated else 3, 4)


def use_pdl_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`pdl_gemm` should take this product: ``MRV2_PDL_GEMM=1``, a CUDA (or
    forced-Triton) bf16/fp16 input of 3-:data:`PDL_GEMM_MAX_M` rows (fewer: the fused GEMV),
    weights of its dtype with contiguous rows. Metadata and the environment only."""
    if os.environ.get(PDL_GEMM_ENV_VAR, "0") != "1" or x.dim() != 2:
        return False
    return (use_triton(x) and x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype
            and 3 <= x.shape[0] <= PDL_GEMM_MAX_M and weight.stride(-1) == 1
            and x.stride(-1) == 1 and x.shape[1] == weight.shape[1])


def pdl_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    gated: bool = False, tiles: GemmTiles | None = None, early: bool | None = None,
) -> torch.Tensor:
    """The module docstring's contract, in one launch (PDL where the device has it).

    ``tiles``: :func:`default_tiles` when None. ``early``: load the first weight tile before
    waiting for the previous kernel; None: ``MRV2_PDL_EARLY_WEIGHTS`` if set, else off."""
    m, k = x.shape
    rows_w = weight.shape[0]
    if weight.shape[1] != k or (gated and rows_w % 2):
        raise ValueError(f"pdl_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"do not fit{' (gated needs an even number of rows)' if gated else ''}")
    n = rows_w // 2 if gated else rows_w
    if bias is not None and bias.shape != (rows_w,):
        raise ValueError(f"pdl_gemm: bias must have shape ({rows_w},), got {tuple(bias.shape)}")
    tiles = tiles or default_tiles(x, n, k, gated)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = pdl(x)
    on_early = pdl_early_weights(x) if early is None else early  # (without PDL: a peeled tile)
    grid = (triton.cdiv(m, tiles.bm), triton.cdiv(n, tiles.bn))
    _pdl_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
        STAGES=tiles.stages, GATED=gated, HAS_BIAS=bias is not None, EARLY=on_early,
        num_warps=tiles.warps, **launch,
    )
    return out


def pdl_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 gated: bool = False) -> torch.Tensor:
    """Plain-torch specification of :func:`pdl_gemm` (fp32 accumulation, the chain's
    roundings)."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if not gated:
        return y
    g, u = y.float().chunk(2, dim=-1)
    return ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)
