"""Tile plans of the fused MoE (:mod:`mrv2_kernels.fused_moe`): block sizes by pairs per
expert, for bf16/fp16/fp32 and for FP8 weights, and the rules the FP8 quantization places
impose on overridden tiles. Plain Python, no kernels: the plans are testable without a GPU."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fused_moe_fp8 import ACT_QUANT_MODES

__all__ = ["MoeTiles", "moe_tiles"]


class MoeTiles(NamedTuple):
    """Tile choices of :func:`fused_moe_triton` (all powers of two; the GEMM ones >= 16)."""

    block_m: int  # sorted pairs per block (the align padding unit)
    block_n1: int  # intermediate features per gate/up program (gate and up: 2x the columns)
    block_k1: int  # hidden features per gate/up step
    block_n2: int  # hidden features per down program
    block_k2: int  # intermediate features per down step
    group_m: int  # blocks that walk the output slices together (L2 reuse of weight slices)
    num_warps: int
    num_stages: int
    fused_combine: bool  # the down GEMM adds each token's K rows (no combine launch)
    # FP8 weights only (block K ``bk``; both K steps divide it):
    fuse_x_quant: bool = False  # the gate/up GEMM quantizes x itself (block_k1 == bk)
    act_quant: str = "kernel"  # SiLU*up quantized in the gate/up "epilogue" (block_n1 ==
    #  bk), in the "down" GEMM's steps (block_k2 == bk), or by its own "kernel"
    # integer weights only: each step's weight tile scaled and rounded to x's dtype before its
    # dot (which then accumulates in place), not the step's product scaled after it
    int_fold: bool = False
    # integer / MXFP4 weights only: made floats from their bits (mrv2_kernels.int_bits), not by
    # integer-to-float conversions
    int_magic: bool = False
    # integer / MXFP4 weights only: the CUDA-core kernels of a pair a program
    # (mrv2_kernels.fused_moe_gemv; block_n1 / block_n2 / block_k1 their slices and K step)
    int_gemv: bool = False


def moe_tiles(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
              device: torch.device, fp8_block: tuple[int, int] | None = None) -> MoeTiles:
    """Default tiles for a ``[T, H]`` batch routed ``top_k`` ways over ``num_experts``
    (``fp8_block``: FP8 weights with ``(bn, bk)`` blocks, :func:`_fp8_tiles`).

    CPU (the interpreter): small tiles. CUDA, by the average pairs per expert ``T*K/E``
    (from sweeps of ``bench_moe`` on an H200 with Qwen3-30B-A3B's layer): up to 16 (decode,
    bound by reading the hit experts' weights), 16-row blocks, 32 intermediate / 64 hidden
    features per program and 128-long steps (flat within 5% over 16-64 / 16-64 / 128-256);
    up to 64, 64-row blocks; beyond, 128-row blocks of 128-wide slices and 8 warps (a third
    faster than 64-row blocks at 8,192 tokens). The fused combine up to 4 pairs per expert
    (1-3 µs less from 1 to 64 tokens; with more rows per block its per-row atomics and sums
    cost more than the combine kernel: +12 µs at 256 tokens, +440 µs at 8,192).
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if fp8_block is not None:
        return _fp8_tiles(per_expert, fp8_block[1], device)
    if device.type != "cuda":
        return MoeTiles(16, 32, 32, 32, 32, 1, 4, 1, True)
    if per_expert <= 16:
        return MoeTiles(16, 32, 128, 64, 128, 1, 4, 4, per_expert <= 4)
    if per_expert <= 64:
        return MoeTiles(64, 64, 64, 128, 64, 8, 4, 3, False)
    return MoeTiles(128, 128, 64, 128, 64, 8, 8, 3, False)


def _fp8_tiles(per_expert: float, bk: int, device: torch.device) -> MoeTiles:
    """FP8 tiles, from ``bench_moe --fp8 --sweep`` on an H200 (2026-12-01, GLM-4.5-Air's
    experts at 1, 8 and 64 tokens). K steps of 128 fp8 features (cut to the largest power of
    two dividing ``bk``). Decode (up to 16 pairs per expert): 16-row blocks, 4 warps, 4
    stages, 32 intermediate features per gate/up program and 64 (up to one pair per expert)
    or 128 hidden features per down program (0.62 / 0.89 / 0.93 of the byte floor at 1 / 8 /
    64 tokens). Beyond: 64-row blocks, 64 intermediate / 128 hidden features per program, 4
    warps, 3 stages (at 2,048 tokens 13% faster than 128-wide gate/up slices with 8 warps,
    which let the epilogue quantize whole groups; 128-row blocks were slower still). ``x``
    and the activation are quantized by their own launches everywhere: the sweep's in-GEMM
    places (``fuse_x_quant``, ``"down"``, ``"epilogue"``, each program redoing the
    quantization on its critical path) were never faster."""
    step = bk & -bk
    if device.type != "cuda":
        plan = MoeTiles(16, 32, 32, 32, 32, 1, 4, 1, True, False, "kernel")
    elif per_expert <= 16:
        plan = MoeTiles(16, 32, 128, 64 if per_expert <= 1 else 128, 128, 1, 4, 4,
                        per_expert <= 4, False, "kernel")
    else:
        plan = MoeTiles(64, 64, 128, 128, 128, 8, 4, 3, False, False, "kernel")
    plan = plan._replace(block_k1=min(plan.block_k1, step), block_k2=min(plan.block_k2, step))
    return plan._replace(fuse_x_quant=plan.fuse_x_quant and plan.block_k1 == bk,
                         act_quant=_fit_act_quant(plan.act_quant, plan, bk))


def _fit_act_quant(mode: str, tiles: MoeTiles, bk: int) -> str:
    """``mode`` if the tiles allow it, else the separate kernel."""
    if (mode == "epilogue" and tiles.block_n1 != bk) or (mode == "down" and tiles.block_k2 != bk):
        return "kernel"
    return mode


def _check_fp8_tiles(tiles: MoeTiles, bk: int, default_fuse_x: bool = False,
                     default_act_quant: bool = False) -> MoeTiles:
    """The FP8 tile rules (a ValueError names the argument); a default ``fuse_x_quant`` or
    ``act_quant`` that overridden tiles do not allow becomes the separate kernel."""
    for name in ("block_k1", "block_k2"):
        if bk % getattr(tiles, name):
            raise ValueError(f"{name} must divide the weight block's K {bk}, got "
                             f"{getattr(tiles, name)}")
    if default_fuse_x and tiles.block_k1 != bk:
        tiles = tiles._replace(fuse_x_quant=False)
    if tiles.fuse_x_quant and tiles.block_k1 != bk:
        raise ValueError(f"fuse_x_quant needs block_k1 == the weight block's K {bk}, got "
                         f"{tiles.block_k1}")
    if tiles.act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {tiles.act_quant!r}")
    fitted = _fit_act_quant(tiles.act_quant, tiles, bk)
    if fitted != tiles.act_quant and not default_act_quant:
        need = "block_n1" if tiles.act_quant == "epilogue" else "block_k2"
        raise ValueError(f"act_quant {tiles.act_quant!r} needs {need} == the weight block's "
                         f"K {bk}")
    return tiles._replace(act_quant=fitted)
