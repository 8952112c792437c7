"""The fused norm + GEMV (+ SwiGLU) decode kernel against the chain of kernels it replaces.

    python -m mrv2_kernels.bench_norm_gemv [--sweep] [--rows 1 2 4] [--only 0.6B 8B]

Same method as :mod:`mrv2_kernels.bench_skinny`: one product per weight copy over >= 256 MiB of
distinct copies (weights from HBM), inside a CUDA graph, µs per product. "chain" is what a
decode step ran before: ``rms_norm`` (with the residual add), then ``skinny_linear`` (cuBLAS
for these shapes, the skinny kernel for ``K >= N``), then ``silu_and_mul`` for gate/up. Plain
rows (no norm) compare the kernel as a bare GEMV with the skinny split-K kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.norm import rms_norm, silu_and_mul
from mrv2_kernels.norm_gemv import norm_gemv_triton
from mrv2_kernels.skinny_gemm import skinny_linear

#: (name, N, K, fused norm, gated): decode projections of Qwen3-0.6B, 1.7B and 8B.
CASES = [("0.6B norm+qkv", 4096, 1024, True, False),
         ("0.6B norm+gate_up+silu", 3072, 1024, True, True),
         ("0.6B o (plain)", 1024, 2048, False, False),
         ("0.6B down (plain)", 1024, 3072, False, False),
         ("1.7B norm+qkv", 4096, 2048, True, False),
         ("1.7B norm+gate_up+silu", 6144, 2048, True, True),
         ("1.7B o (plain)", 2048, 2048, False, False),
         ("1.7B down (plain)", 2048, 6144, False, False),
         ("8B norm+qkv", 6144, 4096, True, False),
         ("8B norm+gate_up+silu", 12288, 4096, True, True),
         ("8B o (plain)", 4096, 4096, False, False),
         ("8B qkv (plain)", 6144, 4096, False, False),
         ("8B gate_up+silu (plain)", 12288, 4096, False, True)]


def _chain(x: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, weights: list[torch.Tensor],
           norm: bool, gated: bool, i: int) -> torch.Tensor:
    h = x
    if norm:
        h, _ = rms_norm(x, nw, 1e-6, res)
    y = skinny_linear(h, weights[i])  # what the step ran before: skinny split-K or cuBLAS
    return silu_and_mul(y) if gated else y


def _fused(x: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, weights: list[torch.Tensor],
           norm: bool, gated: bool, tiles: tuple[int, int] | None, i: int) -> torch.Tensor:
    bn, warps = tiles if tiles else (None, None)
    y, _ = norm_gemv_triton(x, weights[i], norm_weight=nw if norm else None,
                            residual=res if norm else None, gated=gated, block_n=bn,
                            num_warps=warps)
    return y


def bench_case(name: str, n: int, k: int, norm: bool, gated: bool, rows: list[int],
               sweep: bool) -> list[str]:
    dev = torch.device("cuda")
    n_rows = 2 * n if gated else n
    nbytes = n_rows * k * 2
    copies = max(4, (256 << 20) // nbytes)
    weights = [torch.randn(n_rows, k, device=dev, dtype=torch.bfloat16) / k**0.5
               for _ in range(copies)]
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
    lines = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        chain = time_graph(functools.partial(_chain, x, res, nw, weights, norm, gated), copies)
        fused = time_graph(functools.partial(_fused, x, res, nw, weights, norm, gated, None),
                           copies)
        best = ""
        if sweep:
            results = []
            block_k = 1 << (k - 1).bit_length()
            for bn, warps in itertools.product([1, 2, 4, 8, 16, 32], [2, 4, 8]):
                if bn * block_k * (2 if gated else 1) > 32768:
                    continue
                fn = functools.partial(_fused, x, res, nw, weights, norm, gated, (bn, warps))
                try:
                    results.append((time_graph(fn, copies, 10), bn, warps))
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the tile)
                    print(f"  skip n{bn} w{warps}: {type(exc).__name__}")
            t, bn, warps = min(results)
            best = f"best {t:6.2f} µs ({nbytes / t / 1e3:5.0f} GB/s) n{bn} w{warps}"
        lines.append(f"{name:24s} M={m:<2d} chain {chain:6.2f} µs  fused {fused:6.2f} µs "
                     f"({nbytes / fused / 1e3:5.0f} GB/s)  {best}")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", nargs="*", default=None,
                        help="only the cases whose name starts with one of these (0.6B 8B)")
    args = parser.parse_args()
    lines = []
    for case in CASES:
        if args.only is None or any(case[0].startswith(p) for p in args.only):
            lines += bench_case(*case, args.rows, args.sweep)
    print("\n".join(["", "summary:", *lines]))


if __name__ == "__main__":
    main()
