"""An expert layer of quantized experts at decode and prefill sizes: the fused MoE decoding the
weights in its GEMMs against the experts dequantized to bf16 first (one Triton pass,
:mod:`mrv2_kernels.mxfp4_dense` / :mod:`mrv2_kernels.int_dense`) and the bf16 fused MoE
after it, and the bf16 fused MoE alone.

    python scripts/proto_mxfp4_dense.py [--layer gpt-oss-20b | Qwen3-30B-A3B-GPTQ]
                                        [--tokens 1 8 64 256 1024 4096 8192] [--check]

µs per layer (CUDA graphs over 4 copies of the layer's weights and routings, so the weights
come from HBM), and the dequantization alone. ``--check``: the paths' outputs agree. (The
thirty-seventh session's first version had the MXFP4 pass inline; it moved into the package.)
"""

from __future__ import annotations

import argparse
import functools

import torch

from mrv2_kernels.bench_int import MOE_LAYERS, _moe_layer, moe_routes
from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.fused_moe import IntExperts, fused_moe_triton
from mrv2_kernels.int_dense import dequantize_experts


def dequant(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
            ints: IntExperts) -> torch.Tensor:
    return dequantize_experts(w, scale, zeros, ints, torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layer", choices=sorted(MOE_LAYERS), default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 8192])
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    experts, top_k, hidden, inter, _ = MOE_LAYERS[args.layer]
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = 4
    layers = [_moe_layer(args.layer, gen) for _ in range(copies)]
    dense = [(dequant(w13, ints.w13_scale, ints.w13_zeros, ints),
              dequant(w2, ints.w2_scale, ints.w2_zeros, ints)) for w13, w2, ints, _ in layers]

    def deq(i: int) -> object:
        w13, w2, ints, _ = layers[i]
        dequant(w13, ints.w13_scale, ints.w13_zeros, ints)
        return dequant(w2, ints.w2_scale, ints.w2_zeros, ints)

    deq_us = time_graph(deq, copies)
    n = dense[0][0].numel() + dense[0][1].numel()
    print(f"{args.layer}: dequantize one layer {deq_us:.1f} µs ({n * 2.6 / deq_us / 1e3:.0f} "
          "GB/s)")
    print(f"{'tokens':>6s} {'GEMMs':>9s} {'deq+bf16':>9s} {'bf16':>9s}")
    for t in args.tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = moe_routes(t, experts, top_k, copies, gen)

        def quant(i: int, dense_first: bool, x: torch.Tensor = x, routes: list = routes
                  ) -> torch.Tensor:
            w13, w2, ints, epi = layers[i]
            return fused_moe_triton(x, w13, w2, *routes[i], int_experts=ints, epilogue=epi,
                                    int_dense=dense_first)

        def bf16(i: int, x: torch.Tensor = x, routes: list = routes) -> torch.Tensor:
            return fused_moe_triton(x, *dense[i], *routes[i], epilogue=layers[i][3])

        if args.check:
            a, b = quant(0, False), bf16(0)
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            print(f"  {t}: max |GEMMs - bf16| / max |bf16| = {err:.2e}")
        times = [time_graph(f, copies) for f in (functools.partial(quant, dense_first=False),
                                                  functools.partial(quant, dense_first=True),
                                                  bf16)]
        print(f"{t:6d} {times[0]:9.1f} {times[1]:9.1f} {times[2]:9.1f}", flush=True)


if __name__ == "__main__":
    main()
