"""FP8 block-quantized expert weights for :mod:`mrv2_kernels.fused_moe`: the format, the
reference's quantization steps, the argument checks and load-time helpers.

Format (DeepSeek-V3, GLM-4.5-Air-FP8): ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` in
``float8_e4m3fn``, with ``w13_scale [E, ceil(2I/bn), ceil(H/bk)]`` and ``w2_scale [E,
ceil(H/bn), ceil(I/bk)]`` fp32; the real weight is the fp8 value times the scale of its
``(bn, bk)`` block. Checkpoints use ``(128, 128)``; the engine stores the scales expanded per
row, ``block = (1, 128)`` (:func:`expand_scales_per_row`), because a fused gate/up weight is
assembled from separately quantized gate and up shards whose row offsets need not be
multiples of 128. Any ``bn >= 1`` works; the Triton path needs ``bk`` a power of two.

Contract (the bf16 one of :mod:`~mrv2_kernels.fused_moe`, with two activation
quantizations)::

    xq      = qdq(x, bk)                          # per token and group of bk features
    gate_up = (xq[t] @ deq(w13[e]).T).to(x.dtype)                        # fp32 dot
    act     = (silu(gate_up[:I].float()) * gate_up[I:].float()).to(x.dtype)
    y[t, j] = qdq(act, bk) @ deq(w2[e]).T                               # fp32 dot
    out[t]  = (sum_j topk_weights[t, j] * y[t, j]).to(x.dtype)

``qdq`` (:func:`quant_dequant_groups`) is :func:`~mrv2_kernels.fp8_gemm.
per_token_group_quant_fp8_ref` (``scale = max(amax, 1e-10) / 448``, ``x / scale`` clamped to
+-448 and rounded to nearest even e4m3) followed by ``q * scale`` in fp32; ``deq`` is
``w_fp8 * scale`` in fp32. The roundings the reference models are exactly these: ``x`` to
e4m3 per (token, group), gate/up and the activation to ``x.dtype`` (as the bf16 path), the
activation to e4m3 per (pair, group), and one rounding of the fp32 output sum to ``x.dtype``;
the dots themselves are fp32 (a kernel's fp32 sums in another order, and on sm90 the FP8 MMA's
reduced-precision accumulation within one K step, are what it does not model).

Why the SiLU*up activation is quantized before the down GEMM (as vLLM and SGLang do, and
as DeepSeek-V3 ran its FP8 linears) rather than kept in bf16 against weight-only
dequantization: prefill is compute bound, and only an e4m3 x e4m3 ``tl.dot`` runs on sm90's
FP8 tensor cores (wgmma ``e4m3.e4m3``, twice the bf16 rate; checked in the PTX), while
weight-only dequantization would run bf16 MMAs plus a conversion per weight element. Decode is
bound by the weight bytes, which fp8 halves either way. Numerically both are FP8 models of
the checkpoint; this one is what the checkpoints' reference inference does.

Where the Triton path quantizes (:func:`~mrv2_kernels.fused_moe.moe_tiles`): by default ``x``
and the activation each by one launch of
:func:`~mrv2_kernels.fp8_gemm.per_token_group_quant_fp8_triton` (each element once). The
GEMMs can quantize what they read themselves (tile options: ``fuse_x_quant`` in the gate/up
GEMM, ``act_quant="epilogue"`` when a gate/up program's slice is one scale group,
``act_quant="down"`` in the down GEMM's steps): no launch, but every program of a block redoes
the work on its critical path, and on the H200 that was never faster. Inside the GEMMs the
division is a reciprocal and an fma correction
(:func:`~mrv2_kernels.fp8_gemm._quant_rows`), bit for bit the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv
from .fp8_gemm import (
    FP8_DTYPE,
    _quant_rows,
    dequantize_weight_block_fp8,
    quant_dequant_groups,
    quantize_weight_block_fp8,
)

__all__ = [
    "DEFAULT_BLOCK",
    "check_fp8_args",
    "dequantize_experts",
    "expand_scales_per_row",
    "quant_dequant_groups",
    "quantize_experts_fp8",
]

#: The engine's layout: scales expanded per row, groups of 128 along K.
DEFAULT_BLOCK = (1, 128)

#: Where the Triton path quantizes the SiLU*up activation (see ``MoeTiles.act_quant``).
ACT_QUANT_MODES = ("epilogue", "down", "kernel")


def _block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    if len(block) != 2:
        raise ValueError(f"block must be (bn, bk), got {tuple(block)}")
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive sizes, got {tuple(block)}")
    return bn, bk


def check_fp8_args(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                   w2_scale: torch.Tensor | None, block: tuple[int, int] | list[int]
                   ) -> tuple[int, int] | None:
    """``(bn, bk)`` when the weights are block-quantized FP8 (both scales given), None for the
    unquantized path; a ValueError, starting with the argument at fault, otherwise. The
    weights' shapes are :func:`~mrv2_kernels.fused_moe_ref._check`'s."""
    if w13_scale is None and w2_scale is None:
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype == FP8_DTYPE:
                raise ValueError(f"{name} is {FP8_DTYPE}: pass w13_scale and w2_scale")
        return None
    if w13_scale is None or w2_scale is None:
        missing = "w13_scale" if w13_scale is None else "w2_scale"
        raise ValueError(f"{missing} is needed with the other scale (both or neither)")
    bn, bk = _block(block)
    num_experts, two_i, hidden = w13.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be {FP8_DTYPE} with scales, got {w.dtype}")
    for name, scale, rows, cols in (("w13_scale", w13_scale, two_i, hidden),
                                    ("w2_scale", w2_scale, hidden, two_i // 2)):
        want = (num_experts, cdiv(rows, bn), cdiv(cols, bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"{name} must be {want} for block ({bn}, {bk}), got "
                             f"{tuple(scale.shape)}")
        if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
            raise ValueError(f"{name} must be fp32, got {scale.dtype}")
        if scale.device != w13.device:
            raise ValueError(f"{name} is on {scale.device}, w13 on {w13.device}")
    return bn, bk


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | list[int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real stacked weights ``[E, N, K]`` (fp32 products, one rounding to ``dtype``)."""
    bn, bk = _block(block)
    return torch.stack([dequantize_weight_block_fp8(w[e], scale[e], (bn, bk), dtype)
                        for e in range(w.shape[0])]) if w.shape[0] else w.to(dtype)


