"""Prototype (H200): a persistent stream-K GEMM against cuBLAS on Qwen3-8B's decode products at
64-256 rows, where cuBLAS moves the weights at 0.56-0.82 of the copy bandwidth (128 rows) or
runs at ~540-670 TFLOP/s (256 rows).

Why stream-K: at these sizes a product has few output tiles. Qwen3-8B's o_proj at 256 rows
in 128 x 128 tiles is 64 tiles for 132 multiprocessors (half of them idle unless the reduction
is split), gate/up in 128 x 256 tiles 192 (1.45 waves: the second wave half empty). Stream-K
gives every program the same share of the whole product's work, ``tiles x K-iterations`` cut
into ``P`` (one program a multiprocessor) contiguous ranges, so a program may start or end
inside a tile. It stores such a partial tile in fp32 and raises its flag; the program that
finishes the tile's last K-iteration (the tile's *owner*) waits for the flags of the programs
before it, adds their partials in program order (the same order every launch: deterministic)
and stores the tile. Each program runs its range's tiles last to first, so what an owner
waits for is the first thing the programs before it do (in range order an owner waited for
the whole of the program before it: a chain through every program). Programs before a
tile's owner hold its earlier K-iterations, so under the interpreter (programs one after
another) every partial exists before its owner reads it, and on the GPU every program is
resident (``P`` at most one a multiprocessor), so the owners' waits end. Each owner zeroes
the flags it consumed, for the next launch (a CUDA graph replay). Both operands load through
TMA tensor descriptors; ``tl.dot`` on wgmma.

The tenth session's non-persistent TMA GEMM (``proto_gemm.py``) lost to cuBLAS on these
shapes but for o at 128-256 rows; its split-K needed a second kernel.

Measured (H200, twenty-second session, BENCHMARKS.md): 0.98-1.46x cuBLAS's time on Qwen3-8B's
products (it wins only down at 64 rows), about 2x on Qwen3-0.6B's; the flat loop (``--flat``)
about twice the nested loops' time. Not adopted.

Usage: ``python scripts/proto_streamk.py [--model 8B|0.6B] [--rows 64 128 256] [--flat]`` on
the GPU (the table prints last: µs by ``do_bench_cudagraph``, best config per case against
cuBLAS and the byte floor);
``--check`` anywhere (under ``TRITON_INTERPRET=1`` on a CPU): the kernel against torch, tiles
that split, tiles that don't, ragged edges.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _finish_segment(acc: tl.tensor, tile: tl.tensor, k_lo: tl.tensor, k_hi: tl.tensor,
                    out_ptr: tl.tensor, ws_ptr: tl.tensor, flag_ptr: tl.tensor, pid: tl.tensor,
                    total: tl.tensor, iters: tl.tensor, tiles_n: tl.tensor, M: int, N: int,
                    stride_o: int, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr) -> None:
    # A segment's sums (the tile's K-iterations [k_lo, k_hi)): a partial for the tile's owner,
    # or (the owner: k_hi is the tile's last iteration) the tile, after the earlier partials
    m0 = (tile // tiles_n) * BM
    n0 = (tile % tiles_n) * BN
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    part_at = ws_ptr + pid * BM * BN + tl.arange(0, BM)[:, None] * BN \
        + tl.arange(0, BN)[None, :]
    if k_hi < iters:
        # an earlier part of the tile: the partial for its owner, then the flag
        tl.store(part_at, acc)
        tl.debug_barrier()  # every thread's partial is stored before the release
        tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
    else:
        if k_lo > 0:  # the owner of a tile other programs began: their partials first
            first = ((tile * iters + 1) * P + total - 1) // total - 1  # holds the tile's unit 0
            total_acc = tl.zeros([BM, BN], dtype=tl.float32)
            for q in range(first, pid):
                while tl.atomic_add(flag_ptr + q, 0, sem="acquire") == 0:
                    pass
                total_acc += tl.load(ws_ptr + q * BM * BN + tl.arange(0, BM)[:, None] * BN
                                     + tl.arange(0, BN)[None, :], cache_modifier=".cg")
                tl.store(flag_ptr + q, 0)  # for the next launch
            acc = total_acc + acc
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _program_range(M: int, N: int, K: int, P: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr
                   ) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    # (column tiles, K-iterations a tile, units in all, this program's units [start, end)):
    # unit = tile * iterations + k-iteration, cut into P equal contiguous ranges
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    iters = tl.cdiv(K, BK)
    total = tl.cdiv(M, BM) * tiles_n * iters
    return tiles_n, iters, total, (pid * total) // P, ((pid + 1) * total) // P


@triton.jit
def _streamk_kernel(x_desc: tl.tensor_descriptor, w_desc: tl.tensor_descriptor,
                    out_ptr: tl.tensor, ws_ptr: tl.tensor, flag_ptr: tl.tensor, M: int, N: int,
                    K: int, stride_o: int, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, STAGES: tl.constexpr) -> None:
    pid = tl.program_id(0)
    tiles_n, iters, total, start, end = _program_range(M, N, K, P, BM, BN, BK)
    # This program's segments (one a tile) run last to first: the last one is the head of a
    # tile the next program owns (the partial that program waits for), the first one the tail
    # of a tile this program owns (whose partials it waits for). First to last, every owner
    # waited for the whole of the program before it, which had waited for the one before it:
    # the programs ran one after another (the first H200 sweep: 2.5-12x cuBLAS's time).
    while end > start:
        tile = (end - 1) // iters
        k_lo = tl.maximum(start, tile * iters) - tile * iters
        k_hi = end - tile * iters
        m0 = (tile // tiles_n) * BM
        n0 = (tile % tiles_n) * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kt in tl.range(k_lo, k_hi, num_stages=STAGES):
            a = x_desc.load([m0, kt * BK])
            b = w_desc.load([n0, kt * BK])
            acc = tl.dot(a, b.T, acc)
        _finish_segment(acc, tile, k_lo, k_hi, out_ptr, ws_ptr, flag_ptr, pid, total, iters,
                        tiles_n, M, N, stride_o, P, BM, BN)
        end -= k_hi - k_lo


@triton.jit
def _streamk_flat_kernel(x_desc: tl.tensor_descriptor, w_desc: tl.tensor_descriptor,
                         out_ptr: tl.tensor, ws_ptr: tl.tensor, flag_ptr: tl.tensor, M: int,
                         N: int, K: int, stride_o: int, P: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr) -> None:
    # The same work in one flat loop over the program's units, last to first (K-iterations
    # too, within a tile), each segment finished inside the loop where its lowest iteration
    # ends: the loads run on across tiles, where the nested loops refill the pipeline at every
    # tile (a program's range crosses 1-3 tiles on these shapes).
    pid = tl.program_id(0)
    tiles_n, iters, total, start, end = _program_range(M, N, K, P, BM, BN, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in tl.range(0, end - start, num_stages=STAGES):
        u = end - 1 - i
        tile = u // iters
        kt = u - tile * iters
        a = x_desc.load([(tile // tiles_n) * BM, kt * BK])
        b = w_desc.load([(tile % tiles_n) * BN, kt * BK])
        acc = tl.dot(a, b.T, acc)
        if kt == 0 or u == start:  # the segment's lowest iteration
            k_hi = tl.minimum(iters, end - tile * iters)
            _finish_segment(acc, tile, kt, k_hi, out_ptr, ws_ptr, flag_ptr, pid, total, iters,
                            tiles_n, M, N, stride_o, P, BM, BN)
            acc = tl.zeros([BM, BN], dtype=tl.float32)


@dataclass(frozen=True)
class Config:
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    flat: bool = False  # _streamk_flat_kernel (one loop over the units) instead of nested loops

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps}" + \
            (" flat" if self.flat else "")


def num_programs(device: torch.device) -> int:
    """One program a multiprocessor on the GPU; a few under the interpreter."""
    if device.type != "cuda":
        return 5
    return torch.cuda.get_device_properties(device).multi_processor_count


def streamk(x: torch.Tensor, w: torch.Tensor, cfg: Config, programs: int,
            scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ w.T`` by stream-K over ``programs`` persistent programs; ``scratch``: the fp32
    partials ``[programs, bm * bn]`` and the int32 flags ``[programs]`` (zeros), reused."""
    m, k = x.shape
    n = w.shape[0]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.bm, cfg.bk])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [cfg.bn, cfg.bk])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if scratch is None:
        scratch = (torch.empty(programs, cfg.bm * cfg.bn, dtype=torch.float32, device=x.device),
                   torch.zeros(programs, dtype=torch.int32, device=x.device))
    ws, flags = scratch
    kernel = _streamk_flat_kernel if cfg.flat else _streamk_kernel
    kernel[(programs,)](x_desc, w_desc, out, ws, flags, m, n, k, out.stride(0), P=programs,
                        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, STAGES=cfg.stages,
                        num_warps=cfg.warps)
    return out


