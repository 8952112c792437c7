"""Do torch's cuBLAS switches pick faster kernels for the decode GEMMs? (H200 only.)

A Qwen3-8B decode step at 128 requests spends ~26 µs a layer over its GEMMs' bytes in cuBLAS
(BENCHMARKS.md, thirteenth session): down runs a split-K kernel plus a 3.1 µs reduce, qkv and o
sit at 0.58-0.69 of their bytes. torch leaves two knobs that change which kernels cuBLAS may
pick, both process-wide:

- ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``: ``(False, True)``
  keeps split-K but reduces in fp32, ``(False, False)`` forbids split-K (torch allows that on
  the cuBLASLt backend only);
- ``torch.backends.cuda.preferred_blas_library("cublaslt")``.

Each case times ``x @ w.T`` at the decode row counts, inside one CUDA graph that cycles over
enough weight copies (>= 512 MiB) that none is in L2, as in the engine's decode graphs, and
prints µs a product and the fraction of the byte floor (4.2 TB/s) last.

Usage: ``python scripts/blas_options.py [--rows 64 128 256] [--shapes 8B 0.6B]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from mrv2_kernels.bench_skinny import time_graph

SHAPES = {  # name: (K, N) of y = x @ w.T
    "8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576),
           "down": (12288, 4096)},
    "0.6B": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144),
             "down": (3072, 1024)},
}
FLOOR_BYTES_PER_US = 4.2e6  # 4.2 TB/s


def _set(option: str) -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = True  # type: ignore[assignment]
    torch.backends.cuda.preferred_blas_library("cublas")
    if option == "fp32_reduce":
        matmul.allow_bf16_reduced_precision_reduction = (False, True)  # type: ignore[assignment]
    elif option == "lt_no_splitk":  # torch allows it on the cuBLASLt backend only
        torch.backends.cuda.preferred_blas_library("cublaslt")
        matmul.allow_bf16_reduced_precision_reduction = (False, False)  # type: ignore[assignment]
    elif option == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    elif option != "default":
        raise ValueError(option)


def _time_graph(fn: Callable[[], None], reps: int = 20) -> float:
    """Median ms of one replay of a graph that runs ``fn`` once (``bench_skinny.time_graph``)."""
    return time_graph(lambda _i: fn(), 1, reps) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--shapes", nargs="+", default=["8B", "0.6B"])
    ap.add_argument("--options", nargs="+",
                    default=["default", "fp32_reduce", "cublaslt", "lt_no_splitk"])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out: list[str] = []
    for model in args.shapes:
        for name, (k, n) in SHAPES[model].items():
            copies = max(2, (512 << 20) // (k * n * 2))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(copies)]
            for rows in args.rows:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ weights[0].float().T
                cells = []
                for option in args.options:
                    _set(option)
                    torch.mm(x, weights[0].T, out=out)
                    err = (out.float() - ref).abs().max().item()

                    def run(x: torch.Tensor = x, out: torch.Tensor = out,
                            weights: list[torch.Tensor] = weights) -> None:
                        for w in weights:
                            torch.mm(x, w.T, out=out)

                    us = _time_graph(run) * 1000 / copies
                    floor = (k * n * 2 + rows * (k + n) * 2) / FLOOR_BYTES_PER_US
                    cells.append(f"{option} {us:6.1f} ({floor / us:.2f}, err {err:.1e})")
                line = f"{model:5s} {name:8s} rows {rows:4d}: " + " | ".join(cells)
                print(line, flush=True)
                rows_out.append(line)
            del weights
            torch.cuda.empty_cache()
    _set("default")
    print("\nµs a product (fraction of the 4.2 TB/s byte floor, max abs error vs fp32)")
    for line in rows_out:
        print(line)


if __name__ == "__main__":
    main()