def quantize_experts_fp8(w: torch.Tensor, block: tuple[int, int] | list[int] = (128, 128)
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [E, N, K], scale [E, ceil(N/bn), ceil(K/bk)])`` of stacked weights, expert by
    expert (:func:`~mrv2_kernels.fp8_gemm.quantize_weight_block_fp8`): tests, benchmarks, and
    load-time quantization of a bf16 checkpoint."""
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K], got {tuple(w.shape)}")
    pairs = [quantize_weight_block_fp8(w[e], block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def expand_scales_per_row(scale: torch.Tensor, rows: int, bn: int) -> torch.Tensor:
    """``scale`` ``[..., ceil(rows/bn), KB]`` of ``(bn, bk)`` blocks as the ``(1, bk)`` scales
    ``[..., rows, KB]`` (each row its block's scale): how a checkpoint's gate and up shards'
    scales join in one ``w13_scale`` whatever ``I`` is."""
    if scale.shape[-2] != cdiv(rows, bn):
        raise ValueError(f"scale has {scale.shape[-2]} row blocks, {rows} rows of {bn} need "
                         f"{cdiv(rows, bn)}")
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].contiguous()


# ------------------------------------------------- jit helpers of the fused MoE's FP8 steps


@triton.jit
def _round_to(v: tl.tensor, DT: tl.constexpr, CPU: tl.constexpr) -> tl.tensor:
    """fp32 ``v`` rounded to ``DT`` (nearest even), as fp32. The interpreter's fp32 -> bf16
    conversion truncates; there (``CPU``) it is done in fp32 arithmetic, as
    :func:`~mrv2_kernels._backend.round_e4m3` does: ``v`` divided by the bf16 spacing of its
    binade (``2^(e - 7)``, kept normal) is exact, and adding and removing ``1.5 * 2^23``
    rounds it to an integer."""
    if CPU and DT == tl.bfloat16:  # noqa: SIM300 (DT is the variable)
        exp = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 8)
        spacing = ((exp - 7) << 23).to(tl.float32, bitcast=True)
        out = ((v / spacing + 12582912.0) - 12582912.0) * spacing
    else:
        out = v.to(DT).to(tl.float32)
    return out


@triton.jit
def _fp8_a_tile(a: tl.tensor, scale_ptrs: tl.tensor, valid: tl.tensor, group: int,
                QUANT: tl.constexpr, CPU: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The A operand of an FP8 step and its rows' scales: ``a`` quantized here (``QUANT``)
    or already fp8, its scales at ``scale_ptrs + group``. On the interpreter (``CPU``) the fp8
    values come as fp32 (exact)."""
    if QUANT:
        q, scale = _quant_rows(a.to(tl.float32), CPU)
    else:
        scale = tl.load(scale_ptrs + group, mask=valid, other=0.0)
        q = a.to(tl.float32) if CPU else a
    return q, scale


@triton.jit
def _fp8_dot(a: tl.tensor, b: tl.tensor, CPU: tl.constexpr) -> tl.tensor:
    """One step's unscaled fp32 products: FP8 tensor cores on the GPU (a fresh accumulator,
    so the reduced-precision sums of sm90's FP8 MMA span one step only); exact products and
    fp32 sums on the interpreter."""
    return tl.dot(a, b.to(tl.float32), input_precision="ieee") if CPU else tl.dot(a, b)