#: Decode projections by model: (name, N, K). Qwen3-0.6B's have 32-48 output tiles of 128 x
#: 128 at 128 rows (a third of the multiprocessors), where cuBLAS takes 6-8 µs for 2-3 µs
#: of bytes.
SHAPES = {"8B": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288)],
          "0.6B": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)]}


def configs(rows: int, flat: bool = False) -> list[Config]:
    """Candidates: row tiles as tall as the batch (at most 128: wgmma's 64 a warpgroup),
    column tiles 64-256, shared memory within an H200 program's 227 KB; ``flat``: the flat
    loop's kernel."""
    bm = 64 if rows <= 64 else 128
    out = []
    for bn, bk, stages, warps in [(64, 64, 6, 4), (128, 64, 4, 4), (128, 64, 4, 8),
                                  (128, 128, 3, 8), (256, 64, 3, 8), (64, 128, 4, 4)]:
        if stages * 2 * bk * (bm + bn) <= 225_000:
            out.append(Config(bm, bn, bk, stages, warps, flat))
    return out


def check(flat_only: bool = False) -> None:
    """Both kernels (``flat_only``: the flat loop's) against torch at small shapes (fp32 under
    the interpreter, whose bf16 arithmetic is wrong; bf16 on a GPU): tiles shared by 2-3
    programs, whole tiles, ragged edges; a second launch over the same scratch (the flags
    zeroed by the owners)."""
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    dev, dt = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"),
                                                                      torch.float32)
    torch.manual_seed(0)
    kinds = (True,) if flat_only else (False, True)
    cases = [(shape, Config(16, 16, 16, 2, 4, flat), programs) for flat in kinds
             for shape, programs in [((40, 48, 80), 5),   # 3 x 3 tiles of 5 iterations
                                     ((16, 32, 64), 3),   # 2 tiles over 3 programs
                                     ((33, 17, 40), 4),   # ragged rows, columns, last K
                                     ((16, 64, 32), 4)]]  # 4 tiles, 4 programs: no split
    if cuda:
        cases = [((rows, 4096, 4096), cfg, num_programs(dev)) for rows in (64, 200)
                 for flat in kinds for cfg in configs(rows, flat)]
    for (m, n, k), cfg, programs in cases:
        x = torch.randn(m, k, device=dev).to(dt)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(dt)
        scratch = (torch.empty(programs, cfg.bm * cfg.bn, dtype=torch.float32, device=dev),
                   torch.zeros(programs, dtype=torch.int32, device=dev))
        want = (x.float() @ w.float().T).to(dt).float()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        launches = [streamk(x, w, cfg, programs, scratch).float() for _ in range(2)]
        err = (launches[0] - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), (str(cfg), m, n, k, err)
        assert int(scratch[1].abs().sum()) == 0, "flags left set"
        assert torch.equal(launches[0], launches[1]), "a second launch gave other bits"
        print(f"ok {m}x{n}x{k} {cfg} over {programs} programs, max err {err:.2e}")


