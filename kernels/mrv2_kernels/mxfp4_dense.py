"""MXFP4 experts dequantized to the activations' dtype for large steps.

The fused MoE's GEMMs decode MXFP4 codes inside their K loop (:mod:`~mrv2_kernels.
fused_moe_int`), which pays at decode sizes, where the weights' bytes are the cost. At
prefill sizes the GEMMs are compute-bound, and the decoding on every tile (each weight decoded
once per 16-128 token rows, then moved to shared memory element by element) makes them
several times slower than the same GEMMs on bf16 weights. There, one pass that writes every
expert's weights in the activations' dtype (memory-bound: 0.53 bytes read and 2 written a
weight), then the unquantized fused MoE, is faster. H100, gpt-oss-20b's layer (32 experts,
2,880 x 2,880, MXFP4), µs (``scripts/proto_mxfp4_dense.py``, 2026-12-05):

==========  =======  =======  =======  =======  =======  =======
tokens       1        64       256      1,024    4,096    8,192
MXFP4 GEMMs  83       584      991      6,490    18,716   34,692
dequantized  1,111    1,594    1,629    1,821    2,880    4,526
==========  =======  =======  =======  =======  =======  =======

(the dequantization alone: 1,026 µs). So steps of :data:`DENSE_MIN_TOKENS` tokens or more
take this path while the scratch (``[E, 2I, H]`` and ``[E, H, I]`` in the activations' dtype,
1.6 GB for gpt-oss-20b) is at most :data:`DENSE_MAX_BYTES`. ``MRV2_MXFP4_DENSE=0`` keeps the
GEMMs' decoding at every size; ``1`` dequantizes at every size (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, use_triton

__all__ = ["DENSE_ENV_VAR", "DENSE_MAX_BYTES", "DENSE_MIN_TOKENS", "dequantize_mxfp4",
           "use_dense"]

#: ``0``: never dequantize; ``1``: at every size; unset: by :func:`use_dense`'s rule.
DENSE_ENV_VAR = "MRV2_MXFP4_DENSE"
#: Fewest tokens (a call's) that dequantize first: between 256 (the GEMMs 991 µs against
#: 1,629) and 1,024 (6,490 against 1,821) on the H100.
DENSE_MIN_TOKENS = 1024
#: Most scratch bytes (both stacks dequantized) the path allocates: gpt-oss-20b's 1.6 GB fits;
#: gpt-oss-120b's 6.4 GB does not (its steps keep the GEMMs' decoding).
DENSE_MAX_BYTES = 4 << 30


def use_dense(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, pack: int,
              dtype: torch.dtype) -> bool:
    """Whether a call of ``num_tokens`` tokens over MXFP4 ``w13`` / ``w2`` (int32 words of
    ``pack`` codes) dequantizes them first (module docstring). Metadata and the environment
    only."""
    setting = os.environ.get(DENSE_ENV_VAR, "").strip()
    if setting == "0":
        return False
    size = torch.empty((), dtype=dtype).element_size()
    scratch = (w13.numel() + w2.numel()) * pack * size
    if setting == "1":
        return True
    return num_tokens >= DENSE_MIN_TOKENS and scratch <= DENSE_MAX_BYTES


@triton.jit
def _dequant_kernel(w_ptr: tl.tensor, s_ptr: tl.tensor, out_ptr: tl.tensor, rows: int,
                    words: int, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr) -> None:
    # Program (i, j): rows i * BLOCK_R.. and words j * BLOCK_W.. of the [rows, words] int32
    # codes (8 a word, low nibble first), written as [BLOCK_R, BLOCK_W * 8] values.
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (r[:, None] < rows) & (c[None, :] < words)
    w = tl.load(w_ptr + r[:, None] * words + c[None, :], mask=mask, other=0)
    codes = (w[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5,
                         (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    value = tl.where((codes >> 3) == 1, -magnitude, magnitude)
    # e8m0 scales, one per 32 codes (4 words): 2 ** (s - 127) as an fp32's exponent field
    s = tl.load(s_ptr + r[:, None] * (words // 4) + (c // 4)[None, :], mask=mask, other=0)
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    out = tl.reshape(value * scale[:, :, None], [BLOCK_R, BLOCK_W * 8])
    k = tl.program_id(1) * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    tl.store(out_ptr + r[:, None] * (words * 8) + k[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(r[:, None] < rows) & (k[None, :] < words * 8))


def dequantize_mxfp4(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     block_r: int | None = None, block_w: int | None = None) -> torch.Tensor:
    """MXFP4 experts ``w`` int32 ``[E, N, K / 8]`` with uint8 e8m0 ``scale`` ``[E, N, K / 32]``
    (:mod:`~mrv2_kernels.fused_moe_int`'s layout) as ``[E, N, K]`` of ``dtype``: each value
    ``e2m1 * 2 ** (s - 127)``, exact where ``dtype`` holds it (``s = 0`` gives 0). One Triton
    pass (the reference, :func:`~mrv2_kernels.fused_moe_int.dequantize_int_experts`, off
    Triton)."""
    if (w.dtype != torch.int32 or scale.dtype != torch.uint8 or w.dim() != 3
            or tuple(scale.shape) != (*w.shape[:2], w.shape[2] // 4) or w.shape[2] % 4):
        raise ValueError(f"MXFP4 experts must be int32 [E, N, K / 8] with uint8 scales "
                         f"[E, N, K / 32]; got {w.dtype} {tuple(w.shape)} and {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if not use_triton(w):
        from .fused_moe_int import dequantize_int_experts

        return dequantize_int_experts(w, scale, None, 4, 32, dtype, fp4=True)
    e, n, words = w.shape
    out = torch.empty(e, n, words * 8, device=w.device, dtype=dtype)
    br = default_block(w, cuda=32, cpu=8, block=block_r)
    bw = default_block(w, cuda=16, cpu=4, block=block_w)
    _dequant_kernel[(cdiv(e * n, br), cdiv(words, bw))](
        w.contiguous(), scale.contiguous(), out, e * n, words, BLOCK_R=br, BLOCK_W=bw,
        num_warps=4)
    return out
