"""Decode linear layers: the skinny kernel against cuBLAS (``F.linear``) at a few rows.

    python -m mrv2_kernels.bench_skinny [--sweep] [--rows 1 4 8 16] [--shapes 8B]

Each case runs one product per weight copy over enough distinct copies that the weights come
from HBM, not L2 (as in a real decode step, which reads every layer once), inside a CUDA graph
(as the decode step runs), and reports µs per product and the weight bandwidth reached, for
cuBLAS also the transposed product (``w @ x.T``, which lets it pick other kernels).
``--sweep`` also tries tile / split / stage choices and prints the best per case; from 32 rows
on (a large decode batch: ``--rows 64 128 256``) it tries wider tiles and 8 warps, to see
whether the kernel can beat cuBLAS's split-K GEMMs there (issue 16's 8B decode at batch 128).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mrv2_kernels._backend import cuda_event_ms
from mrv2_kernels.skinny_gemm import skinny_linear_triton

#: (name, N, K): Qwen3-0.6B's decode projections, then Qwen3-8B's.
SHAPES = [("0.6B qkv", 4096, 1024), ("0.6B o", 1024, 2048), ("0.6B gate_up", 6144, 1024),
          ("0.6B down", 1024, 3072), ("8B qkv", 6144, 4096), ("8B o", 4096, 4096),
          ("8B gate_up", 24576, 4096), ("8B down", 4096, 12288)]


def time_graph(fn: Callable[[int], object], copies: int, repeats: int = 20) -> float:
    """Median µs of ``fn(i)`` over ``copies`` inputs, captured once in a CUDA graph."""
    for i in range(copies):  # compile and warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(repeats):
        times.append(cuda_event_ms(graph.replay) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def _cublas(x: torch.Tensor, weights: list[torch.Tensor], i: int) -> torch.Tensor:
    return F.linear(x, weights[i])


def _cublas_t(x: torch.Tensor, weights: list[torch.Tensor], i: int) -> torch.Tensor:
    return torch.mm(weights[i], x.T)  # the transposed product: y.T = w @ x.T ([N, M] out)


def _skinny(x: torch.Tensor, weights: list[torch.Tensor], tiles: tuple[int, ...], i: int
            ) -> torch.Tensor:
    if not tiles:
        return skinny_linear_triton(x, weights[i])
    block_n, block_k, split_k, num_stages, num_warps = tiles
    return skinny_linear_triton(x, weights[i], None, block_n=block_n, block_k=block_k,
                                split_k=split_k, num_stages=num_stages, num_warps=num_warps)


def _sweep_tiles(m: int, grid: dict[str, list[int]] | None = None
                 ) -> list[tuple[int, int, int, int, int]]:
    """``(block_n, block_k, split_k, num_stages, num_warps)`` candidates for ``m`` rows (or
    the product of ``grid``'s lists, keyed by those names, where given)."""
    if grid:
        return list(itertools.product(grid["block_n"], grid["block_k"], grid["split_k"],
                                      grid["num_stages"], grid["num_warps"]))
    if m < 32:
        return [(bn, bk, s, st, 4) for bn, bk, s, st in itertools.product(
            [16, 32, 64], [128, 256, 512], [1, 2, 4, 8], [3, 4])]
    return [(bn, bk, s, st, w) for bn, bk, s, st, w in itertools.product(
        [64, 128], [64, 128], [1, 2, 4], [3, 4], [4, 8])]


def bench_shape(name: str, n: int, k: int, rows: list[int], sweep: bool,
                grid: dict[str, list[int]] | None = None) -> list[str]:
    """One result line per row count for the ``[N, K]`` weight."""
    dev = torch.device("cuda")
    copies = max(4, (256 << 20) // (n * k * 2))  # >= 256 MiB of weights per replay
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
               for _ in range(copies)]
    nbytes = n * k * 2
    lines = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        cublas = time_graph(functools.partial(_cublas, x, weights), copies)
        cublas_t = time_graph(functools.partial(_cublas_t, x, weights), copies)
        try:
            ours = time_graph(functools.partial(_skinny, x, weights, ()), copies)
        except Exception as exc:  # noqa: BLE001 (its first plan is out of resources there)
            print(f"  skinny plan at M={m}: {type(exc).__name__}")
            ours = float("nan")
        best = ""
        if sweep:
            results = []
            for tiles in _sweep_tiles(m, grid):
                if k // tiles[2] < tiles[1]:
                    continue
                try:
                    fn = functools.partial(_skinny, x, weights, tiles)
                    t = time_graph(fn, copies, 10)
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the tile)
                    print(f"  skip {tiles}: {type(exc).__name__}")
                    continue
                results.append((t, *tiles))
            t, bn, bk, split, stages, warps = min(results)
            best = (f"best {t:7.2f} µs ({nbytes / t / 1e3:5.0f} GB/s) "
                    f"n{bn} k{bk} s{split} st{stages} w{warps}")
        lines.append(
            f"{name:13s} M={m:<3d} cuBLAS {cublas:7.2f} µs ({nbytes / cublas / 1e3:5.0f} GB/s)"
            f"  w@x.T {cublas_t:7.2f} µs"
            f"  skinny {ours:7.2f} µs ({nbytes / ours / 1e3:5.0f} GB/s)  {best}"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", default="", help="only shapes whose name starts so (8B)")
    tile_args = ("block_n", "block_k", "split_k", "num_stages", "num_warps")
    for name in tile_args:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+",
                            help="with --sweep: the tiles tried (all five lists given)")
    args = parser.parse_args()
    grid = {name: getattr(args, name) for name in tile_args}
    if any(grid.values()) and not all(grid.values()):
        parser.error("give all of --block-n --block-k --split-k --num-stages --num-warps")
    lines = []
    for name, n, k in SHAPES:
        if not name.startswith(args.shapes):
            continue
        lines += bench_shape(name, n, k, args.rows, args.sweep,
                             grid if all(grid.values()) else None)
    print("\n".join(["", "summary:", *lines]))


if __name__ == "__main__":
    main()
