"""``x @ weight.T`` for a decode batch of a small model (3-64 rows) as a Triton kernel that
takes part in programmatic dependent launch, optionally with the SwiGLU fused in and the
reduction split across programs. **On by default** wherever kernels launch with PDL (a CUDA
device of compute capability 9.0+); ``MRV2_PDL_GEMM=0`` turns it off, ``1`` forces it on
wherever the inputs allow (the interpreter too).

Why: a decode step runs, per layer, ``rms_norm -> qkv -> attention -> o -> rms_norm -> gate/up
-> silu_and_mul -> down``. Everything but the four products is a Triton kernel launched with
PDL, whose launch and start-up overlap the previous kernel's tail. The products go to cuBLAS
above :data:`~mrv2_kernels.skinny_gemm.SKINNY_MAX_M` rows, and cuBLAS kernels take no part in
PDL: each product then pays a full launch and ramp (~2 µs).

What the H200 showed (``scripts/proto_pdl_chain.py``, 2026-12-03, the decode layer's chain of
norms, SiLU and four products in a CUDA graph, µs a layer, cuBLAS -> this kernel):

- Qwen3-0.6B shapes: 29.4 -> 27.4 at 32 rows, 30.1 -> 28.4 at 64; it loses from 128 rows on
  (32.2 -> 34.6 at 128, 35.4 -> 42.2 at 256).
- Qwen3-8B shapes: it loses at every batch (116 -> 126 µs at 32 rows, 164 -> 230 at 256),
  split or not: cuBLAS moves those weights at 0.5-0.9 of the copy bandwidth.

So :func:`use_pdl_gemm` takes products of at most :data:`PDL_GEMM_MAX_M` rows and
:data:`PDL_GEMM_MAX_WEIGHT` weight elements only. The engine A/B that made it the default
(H200, 2026-12-03, Qwen3-0.6B, ``mrv2 bench latency``, two rounds, BENCHMARKS.md twentieth
session): time per output token 1.126 -> 1.074 ms at 8 requests, 1.533 -> 1.280 at 32, 1.777 ->
1.633 at 64, level at 1 and 16 (the GEMV and the skinny kernel take those products); time to
first token level.

The kernel: a program owns ``BM`` rows and ``BN`` output features over ``K`` or, with
``splits`` > 1, over one of ``splits`` chunks of ``K``: each split stores an fp32 partial
tile, and the last of the tile's programs to arrive (an arrival counter per tile) sums them in
split order, so the result does not depend on which arrives last. ``EARLY``: the program lets
the next kernel launch, loads its first weight tile, and only then waits for the previous
kernel (weights are parameters no kernel writes: the
:func:`~mrv2_kernels._backend.pdl_early_weights` rule); otherwise it waits first and runs one
pipelined loop. ``gated``: ``weight`` is ``[gate | up]`` (``[2N, K]``), the program also owns
the matching up rows and writes ``silu(gate) * up``, with gate and up rounded to the output
dtype first and the SiLU rounded before the product, as ``silu_and_mul`` after an unfused
product.

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

from ._backend import (
    arrival_counters,
    last_to_arrive,
    pdl,
    pdl_early_weights,
    pdl_enabled,
    pdl_release,
    pdl_wait,
    use_triton,
)

__all__ = ["PDL_GEMM_ENV_VAR", "PDL_GEMM_MAX_M", "PDL_GEMM_MAX_WEIGHT", "PDL_GEMM_MIN_M",
           "GemmTiles", "pdl_gemm", "pdl_gemm_ref", "use_pdl_gemm"]

#: ``0``: cuBLAS keeps every product. ``1``: :func:`pdl_gemm` takes the products
#: :func:`use_pdl_gemm` describes wherever the inputs allow. Unset (the default): it takes them
#: where kernels launch with PDL (:func:`~mrv2_kernels._backend.pdl_enabled`).
PDL_GEMM_ENV_VAR = "MRV2_PDL_GEMM"
#: Most rows :func:`use_pdl_gemm` sends to the kernel (it lost from 128 rows on);
#: ``MRV2_PDL_GEMM_MAX_M`` overrides it (read at import), to measure the kernel past it.
PDL_GEMM_MAX_M = int(os.environ.get("MRV2_PDL_GEMM_MAX_M", "64"))
#: Fewest rows it takes: 1-2 go to the fused norm + GEMV
#: (:data:`~mrv2_kernels.norm_gemv.NORM_GEMV_MAX_M`).
PDL_GEMM_MIN_M = 3
#: Most weight elements (rows x K) it sends: the largest product measured to win, Qwen3-0.6B's
#: gate/up (6,144 x 1,024), exactly. Qwen3-8B's products (16.8 Mi and up), which cuBLAS moves
#: faster, do not fit; nor do sizes between, which no measurement covers (a tensor-parallel
#: shard of Qwen3-8B's o_proj, 4,096 x 2,048, say).
PDL_GEMM_MAX_WEIGHT = 6 * 1024 * 1024

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
    #: programs sharing one tile's reduction (split-K); the last to finish sums them
    splits: int = 1

    def __str__(self) -> str:
        split = f" k/{self.splits}" if self.splits > 1 else ""
        return f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps}{split}"


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
    x_ptr: tl.tensor, w_ptr: tl.tensor, bias_ptr: tl.tensor, out_ptr: tl.tensor,
    ws_ptr: tl.tensor, cnt_ptr: tl.tensor, M: int, N: int, K: int, K_CHUNK: int,
    stride_x: int, stride_w: int, stride_o: int,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    row_ok = rows < M
    col_ok = cols < N
    # this program's reduction range: [k0, k_end) (K_CHUNK: a multiple of BK when split)
    k0 = pid_s * K_CHUNK
    k_end = tl.minimum(k0 + K_CHUNK, K)
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x + (k0 + kk)[None, :]
    w_at = w_ptr + cols[:, None].to(tl.int64) * stride_w + (k0 + kk)[None, :]
    u_at = w_at + N * stride_w
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    start = 0
    if EARLY:  # the first weight tile in flight before the previous kernel ends
        pdl_release(PDL)
        k_ok = (k0 + kk[None, :]) < k_end
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
    for kt in tl.range(start, tl.cdiv(k_end - k0, BK), num_stages=STAGES):
        k_ok = (k0 + kt * BK + kk[None, :]) < k_end
        a = tl.load(x_at, mask=row_ok[:, None] & k_ok, other=0.0)
        b, u = _weight_tiles(w_at, u_at, col_ok, k_ok, GATED)
        acc, acc_up = _accumulate(a, b, u, acc, acc_up, GATED)
        x_at += BK
        w_at += BK
        u_at += BK
    if SPLIT_K > 1:
        # Each split stores its fp32 partial tile; the last split of the tile to arrive sums
        # all of them in split order (the same order whichever arrives last: deterministic),
        # finishes the tile and resets the tile's counter for the next launch.
        width = N * 2 if GATED else N  # a partial row: gate then up columns
        tile_at = rows[:, None].to(tl.int64) * width + cols[None, :]
        tile_ok = row_ok[:, None] & col_ok[None, :]
        ws_split = width * M
        tl.store(ws_ptr + pid_s * ws_split + tile_at, acc, mask=tile_ok)
        if GATED:
            tl.store(ws_ptr + pid_s * ws_split + tile_at + N, acc_up, mask=tile_ok)
        if last_to_arrive(cnt_ptr + pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
            acc = tl.zeros([BM, BN], tl.float32)
            acc_up = tl.zeros([BM, BN], tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(ws_ptr + s * ws_split + tile_at, mask=tile_ok, other=0.0,
                               cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(ws_ptr + s * ws_split + tile_at + N, mask=tile_ok,
                                      other=0.0, cache_modifier=".cg")
            _finish(acc, acc_up, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, N, stride_o,
                    GATED, HAS_BIAS)
    else:
        _finish(acc, acc_up, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, N, stride_o,
                GATED, HAS_BIAS)


@triton.jit
def _finish(acc: tl.tensor, acc_up: tl.tensor, bias_ptr: tl.tensor, out_ptr: tl.tensor,
            rows: tl.tensor, cols: tl.tensor, row_ok: tl.tensor, col_ok: tl.tensor, N: int,
            stride_o: int, GATED: tl.constexpr, HAS_BIAS: tl.constexpr) -> None:
    # The bias, the SwiGLU (gated) and the store of a finished [BM, BN] tile.
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
    """The tiles of a product: on the GPU the H200's picks for Qwen3-0.6B's products at 32
    and 64 rows (``scripts/proto_pdl_chain.py``): 64 x 32 x 128 tiles, 4 stages, the
    reduction split 4 ways where ``K >= N`` (o and down: few output tiles); small tiles for
    the interpreter."""
    if not x.is_cuda:
        return GemmTiles(16, 16, 16, 2, 4)
    return GemmTiles(64, 32, 128, 4, 4, splits=4 if k >= n else 1)


def use_pdl_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`pdl_gemm` should take this product: ``MRV2_PDL_GEMM`` not ``0`` (unset:
    only where :func:`~mrv2_kernels._backend.pdl_enabled`), a CUDA (or, with ``1``,
    forced-Triton) bf16/fp16 input of :data:`PDL_GEMM_MIN_M`-:data:`PDL_GEMM_MAX_M` rows
    (fewer: the fused GEMV),
    weights of its dtype with contiguous rows and at most :data:`PDL_GEMM_MAX_WEIGHT`
    elements. Metadata and the environment only."""
    setting = os.environ.get(PDL_GEMM_ENV_VAR, "").strip()
    if setting == "0" or x.dim() != 2 or (setting != "1" and not pdl_enabled(x)):
        return False
    return (use_triton(x) and x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype
            and PDL_GEMM_MIN_M <= x.shape[0] <= PDL_GEMM_MAX_M and weight.stride(-1) == 1
            and x.stride(-1) == 1 and x.shape[1] == weight.shape[1]
            and weight.numel() <= PDL_GEMM_MAX_WEIGHT)


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
    chunk = triton.cdiv(triton.cdiv(k, max(tiles.splits, 1)), tiles.bk) * tiles.bk
    splits = triton.cdiv(k, chunk) if k else 1
    tiles_mn = (triton.cdiv(m, tiles.bm), triton.cdiv(n, tiles.bn))
    cnt = arrival_counters(x.device, tiles_mn[0] * tiles_mn[1]) if splits > 1 else None
    if cnt is None:  # no split, or a capture found no counters: the whole K in each program
        chunk, splits = max(k, 1), 1
        ws = cnt = out  # unused
    else:
        ws = torch.empty(splits, m, rows_w if gated else n, dtype=torch.float32,
                         device=x.device)
    grid = (*tiles_mn, splits)
    _pdl_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, ws, cnt, m, n, k, chunk,
        x.stride(0), weight.stride(0), out.stride(0), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
        STAGES=tiles.stages, SPLIT_K=splits, GATED=gated, HAS_BIAS=bias is not None,
        EARLY=on_early, num_warps=tiles.warps, **launch,
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
