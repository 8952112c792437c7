"""Prototype: gpt-oss-20b's MXFP4 expert layer at prefill and large-decode sizes, the fused MoE
decoding the e2m1 codes in its GEMMs (the default) against the experts dequantized to bf16
first (one Triton pass over the packed weights) and the bf16 fused MoE after it.

    python scripts/proto_mxfp4_dense.py [--tokens 1 8 64 256 1024 4096 8192] [--check]

µs per layer (CUDA graphs over 4 copies of the layer's weights and routings, so the weights
come from HBM), and the dequantization alone. ``--check``: the two paths' outputs agree.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from mrv2_kernels.bench_int import MOE_LAYERS, _moe_layer
from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.fused_moe import fused_moe_triton


@triton.jit
def _dequant_mxfp4(w_ptr, s_ptr, out_ptr, rows, KW, BN: tl.constexpr, BW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rw = pid_k * BW + tl.arange(0, BW)
    mask = (rn[:, None] < rows) & (rw[None, :] < KW)
    words = tl.load(w_ptr + rn[:, None] * KW + rw[None, :], mask=mask, other=0)
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, :, None] >> shifts[None, None, :]) & 15
    e = (codes >> 1) & 3
    m = (codes & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    val = tl.where((codes >> 3) == 1, -mag, mag)
    sc = tl.load(s_ptr + rn[:, None] * (KW // 4) + (rw // 4)[None, :], mask=mask, other=0)
    scale = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    out = tl.reshape(val * scale[:, :, None], [BN, BW * 8])
    cols = pid_k * BW * 8 + tl.arange(0, BW * 8)
    omask = (rn[:, None] < rows) & (cols[None, :] < KW * 8)
    tl.store(out_ptr + rn[:, None] * (KW * 8) + cols[None, :], out.to(tl.bfloat16), mask=omask)


def dequant(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    e, n, kw = w.shape
    rows = e * n
    bn, bw = 32, 16
    _dequant_mxfp4[(triton.cdiv(rows, bn), triton.cdiv(kw, bw))](w, s, out, rows, kw, BN=bn,
                                                                  BW=bw, num_warps=4)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 8192])
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    name = "gpt-oss-20b"
    experts, top_k, hidden, inter, _ = MOE_LAYERS[name]
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = 4
    layers = [_moe_layer(name, gen) for _ in range(copies)]
    d13 = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    d2 = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    dense = [(torch.empty_like(d13), torch.empty_like(d2)) for _ in range(copies)]
    for (w13, w2, ints, _), (a, b) in zip(layers, dense, strict=True):
        dequant(w13, ints.w13_scale, a)
        dequant(w2, ints.w2_scale, b)

    def deq(i: int) -> object:
        w13, w2, ints, _ = layers[i]
        dequant(w13, ints.w13_scale, d13)
        return dequant(w2, ints.w2_scale, d2)

    deq_us = time_graph(deq, copies)
    moved = (d13.numel() + d2.numel()) * (2 + 0.5 + 1 / 32)
    print(f"dequantize one layer: {deq_us:.1f} µs ({moved / deq_us / 1e3:.0f} GB/s)")
    print(f"{'tokens':>6s} {'mxfp4':>9s} {'deq+bf16':>9s} {'bf16':>9s}")
    for t in args.tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = []
        for _ in range(copies):
            logits = torch.randn(t, experts, device="cuda", generator=gen)
            w, ids = logits.softmax(-1).topk(top_k, dim=-1)
            routes.append((w, ids.to(torch.int32)))

        def fp4(i: int, x: torch.Tensor = x, routes: list = routes) -> object:
            w13, w2, ints, epi = layers[i]
            return fused_moe_triton(x, w13, w2, *routes[i], int_experts=ints, epilogue=epi)

        def bf16(i: int, x: torch.Tensor = x, routes: list = routes) -> object:
            epi = layers[i][3]
            return fused_moe_triton(x, *dense[i], *routes[i], epilogue=epi)

        def both(i: int, x: torch.Tensor = x, routes: list = routes) -> object:
            deq(i)
            return fused_moe_triton(x, d13, d2, *routes[i], epilogue=layers[i][3])

        if args.check:
            a, b = fp4(0), bf16(0)
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            print(f"  {t}: max |mxfp4 - bf16| / max |bf16| = {err:.2e}")
        times = [time_graph(functools.partial(f), copies) for f in (fp4, both, bf16)]
        print(f"{t:6d} {times[0]:9.1f} {times[1]:9.1f} {times[2]:9.1f}", flush=True)


if __name__ == "__main__":
    main()
