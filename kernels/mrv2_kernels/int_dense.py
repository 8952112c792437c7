"""Integer (GPTQ / AWQ / compressed-tensors) experts dequantized to the activations' dtype for
large steps: the integer counterpart of :mod:`~mrv2_kernels.mxfp4_dense`, **opt-in**
(``MRV2_INT_DENSE=1``) until it is timed.

At prefill sizes the integer experts' GEMMs are compute-bound and decode every tile: H100,
Qwen3-30B-A3B's layer as 4-bit GPTQ (128 experts, top 8, 2,048 x 768, groups of 128), 2,978
µs at 8,192 tokens against a byte floor of 107 µs and ~1 ms of bf16 tensor-core work
(BENCHMARKS.md, 2026-12-05, thirty-seventh session). Writing the experts in bf16 first
(1.2 GB for that layer) and running the unquantized fused MoE is expected to win there, as it
does for MXFP4 from 1,024 tokens; the threshold is to be set from a measurement
(``scripts/proto_mxfp4_dense.py --layer Qwen3-30B-A3B-GPTQ``). With ``MRV2_INT_DENSE=1`` steps
of :data:`INT_DENSE_MIN_TOKENS` tokens or more take it while the scratch fits
(:data:`~mrv2_kernels.mxfp4_dense.DENSE_MAX_BYTES`); ``all``: every step (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, use_triton
from .fused_moe_int import IntExperts, dequantize_int_experts
from .mxfp4_dense import DENSE_MAX_BYTES, dequantize_mxfp4

__all__ = ["INT_DENSE_ENV_VAR", "INT_DENSE_MIN_TOKENS", "dequantize_experts", "dequantize_int",
           "use_int_dense"]

#: ``1``: integer experts dequantized first for large steps; ``all``: at every size; unset or
#: ``0``: never (the default until it is measured).
INT_DENSE_ENV_VAR = "MRV2_INT_DENSE"
#: Fewest tokens (a call's) that dequantize first when ``MRV2_INT_DENSE=1``.
INT_DENSE_MIN_TOKENS = 4096


def use_int_dense(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, pack: int,
                  dtype: torch.dtype) -> bool:
    """Whether a call of ``num_tokens`` tokens over integer ``w13`` / ``w2`` (int32 words of
    ``pack`` integers) dequantizes them first (module docstring). Metadata and the
    environment only."""
    setting = os.environ.get(INT_DENSE_ENV_VAR, "").strip()
    if setting == "all":
        return True
    if setting != "1":
        return False
    scratch = (w13.numel() + w2.numel()) * pack * torch.empty((), dtype=dtype).element_size()
    return num_tokens >= INT_DENSE_MIN_TOKENS and scratch <= DENSE_MAX_BYTES


@triton.jit
def _dequant_int_kernel(w_ptr: tl.tensor, s_ptr: tl.tensor, z_ptr: tl.tensor,
                        out_ptr: tl.tensor, rows: int, words: int, groups: int,
                        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr) -> None:
    # Program (i, j): rows i * BLOCK_R.. and words j * BLOCK_W.. of the [rows, words] int32
    # integers (PACK a word, lowest bits first), written as [BLOCK_R, BLOCK_W * PACK] values
    # (q - z) * s, each word's integers in one group (GROUP a multiple of PACK).
    PACK: tl.constexpr = 32 // BITS
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (r[:, None] < rows) & (c[None, :] < words)
    w = tl.load(w_ptr + r[:, None] * words + c[None, :], mask=mask, other=0)
    q = (w[:, :, None] >> (tl.arange(0, PACK) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    g = r[:, None] * groups + (c * PACK // GROUP)[None, :]
    s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full([BLOCK_R, BLOCK_W], 1 << (BITS - 1), tl.float32)
    value = (q.to(tl.float32) - z[:, :, None]) * s[:, :, None]
    out = tl.reshape(value, [BLOCK_R, BLOCK_W * PACK])
    k = tl.program_id(1) * BLOCK_W * PACK + tl.arange(0, BLOCK_W * PACK)
    tl.store(out_ptr + r[:, None] * (words * PACK) + k[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(r[:, None] < rows) & (k[None, :] < words * PACK))


def dequantize_int(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                   group_size: int, dtype: torch.dtype, block_r: int | None = None,
                   block_w: int | None = None) -> torch.Tensor:
    """Integer experts ``w`` int32 ``[E, N, K / pack]`` with ``scale`` ``[E, N, K / G]`` and
    uint8 ``zeros`` of its shape or None (symmetric: ``2 ** (bits - 1)``),
    :mod:`~mrv2_kernels.fused_moe_int`'s layout, as ``[E, N, K]`` of ``dtype``: ``(q - z) *
    s`` in fp32, rounded once. One Triton pass (the reference,
    :func:`~mrv2_kernels.fused_moe_int.dequantize_int_experts`, off Triton)."""
    pack = 32 // bits if bits in (4, 8) else 0
    if (not pack or w.dtype != torch.int32 or w.dim() != 3 or group_size % pack
            or (w.shape[2] * pack) % group_size
            or tuple(scale.shape) != (*w.shape[:2], w.shape[2] * pack // group_size)
            or zeros is not None and zeros.shape != scale.shape):
        raise ValueError(f"integer experts must be int32 [E, N, K / {pack or '32/bits'}] "
                         f"(bits 4 or 8) with scales (and zero points) [E, N, K / "
                         f"group_size]; got {w.dtype} {tuple(w.shape)}, bits {bits}, "
                         f"group_size {group_size}, scales {tuple(scale.shape)}")
    if not use_triton(w):
        return dequantize_int_experts(w, scale, zeros, bits, group_size, dtype)
    e, n, words = w.shape
    out = torch.empty(e, n, words * pack, device=w.device, dtype=dtype)
    br = default_block(w, cuda=32, cpu=8, block=block_r)
    bw = default_block(w, cuda=16, cpu=4, block=block_w)
    z = zeros.contiguous() if zeros is not None else scale
    _dequant_int_kernel[(cdiv(e * n, br), cdiv(words, bw))](
        w.contiguous(), scale.contiguous(), z, out, e * n, words, scale.shape[2], BITS=bits,
        GROUP=group_size, HAS_ZEROS=zeros is not None, BLOCK_R=br, BLOCK_W=bw, num_warps=4)
    return out


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                       ints: IntExperts, dtype: torch.dtype) -> torch.Tensor:
    """One stack of experts in ``ints``' format (MXFP4 or integer) as ``[E, N, K]`` of
    ``dtype``: :func:`~mrv2_kernels.mxfp4_dense.dequantize_mxfp4` or :func:`dequantize_int`."""
    if ints.fp4:
        return dequantize_mxfp4(w, scale, dtype)
    return dequantize_int(w, scale, zeros, ints.bits, ints.group_size, dtype)
