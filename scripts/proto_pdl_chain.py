"""Prototype (H200): do Triton GEMMs with programmatic dependent launch beat cuBLAS *in the
decode layer's chain* at 32-256 rows, where cuBLAS wins alone?

A decode step of a large batch runs, per layer, ``rms_norm -> qkv -> (attention) -> o ->
rms_norm -> gate/up -> silu_and_mul -> down``. The norms, SiLU and attention are Triton kernels
launched with PDL (each one's launch and start-up overlap the previous kernel's tail); the four
products are cuBLAS, which takes no part in PDL, so every cuBLAS boundary costs a full launch and
ramp (~2 µs: BENCHMARKS.md, sixteenth session, a Qwen3-0.6B step of 128 requests spends 0.70 ms
in GEMMs that move ~0.25 ms of bytes). The tenth session's Triton TMA GEMM (``proto_gemm.py``)
lost to cuBLAS by 5-20% *alone* on Qwen3-8B shapes, without PDL. Here each product is
:func:`mrv2_kernels.pdl_gemm.pdl_gemm` (the engine's opt-in kernel, ``MRV2_PDL_GEMM=1``):
pointer loads, ``tl.dot``, optionally the SwiGLU in its epilogue (one launch instead of gate/up
+ silu_and_mul), and with PDL its programs let the next kernel launch, optionally load their
first weight tile, and then wait for the previous kernel.

Each variant runs ``--layers`` layers of distinct weights (more bytes than L2) in one CUDA graph;
attention is left out (the o product reads a fixed buffer), so the chain is the part a Triton
GEMM would change. Variants: ``cublas`` (the engine today), ``triton`` (PDL, early weights,
SwiGLU fused), ``triton_late`` (PDL, one pipelined loop after the wait), ``triton_nopdl``.
(A ``triton_norm`` variant, each RMSNorm in the next product's prologue, ran 2.3x the
``triton`` chain's time on Qwen3-0.6B at 32-128 rows and was removed with its kernel:
BENCHMARKS.md, twenty-second session.)
Before the chains, each product's tiles are picked alone (a graph of PDL launches of it).

Usage: ``python scripts/proto_pdl_chain.py [--models 0.6B 8B] [--rows 32 64 128 256]`` on the GPU
(table last: µs per layer, and each product's pick); ``--check`` anywhere (under
``TRITON_INTERPRET=1`` on a CPU): the kernel against torch, plain and SwiGLU, every tile list.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mrv2_kernels._backend import PDL_ENV_VAR
from mrv2_kernels.pdl_gemm import GemmTiles, pdl_gemm, pdl_gemm_ref

#: The kernel's tiles (rows, features, reduction per tile, stages, warps).
Tiles = GemmTiles


def chain_gemm(x: torch.Tensor, w: torch.Tensor, tiles: Tiles, swiglu: bool = False,
               pdl: bool = True, early: bool = True) -> torch.Tensor:
    """``x @ w.T``; with ``swiglu`` ``silu(x @ gate.T) * (x @ up.T)`` of ``w = [gate | up]``:
    :func:`mrv2_kernels.pdl_gemm.pdl_gemm` with these tiles, PDL on or off (``MRV2_PDL``)."""
    saved = os.environ.get(PDL_ENV_VAR)
    os.environ[PDL_ENV_VAR] = "1" if pdl else "0"
    try:
        return pdl_gemm(x, w, gated=swiglu, tiles=tiles, early=early)
    finally:
        if saved is None:
            del os.environ[PDL_ENV_VAR]
        else:
            os.environ[PDL_ENV_VAR] = saved


def tile_list(rows: int, swiglu: bool, n: int = 0, k: int = 0) -> list[Tiles]:
    """Candidates for a product of ``rows`` rows (memory-bound: narrow column tiles, deep K)
    whose shared memory fits: the pipeline's stages plus the tile loaded before the loop, bf16
    (sm_90 AOT compiles: 128x64x128 s3 takes 196,608 bytes; an H200 program may have
    232,448). With the product's ``n`` and ``k``, each also split 2, 4 and 8 ways where the
    launch then has at most 8 waves of programs and each split at least two K tiles."""
    bm = 64 if rows <= 64 else 128
    base = [Tiles(bm, bn, bk, st, w) for bn, bk, st, w in
            [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 3, 4), (64, 64, 6, 4), (128, 64, 3, 4),
             (128, 64, 3, 8)]]
    if rows > 64:
        base.append(Tiles(64, 64, 128, 3, 4))  # two row tiles a weight tile
    base = [t for t in base
            if (t.stages + 1) * 2 * t.bk * (t.bm + t.bn * (2 if swiglu else 1)) <= 225_000]
    out = list(base)
    for t, splits in itertools.product(base, (2, 4, 8)):
        programs = -(-rows // t.bm) * -(-n // t.bn) * splits
        if n and k and programs <= 8 * 132 and k // splits >= 2 * t.bk:
            out.append(Tiles(t.bm, t.bn, t.bk, t.stages, t.warps, splits))
    return out


#: name -> (hidden, qkv out, o in, intermediate) of the decode projections.
MODELS = {"0.6B": (1024, 4096, 2048, 3072), "8B": (4096, 6144, 4096, 12288)}


def check() -> None:
    """The kernel against :func:`~mrv2_kernels.pdl_gemm.pdl_gemm_ref` at small shapes (fp32
    under the interpreter, whose bf16 arithmetic is wrong; bf16 on a GPU), every tile list,
    the first tile early or not."""
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    cases = [(Tiles(16, 16, 16, 2, 4), s, e) for s in (False, True) for e in (False, True)]
    cases += [(Tiles(16, 32, 32, 2, 4), False, True), (Tiles(16, 16, 16, 2, 4, 3), False, True),
              (Tiles(16, 16, 16, 2, 4, 2), True, False)]
    if cuda:
        cases = [(t, s, e) for s in (False, True) for t in tile_list(128, s, 512, 2000)
                 for e in (False, True)]
    for tiles, swiglu, early in cases:
        m, n, k = (40, 48, 80) if not cuda else (100, 512, 2000)
        x = torch.randn(m, k, device=dev).to(dt)
        w = (torch.randn(2 * n if swiglu else n, k, device=dev) / k**0.5).to(dt)
        got = chain_gemm(x, w, tiles, swiglu, early=early).float()
        want = pdl_gemm_ref(x, w, gated=swiglu).float()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        err = (got - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), (str(tiles), swiglu, err)
        print(f"ok {tiles} swiglu={swiglu} early={early} max err {err:.2e}")


def _graph_us(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median µs of one replay of a CUDA graph of ``fn()`` (``bench_skinny.time_graph``)."""
    from mrv2_kernels.bench_skinny import time_graph

    return time_graph(lambda _i: fn(), 1, repeats)


