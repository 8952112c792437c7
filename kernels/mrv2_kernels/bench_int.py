"""Integer and MXFP4 weights at decode sizes: the W4A16 GEMM and the MXFP4 fused MoE against
their byte floors, with a sweep of their tiles.

    python -m mrv2_kernels.bench_int [--rows 1 8 64] [--sweep | --magic]
                                     [--moe-only | --gemm-only]

``gemm``: Qwen3-8B's four decode projections as 4-bit GPTQ weights (symmetric, groups of
128): the default tiles, with ``--sweep`` the best ``tl.dot`` tiles (the scales applied to
each step's product or folded into the weight tile first) and the best CUDA-core (``gemv``)
tiles, beside cuBLAS on the same product in bf16 (four times the bytes) and the weight's
dequantization plus cuBLAS. ``moe``: gpt-oss-20b's expert layer (32 experts, top 4,
2,880 x 2,880, MXFP4 with e8m0 scales, biases, swigluoai): the default tiles and, with
``--sweep``, K steps of one group (32) against wider ones (the scales folded into the weights)
and the output slices. Each case runs over enough weight copies (and routings) that the
weights come from HBM, inside a CUDA graph, and reports µs and the fraction of the byte floor
(the packed weights and scales read, over the device-to-device copy bandwidth).
``--magic``: the default tiles with and without ``magic`` (the integers made floats from
their bits, :mod:`mrv2_kernels.int_bits`) and, at one row, wider CUDA-core tiles with it;
for the MoE layers, the GEMMs against the pair-a-program CUDA-core kernels
(:mod:`mrv2_kernels.fused_moe_gemv`) up to 8 tokens.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mrv2_kernels.bench_moe import copy_bandwidth
from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.fused_moe import Epilogue, IntExperts, _int_plan, fused_moe_triton, moe_tiles
from mrv2_kernels.wna16_gemm import (
    WNA16Tiles,
    dequantize_wna16_triton,
    wna16_linear_triton,
    wna16_tiles,
)

#: (name, N, K) of Qwen3-8B's decode projections.
SHAPES = [("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 24576, 4096),
          ("8B down", 4096, 12288)]
GROUP = 128
#: (experts, top k, hidden, intermediate, MXFP4) of the expert layers: gpt-oss-20b's (MXFP4),
#: Qwen3-30B-A3B's as 4-bit GPTQ (groups of 128, zero points).
MOE_LAYERS = {"gpt-oss-20b": (32, 4, 2880, 2880, True),
              "Qwen3-30B-A3B-GPTQ": (128, 8, 2048, 768, False)}


def _gemm_candidates(m: int, mode: str, default: WNA16Tiles) -> list[WNA16Tiles]:
    """Tiles to try for ``m`` rows: ``tl.dot`` ones, and CUDA-core ones where they fit;
    ``mode`` "magic": the default tiles with ``magic`` flipped, folded or not, and at one row wider
    CUDA-core ones (the one-row kernel holds two ``[bk / 8, bn]`` fp32 tiles)."""
    if mode == "magic":  # (the default may be a magic one itself: then the conversions)
        out = [default._replace(magic=not default.magic)]
        if not default.gemv:
            out.append(default._replace(magic=True, fold=not default.fold))
        if m == 1:
            out += [WNA16Tiles(1, bn, bk, s, w, 3, True, magic=True)
                    for bn, bk, s, w in itertools.product([128, 256, 512], [64, 128],
                                                          [4, 8, 16], [4, 8])
                    if bk // 8 * bn <= 4096 * w // 4]
        elif m <= 16:  # the CUDA-core kernel over a block of all the rows
            bm = 1 << (m - 1).bit_length()
            out += [WNA16Tiles(bm, bn, 64, s, 4, 3, True, magic=True)
                    for bn, s in itertools.product([64, 128, 256], [4, 8, 16])
                    if bm * 8 * bn <= 8192]
        return out
    out = []
    if m <= 16:
        out += [WNA16Tiles(16, bn, bk, s, 4, 4, False, f) for bn, bk, s, f in itertools.product(
            [64, 128], [64, 128], [1, 4, 8], [False, True])]
        bm = 1 << (m - 1).bit_length()
        # the CUDA-core kernel holds bm x bk x bn products in registers: at most 16K (128
        # a thread of 4 warps), or the compiler spills (and compiles for minutes)
        out += [WNA16Tiles(bm, bn, bk, s, 4, 3, True) for bn, bk, s in itertools.product(
            [64, 128, 256], [32, 64, 128], [1, 2, 4]) if bm * bk * bn <= 16384]
    else:
        out += [WNA16Tiles(bm, bn, 128, s, 4, 3, False, f) for bm, bn, s, f in itertools.product(
            [32, 64], [64, 128], [1, 2], [False, True])]
    return out


def _cublas(x: torch.Tensor, dense: list[torch.Tensor], i: int) -> torch.Tensor:
    return F.linear(x, dense[i])


def _dequant_cublas(x: torch.Tensor, qws: list[torch.Tensor], scales: list[torch.Tensor],
                    i: int) -> torch.Tensor:
    return x @ dequantize_wna16_triton(qws[i], scales[i], None, 4, GROUP, x.dtype)


def bench_gemm(rows: list[int], mode: str, bandwidth: float) -> list[str]:
    """One line per (shape, rows): µs of each path and the fraction of the byte floor (the
    "best" columns: the sweep's, or with ``mode`` "magic" the best magic tiles')."""
    lines = [f"{'case':16s} {'rows':>4s} {'floor':>7s} {'default':>8s} {'best dot':>9s} "
             f"{'best gemv':>9s} {'cuBLAS bf16':>11s} {'deq+cuBLAS':>10s}  best tiles (of floor)"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        weight_bytes = n * k // 2 + n * (k // GROUP) * 2
        copies = max(2, -(-400_000_000 // weight_bytes))
        qws = [torch.randint(-2**31, 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32,
                             generator=gen) for _ in range(copies)]
        scales = [torch.rand(k // GROUP, n, device="cuda", generator=gen).half() * 0.01
                  for _ in range(copies)]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for _ in range(max(2, copies // 4))]
        floor = weight_bytes / bandwidth * 1e6
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)

            def run(tiles: WNA16Tiles | None, i: int, x: torch.Tensor = x,
                    qws: list[torch.Tensor] = qws, scales: list[torch.Tensor] = scales
                    ) -> object:
                return wna16_linear_triton(x, qws[i], scales[i], None, 4, GROUP, None, tiles)

            default = time_graph(functools.partial(run, None), copies)
            best: dict[bool, tuple[float, WNA16Tiles | None]] = {
                False: (float("inf"), None), True: (float("inf"), None)}
            if mode != "default":
                for tiles in _gemm_candidates(m, mode, wna16_tiles(x, n, k, GROUP)):
                    try:
                        us = time_graph(functools.partial(run, tiles), copies)
                    except Exception as err:  # a tile the compiler refuses: skip it, say so
                        lines.append(f"  {tiles}: {type(err).__name__}: {str(err)[:80]}")
                        continue
                    if mode == "magic":
                        lines.append(f"  {name} {m}: {tiles} {us:.1f}")
                    if us < best[tiles.gemv][0]:
                        best[tiles.gemv] = (us, tiles)
            cublas = time_graph(functools.partial(_cublas, x, dense), len(dense))
            deq = time_graph(functools.partial(_dequant_cublas, x, qws, scales), copies)
            win = min(best.values(), key=lambda b: b[0])
            lines.append(
                f"{name:16s} {m:4d} {floor:7.1f} {default:8.1f} {best[False][0]:9.1f} "
                f"{best[True][0]:9.1f} {cublas:11.1f} {deq:10.1f}  "
                f"default {wna16_tiles(x, n, k, GROUP)} ({floor / default:.2f}); "
                f"best {win[1]} ({floor / win[0]:.2f})")
            print("  progress:", lines[-1], flush=True)
        del qws, scales, dense
    return lines


def _moe_layer(name: str, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, IntExperts, Epilogue]:
    """Random packed experts of ``name``'s layer (:data:`MOE_LAYERS`), scales, epilogue."""
    experts, _, hidden, inter, fp4 = MOE_LAYERS[name]
    group = 32 if fp4 else 128
    w13 = torch.randint(-2**31, 2**31 - 1, (experts, 2 * inter, hidden // 8), device="cuda",
                        dtype=torch.int32, generator=gen)
    w2 = torch.randint(-2**31, 2**31 - 1, (experts, hidden, inter // 8), device="cuda",
                       dtype=torch.int32, generator=gen)
    shapes = ((experts, 2 * inter, hidden // group), (experts, hidden, inter // group))
    if fp4:
        s13, s2 = (torch.randint(118, 124, sh, device="cuda", generator=gen).to(torch.uint8)
                   for sh in shapes)
        epi = Epilogue("swigluoai", 7.0,
                       torch.randn(experts, 2 * inter, device="cuda", generator=gen).bfloat16(),
                       torch.randn(experts, hidden, device="cuda", generator=gen).bfloat16())
        return w13, w2, IntExperts(s13, s2, None, None, 4, 32, fp4=True), epi
    s13, s2 = (torch.rand(sh, device="cuda", generator=gen).half() * 0.01 for sh in shapes)
    z13, z2 = (torch.randint(0, 16, sh, device="cuda", generator=gen).to(torch.uint8)
               for sh in shapes)
    return w13, w2, IntExperts(s13, s2, z13, z2, 4, group), Epilogue("silu")


def moe_routes(tokens: int, experts: int, top_k: int, copies: int, gen: torch.Generator
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` random routings of ``tokens`` tokens: the top-``top_k`` of softmaxed random
    logits, ``(weights, int32 ids)`` each."""
    routes = []
    for _ in range(copies):
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        w, ids = logits.softmax(-1).topk(top_k, dim=-1)
        routes.append((w, ids.to(torch.int32)))
    return routes


def _moe_candidates(fp4: bool, mode: str, tokens: int) -> list[dict[str, Any]]:
    if mode == "magic":  # the CUDA-core kernels of a pair a program (a few tokens)
        return [dict(int_gemv=True, block_n1=n1, block_n2=n2, block_k1=k)
                for n1, n2, k in itertools.product([32, 64], [32, 64, 128], [64, 128])
                ] if tokens <= 8 else []
    if fp4:  # one group a step (32) or several, the scales folded into the weights
        return [dict(block_n1=n1, block_k1=k, block_n2=n2, block_k2=k, num_stages=st)
                for n1, n2, k, st in itertools.product([32, 64], [64, 128], [32, 64, 128],
                                                       [3, 4])]
    return [dict(block_n1=n1, block_n2=n2, num_stages=st, int_fold=f)
            for n1, n2, st, f in itertools.product([32, 64], [64, 128], [3, 4], [False, True])]


def bench_moe(rows: list[int], mode: str, bandwidth: float, layer: str) -> list[str]:
    """One line per token count: the default tiles' µs and the best sweep tiles', against the
    byte floor of the experts the routing hits."""
    experts, top_k, hidden, inter, fp4 = MOE_LAYERS[layer]
    group = 32 if fp4 else 128
    lines = [f"{'tokens':>6s} {'hit':>4s} {'floor':>7s} {'default':>8s} {'best':>8s}  tiles"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = 3 * inter * hidden
    per_expert = weights // 2 + weights // group * (1 if fp4 else 3)  # codes, scales, zeros
    copies = 4
    layers = [_moe_layer(layer, gen) for _ in range(copies)]
    for t in rows:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = moe_routes(t, experts, top_k, copies, gen)
        hit = sum(int(r[1].unique().numel()) for r in routes) / copies
        floor = hit * per_expert / bandwidth * 1e6

        def run(tiles: dict[str, Any], i: int, x: torch.Tensor = x,
                routes: list[tuple[torch.Tensor, torch.Tensor]] = routes) -> object:
            w13, w2, ints, epi = layers[i]
            return fused_moe_triton(x, w13, w2, *routes[i], int_experts=ints, epilogue=epi,
                                    **tiles)

        default = time_graph(functools.partial(run, {}), copies)
        best: tuple[float, dict[str, Any]] = (float("inf"), {})
        if mode == "magic":  # the GEMMs' default, whatever the token count's default is
            gemms = time_graph(functools.partial(run, {"int_gemv": False}), copies)
            lines.append(f"  {t}: GEMMs {gemms:.1f}")
        if mode != "default":
            for tiles in _moe_candidates(fp4, mode, t):
                try:
                    us = time_graph(functools.partial(run, tiles), copies)
                except Exception as err:
                    lines.append(f"  {tiles}: {type(err).__name__}: {str(err)[:80]}")
                    continue
                lines.append(f"  {t}: {tiles} {us:.1f}")
                print(lines[-1], flush=True)
                best = min(best, (us, tiles), key=lambda b: b[0])
        plan = _int_plan(moe_tiles(t, top_k, experts, hidden, inter, x.device),
                         t * top_k / experts, fp4, True, t)  # what the default call ran
        lines.append(f"{t:6d} {hit:5.1f} {floor:7.1f} {default:8.1f} {best[0]:8.1f}  default "
                     f"{plan} ({floor / default:.2f}); best {best[1]} ({floor / best[0]:.2f})")
        print("  progress:", lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--sweep", action="store_true")
    modes.add_argument("--magic", action="store_true")
    parser.add_argument("--gemm-only", action="store_true")
    parser.add_argument("--moe-only", action="store_true")
    parser.add_argument("--moe-layers", nargs="+", default=list(MOE_LAYERS),
                        choices=list(MOE_LAYERS))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; µs per call, weights from HBM")
    parts: list[tuple[str, Callable[[list[int], str, float], list[str]]]] = []
    if not args.moe_only:
        parts.append(("W4A16 GEMM, Qwen3-8B projections (GPTQ 4-bit, groups of 128)",
                      bench_gemm))
    if not args.gemm_only:
        parts += [(f"fused MoE, {name}'s layer", functools.partial(bench_moe, layer=name))
                  for name in args.moe_layers]
    out: list[Any] = []
    for title, fn in parts:
        print(title, flush=True)
        mode = "sweep" if args.sweep else "magic" if args.magic else "default"
        out += ["", title, *fn(args.rows, mode, bandwidth)]
    print("\n".join(out))


if __name__ == "__main__":
    main()
