"""Prototype (H200): can a Triton GEMM with TMA loads beat cuBLAS on the decode GEMMs of a
large-batch step (64-256 rows, Qwen3-8B shapes), alone or with the SwiGLU fused in?

A Qwen3-8B decode step at 128 requests spends ~4.4 ms in cuBLAS GEMMs whose bytes take ~3.3 ms
(BENCHMARKS.md 2026-12-01, seventh session: qkv 17.5, o 13.9, gate/up 59.5, down 30.7 + 3.1 us
of split-K reduce, per layer). ``y = x @ w.T`` here: a program owns ``BN`` output features of
``BM`` rows and a ``1 / SPLIT_K`` share of the reduction, both operands through TMA tensor
descriptors (``tl.dot(a, b.T, acc)`` on wgmma), ``STAGES`` deep; with ``SPLIT_K > 1`` fp32
partials and a reduce kernel (as cuBLAS's split-K). ``swiglu``: the program also owns the
matching ``up`` rows (``w`` ``[2I, K]`` as ``[gate | up]``) and writes ``silu(gate) * up``
(gate and up rounded to bf16 first, as the unfused chain rounds them), one launch and no
``[M, 2I]`` round trip instead of cuBLAS + the SwiGLU kernel.

Usage: ``python scripts/proto_gemm.py`` on the GPU (every shape, rows and config; the table
prints last, microseconds by ``do_bench_cudagraph``); ``--check`` (any machine, under
``TRITON_INTERPRET=1`` on CPU): each kernel against torch on small shapes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _gemm_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_om, stride_os,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                 STAGES: tl.constexpr, SWIGLU: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together (L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m0 = pid_m * BM
    n0 = pid_n * BN
    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_lo = pid_k * per_split
    k_hi = tl.minimum(k_lo + per_split, k_tiles)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for kt in tl.range(k_lo, k_hi, num_stages=STAGES):
        k = kt * BK
        a = x_desc.load([m0, k])
        b = w_desc.load([n0, k])
        acc = tl.dot(a, b.T, acc)
        if SWIGLU:
            b_up = w_desc.load([N + n0, k])
            acc_up = tl.dot(a, b_up.T, acc_up)
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SWIGLU:  # gate and up rounded as the unfused chain rounds its GEMM output
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    ptrs = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Config:
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    split_k: int = 1

    def __str__(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps}"
                + (f" k{self.split_k}" if self.split_k > 1 else ""))


def gemm(x: torch.Tensor, w: torch.Tensor, cfg: Config, swiglu: bool = False,
         part: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` (``swiglu``: ``silu(x @ gate.T) * (x @ up.T)`` of ``w = [gate | up]``)."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    assert not (swiglu and cfg.split_k > 1), "the SwiGLU epilogue needs whole sums"
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.bm, cfg.bk])
    w_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [cfg.bn, cfg.bk])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if cfg.split_k > 1:
        if part is None:
            part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        target, stride_s = part, m * n
    else:
        target, stride_s = out, 0
    grid = (triton.cdiv(m, cfg.bm), triton.cdiv(n, cfg.bn), cfg.split_k)
    _gemm_kernel[grid](x_desc, w_desc, target, m, n, k, n, stride_s, BM=cfg.bm, BN=cfg.bn,
                       BK=cfg.bk, SPLIT_K=cfg.split_k, STAGES=cfg.stages, SWIGLU=swiglu,
                       num_warps=cfg.warps)
    if cfg.split_k > 1:
        block = 1024 if x.is_cuda else 64
        _reduce_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLIT_K=cfg.split_k,
                                                     BLOCK=block, num_warps=4)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    y = (x.float() @ w.float().T).to(x.dtype)
    if not swiglu:
        return y
    g, u = y.float().chunk(2, dim=-1)
    return (g / (1.0 + torch.exp(-g)) * u).to(x.dtype)


#: Qwen3-8B decode projections: (name, N, K, swiglu); gate_up's N is 2 x 12,288.
SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False),
          ("gate_up", 24576, 4096, False), ("gate_up+swiglu", 24576, 4096, True),
          ("down", 4096, 12288, False)]


def configs(rows: int, swiglu: bool) -> list[Config]:
    bm = min(max(64, triton.next_power_of_2(rows)), 128)
    out = []
    for bn, bk, stages, warps in [(64, 128, 4, 4), (64, 64, 6, 4), (128, 64, 4, 4),
                                  (128, 64, 4, 8), (128, 128, 3, 8), (256, 64, 3, 8)]:
        if swiglu and bn == 256:
            continue
        for split_k in ((1,) if swiglu else (1, 2, 4)):
            out.append(Config(bm, bn, bk, stages if not swiglu else max(2, stages - 1),
                              warps, split_k))
    if bm > 64:  # half-height row tiles: twice the programs, each weight tile read twice
        # (the row tiles of a weight tile run next to each other: from L2 the second time)
        out += [Config(64, 128, 64, 4, 4), Config(64, 128, 64, 4, 4, 2)]
        if swiglu:
            out = [c for c in out if c.split_k == 1]
    return out


def check() -> None:
    """Every kernel path against torch at small shapes (fp32 under the interpreter, whose
    bf16 arithmetic is wrong; bf16 on a GPU)."""
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    cases = [(Config(16, 16, 16, 2, 4, 1), False), (Config(16, 32, 16, 2, 4, 3), False),
             (Config(16, 16, 32, 2, 4, 1), True)]
    if cuda:
        cases = [(c, s) for s in (False, True) for c in configs(128, s)]
    for cfg, swiglu in cases:
        m, n, k = (40, 96, 80) if not cuda else (100, 512, 1024)
        x = torch.randn(m, k, device=dev).to(dt)
        w = (torch.randn(2 * n if swiglu else n, k, device=dev) / k**0.5).to(dt)
        got = gemm(x, w, cfg, swiglu).float()
        want = reference(x, w, swiglu).float()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        err = (got - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), (str(cfg), swiglu, err)
        print(f"ok {cfg} swiglu={swiglu} max err {err:.2e}")


def best_config(label: str, candidates: Sequence[object],
                launch: Callable[[Any], Callable[[], torch.Tensor]], want: torch.Tensor,
                cublas_us: float) -> tuple[float, str]:
    """``(µs, config)`` of the fastest candidate whose result matches ``want`` (fp32, to 5%
    of its largest value), by ``do_bench_cudagraph``; ``launch(config)`` returns the call to
    time (its scratch made once). Wrong results and failures (out of resources, a compile
    error) are printed and skipped; ``(inf, "")`` when none runs. Shared with
    ``proto_streamk.py``."""
    from triton.testing import do_bench_cudagraph

    best = (float("inf"), "")
    for cfg in candidates:
        try:
            fn = launch(cfg)
            err = (fn().float() - want).abs().max().item()
            if err > 0.05 * (1 + want.abs().max().item()):
                print(f"{label} {cfg}: wrong (max err {err:.3g})", flush=True)
                continue
            us = do_bench_cudagraph(fn, rep=50) * 1e3
        except Exception as exc:  # noqa: BLE001 (out of resources, a compile error)
            print(f"{label} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        print(f"{label} {cfg}: {us:.1f} us (cuBLAS {cublas_us:.1f})", flush=True)
        best = min(best, (us, str(cfg)))
    return best


def sweep(rows_list: list[int]) -> None:
    from triton.testing import do_bench_cudagraph

    dev = torch.device("cuda")
    table = []
    for (name, n, k, swiglu), rows in itertools.product(SHAPES, rows_list):
        torch.manual_seed(0)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        want = reference(x, w, swiglu)
        if swiglu:
            from mrv2_kernels.norm import silu_and_mul

            def base(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                return silu_and_mul(torch.nn.functional.linear(x, w))
        else:
            def base(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                return torch.nn.functional.linear(x, w)
        floor_us = (n * k + rows * k + rows * n) * 2 / 4.5e12 * 1e6
        cublas = do_bench_cudagraph(base, rep=50) * 1e3

        def launch(cfg: Config, x: torch.Tensor = x, w: torch.Tensor = w, n: int = n,
                   swiglu: bool = swiglu) -> Callable[[], torch.Tensor]:
            part = (torch.empty(cfg.split_k, x.shape[0], n, dtype=torch.float32, device=dev)
                    if cfg.split_k > 1 else None)
            return lambda: gemm(x, w, cfg, swiglu, part)

        best = best_config(f"{name} {rows}", configs(rows, swiglu), launch, want.float(), cublas)
        table.append((name, rows, floor_us, cublas, *best))
    print(f"\n{'shape':16} {'rows':>4} {'floor':>7} {'cuBLAS':>7} {'best':>7}  config")
    for name, rows, floor_us, cublas, us, cfg in table:
        print(f"{name:16} {rows:4d} {floor_us:7.1f} {cublas:7.1f} {us:7.1f}  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    args = ap.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        sys.exit("the sweep needs a GPU (--check runs anywhere)")
    sweep(args.rows)


if __name__ == "__main__":
    main()