def sweep(model: str, rows_list: list[int], flat: bool) -> None:
    from triton.testing import do_bench_cudagraph

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from proto_gemm import best_config

    dev = torch.device("cuda")
    programs = num_programs(dev)
    table = []
    for (name, n, k), rows in itertools.product(SHAPES[model], rows_list):
        torch.manual_seed(0)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        want = (x.float() @ w.float().T).to(torch.bfloat16).float()
        floor_us = (n * k + rows * k + rows * n) * 2 / 4.2e12 * 1e6
        cublas = do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w),
                                    rep=50) * 1e3
        def launch(cfg: Config, x: torch.Tensor = x, w: torch.Tensor = w
                   ) -> Callable[[], torch.Tensor]:
            scratch = (torch.empty(programs, cfg.bm * cfg.bn, dtype=torch.float32, device=dev),
                       torch.zeros(programs, dtype=torch.int32, device=dev))
            return lambda: streamk(x, w, cfg, programs, scratch)

        best = best_config(f"{name} {rows}", configs(rows, flat), launch, want, cublas)
        table.append((name, rows, floor_us, cublas, *best))
    print(f"\n{'shape':8} {'rows':>4} {'floor':>7} {'cuBLAS':>7} {'streamK':>8}  config "
          f"({programs} programs)")
    for name, rows, floor_us, cublas, us, pick in table:
        print(f"{name:8} {rows:4d} {floor_us:7.1f} {cublas:7.1f} {us:8.1f}  {pick}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--model", default="8B", choices=list(SHAPES))
    ap.add_argument("--flat", action="store_true",
                    help="the flat loop's kernel (the check: that one only)")
    args = ap.parse_args()
    if args.check:
        check(args.flat)
        return
    if not torch.cuda.is_available():
        sys.exit("the sweep needs a GPU (--check runs anywhere)")
    sweep(args.model, args.rows, args.flat)


if __name__ == "__main__":
    main()