def _case(name: str, rows: int, layers: int
          ) -> tuple[float, list[float], dict[str, tuple[float, float]]]:
    """One model at one batch: the largest difference between the Triton and cuBLAS chains'
    outputs, each variant's µs per layer, and each product alone (Triton's pick, cuBLAS)."""
    from mrv2_kernels.norm import rms_norm, silu_and_mul

    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, qkv_n, o_k, inter = MODELS[name]
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dt)

    ws = [dict(qkv=weight(qkv_n, hidden), o=weight(hidden, o_k), gu=weight(2 * inter, hidden),
               down=weight(hidden, inter),
               n1=torch.rand(hidden, device=dev, generator=g).to(dt) + 0.5,
               n2=torch.rand(hidden, device=dev, generator=g).to(dt) + 0.5)
          for _ in range(layers)]
    x0 = torch.randn(rows, hidden, device=dev, generator=g).to(dt)
    attn = torch.randn(rows, o_k, device=dev, generator=g).to(dt)
    # each product's tiles, picked alone: a graph of `layers` PDL launches of it
    picks: dict[str, Tiles] = {}
    alone: dict[str, tuple[float, float]] = {}
    for key, k_in, swiglu in (("qkv", hidden, False), ("o", o_k, False), ("gu", hidden, True),
                              ("down", inter, False)):
        xin = torch.randn(rows, k_in, device=dev, generator=g).to(dt)
        best: tuple[float, Tiles | None] = (float("inf"), None)
        n_out = ws[0][key].shape[0] // (2 if swiglu else 1)
        for tiles in tile_list(rows, swiglu, n_out, k_in):
            try:
                t_us = _graph_us(lambda t=tiles, s=swiglu, k=key, x=xin: [
                    chain_gemm(x, w[k], t, s) for w in ws]) / layers
            except Exception as exc:  # noqa: BLE001 (out of resources, a compile error)
                print(f"{name} {rows} {key} {tiles}: {type(exc).__name__}", flush=True)
                continue
            if t_us < best[0]:
                best = (t_us, tiles)
        assert best[1] is not None, f"no tiles ran for {name} {key}"
        picks[key] = best[1]
        blas = _graph_us(lambda s=swiglu, k=key, x=xin: [
            silu_and_mul(F.linear(x, w[k])) if s else F.linear(x, w[k]) for w in ws]) / layers
        alone[key] = (best[0], blas)
        print(f"{name} rows {rows} {key}: {best[0]:.1f} us alone with {best[1]}; cuBLAS "
              f"{blas:.1f} us", flush=True)

    def chain(variant: str) -> Callable[[], torch.Tensor]:
        pdl, early = variant != "triton_nopdl", variant == "triton"

        def step() -> torch.Tensor:
            x, res = x0, x0.clone()
            for w in ws:
                h, res = rms_norm(x, w["n1"], 1e-6, res)
                if variant == "cublas":
                    F.linear(h, w["qkv"])
                    o = F.linear(attn, w["o"])
                    h2, res = rms_norm(o, w["n2"], 1e-6, res)
                    x = F.linear(silu_and_mul(F.linear(h2, w["gu"])), w["down"])
                else:
                    chain_gemm(h, w["qkv"], picks["qkv"], pdl=pdl, early=early)
                    o = chain_gemm(attn, w["o"], picks["o"], pdl=pdl, early=early)
                    h2, res = rms_norm(o, w["n2"], 1e-6, res)
                    a = chain_gemm(h2, w["gu"], picks["gu"], True, pdl=pdl, early=early)
                    x = chain_gemm(a, w["down"], picks["down"], pdl=pdl, early=early)
            return x
        return step

    err = (chain("triton")().float() - chain("cublas")().float()).abs().max().item()
    us = [_graph_us(chain(v)) / layers for v in ("cublas", "triton", "triton_late",
                                                  "triton_nopdl")]
    print(f"{name} rows {rows}: " + ", ".join(f"{u:.1f}" for u in us), flush=True)
    return err, us, alone


def run(models: list[str], rows_list: list[int], layers_06b: int) -> None:
    """Every model at every batch; the table prints last."""
    table = []
    for name, rows in itertools.product(models, rows_list):
        err, us, alone = _case(name, rows, layers_06b if name == "0.6B" else 2)
        table.append((name, rows, err, us, alone))
    print(f"\n{'model':5} {'rows':>4} {'max err':>8} {'cublas':>8} {'triton':>8} "
          f"{'late':>8} {'no pdl':>8}   (µs per layer: norms, SiLU, 4 products)")
    for name, rows, err, us, _ in table:
        print(f"{name:5} {rows:4d} {err:8.3f} " + " ".join(f"{u:8.1f}" for u in us))
    print(f"\n{'model':5} {'rows':>4}  each product alone, µs: Triton's pick / cuBLAS")
    for name, rows, _, _, alone in table:
        print(f"{name:5} {rows:4d}  " + "  ".join(f"{key} {t:.1f}/{b:.1f}"
                                               for key, (t, b) in alone.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=8, help="layers of the 0.6B chain (8B: 2)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        sys.exit("the chains need a GPU (--check runs anywhere)")
    run(args.models, args.rows, args.layers)


if __name__ == "__main__":
    main()
