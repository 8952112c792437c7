"""Block-FP8 linear layers (``block_fp8_linear``) against cuBLAS bf16 (``F.linear``).

    python -m mrv2_kernels.bench_fp8 [--json F] [--rows 1 8 64 256 4096] [--sweep] [--shapes ...]

Shapes of a GLM-4.5-Air layer (hidden 4096, 96 query / 8 KV heads of 128, a shared expert of
1408): the fused QKV projection, the output projection, the shared expert's gate/up and down.
Each case runs one product per weight copy over enough distinct copies (>= 256 MiB of weights
per replay) that the weights come from HBM, not L2, as a real step reads every layer once,
inside a CUDA graph (as the decode step runs), and reports the median µs per product, TFLOP/s
(``2*M*N*K / t``) and, for the FP8 path, the byte floor: the bytes the product must move
(fp8 weight + scales, ``x`` in bf16, the bf16 output) over the measured device copy bandwidth.
The FP8 time includes the activation quantization (a kernel of its own or fused into the GEMM,
as :func:`~mrv2_kernels.fp8_gemm.fp8_gemm_tiles` picks). ``--sweep`` also tries tile choices
and prints the best per case (what ``fp8_gemm_tiles`` should be set from).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mrv2_kernels._backend import cuda_event_ms
from mrv2_kernels.fp8_gemm import (
    block_fp8_linear_ref,
    block_fp8_linear_triton,
    fp8_gemm_tiles,
    quantize_weight_block_fp8,
)

#: (name, N, K) of GLM-4.5-Air's linear layers.
SHAPES = [("qkv", 14336, 4096), ("o_proj", 4096, 12288), ("shared gate_up", 2816, 4096),
          ("shared down", 4096, 1408)]
ROWS = [1, 8, 64, 256, 4096]
BLOCK = (128, 128)


def time_graph(fn: Callable[[int], torch.Tensor], copies: int, repeats: int = 20) -> float:
    """Median µs of ``fn(i)`` over ``copies`` inputs, captured once in a CUDA graph."""
    for i in range(copies):  # compile and warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()  # first replay outside the measurement
    times = []
    for _ in range(repeats):
        times.append(cuda_event_ms(graph.replay) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        best = min(best, cuda_event_ms(lambda: dst.copy_(src)) * 1e-3)
    return 2 * nbytes / best


def _fp8(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]],
         tiles: dict[str, Any], i: int) -> torch.Tensor:
    w, s = weights[i]
    return block_fp8_linear_triton(x, w, s, None, BLOCK, **tiles)


def _bf16(x: torch.Tensor, weights: list[torch.Tensor], i: int) -> torch.Tensor:
    return F.linear(x, weights[i])


def _sweep_tiles(m: int) -> list[dict[str, Any]]:
    if m <= 64:
        return [dict(block_n=bn, split_k=split, num_stages=stages, fuse_quant=fuse)
                for bn, split, stages, fuse in itertools.product(
                    [16, 32, 64, 128], [1, 2, 4, 8], [3, 4], [True, False] if m <= 16 else [False])]
    return [dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, group_m=8)
            for bm, bn, warps, stages in [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3),
                                          (128, 128, 8, 4), (128, 64, 4, 4), (64, 256, 8, 3),
                                          (128, 256, 8, 3)]]


def bench_shape(name: str, n: int, k: int, rows: list[int], bandwidth: float, sweep: bool
                ) -> list[dict[str, Any]]:
    """One result per row count for the ``[N, K]`` weight."""
    dev = torch.device("cuda")
    copies = max(2, -(-(256 << 20) // (n * k)))  # >= 256 MiB of fp8 weights per replay
    bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    fp8 = [quantize_weight_block_fp8(w, BLOCK) for w in bf16]
    check = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    w0, s0 = fp8[0]
    want = block_fp8_linear_ref(check, w0, s0).float()
    got = block_fp8_linear_triton(check, w0, s0).float()
    err = ((got - want).norm() / want.norm()).item()
    print(f"{name} [{n}, {k}]: {copies} weight copies; 16 rows vs the reference: "
          f"relative error {err:.2e}", flush=True)
    results = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = time_graph(functools.partial(_bf16, x, bf16), copies)
        t_fp8 = time_graph(functools.partial(_fp8, x, fp8, {}), copies)
        floor_bytes = n * k + s0.numel() * 4 + m * k * 2 + m * n * 2
        floor = floor_bytes / bandwidth * 1e6
        flops = 2 * m * n * k
        row: dict[str, Any] = {
            "shape": name, "M": m, "N": n, "K": k, "bf16_us": t_bf16, "fp8_us": t_fp8,
            "bf16_tflops": flops / t_bf16 / 1e6, "fp8_tflops": flops / t_fp8 / 1e6,
            "floor_us": floor, "fp8_of_floor": floor / t_fp8,
            "plan": fp8_gemm_tiles(m, n, k, BLOCK, dev)._asdict(), "rel_err_vs_ref_m16": err,
        }
        if sweep:
            best: tuple[float, dict[str, Any]] | None = None
            for tiles in _sweep_tiles(m):
                try:
                    t = time_graph(functools.partial(_fp8, x, fp8, tiles), copies, 10)
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the tile)
                    print(f"  skip {tiles}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, tiles)
            if best is not None:
                row["best_us"], row["best_tiles"] = best
        print(f"{name:15s} M={m:<5d} bf16 {t_bf16:9.2f} µs  fp8 {t_fp8:9.2f} µs "
              f"({row['fp8_tflops']:6.1f} TFLOP/s, {row['fp8_of_floor']:.2f} of floor)"
              + (f"  best {row['best_us']:.2f} µs {row['best_tiles']}" if "best_us" in row
                 else ""), flush=True)
        results.append(row)
    del bf16, fp8
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", nargs="+", choices=[name for name, _, _ in SHAPES],
                        help="only these shapes (default: all)")
    parser.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        results += bench_shape(name, n, k, args.rows, bandwidth, args.sweep)
    if args.json:
        import triton

        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__,
                "copy_bandwidth_GBps": bandwidth / 1e9, "block": list(BLOCK)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    head = (f"{'shape':15s} {'M':>5s} {'N':>6s} {'K':>6s} {'bf16 µs':>9s} {'fp8 µs':>9s} "
            f"{'floor µs':>9s} {'of floor':>8s} {'bf16 TF/s':>9s} {'fp8 TF/s':>9s} {'speedup':>7s}")
    lines = ["", "summary (fp8 = block_fp8_linear incl. activation quantization; floor = fp8 "
             "bytes / copy bandwidth):", head]
    for r in results:
        lines.append(
            f"{r['shape']:15s} {r['M']:5d} {r['N']:6d} {r['K']:6d} {r['bf16_us']:9.2f} "
            f"{r['fp8_us']:9.2f} {r['floor_us']:9.2f} {r['fp8_of_floor']:8.2f} "
            f"{r['bf16_tflops']:9.1f} {r['fp8_tflops']:9.1f} {r['bf16_us'] / r['fp8_us']:7.2f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
