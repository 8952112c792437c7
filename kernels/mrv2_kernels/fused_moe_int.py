"""Integer (W4A16 / W8A16) expert weights for :mod:`mrv2_kernels.fused_moe`: the layout, its
checks, the dequantizing reference and the jit helper that unpacks a weight tile.

Layout (GPTQ, AWQ and compressed-tensors experts, converted at load by
:mod:`mrv2.layers.int_quant_moe`)::

    w13  int32 [E, 2I, H / pack]   pack = 32 / bits; packed along K (each row's inputs):
    w2   int32 [E, H, I / pack]    input k at bits (k % pack) * bits of word k // pack
    w13_scale [E, 2I, H / G], w2_scale [E, H, I / G]     per output row and group of G inputs
    w13_zeros / w2_zeros: uint8, the scales' shapes, or None (symmetric: 2 ** (bits - 1))

The real weight is ``(q - zero) * scale``. MXFP4 experts (``fp4``; gpt-oss): the same packing
of 4-bit codes, each an e2m1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives), groups of 32 and uint8 e8m0 scales (``2 ** (s - 127)``; ``s = 0``
reads as 0, not ``2 ** -127``), no zero points. The contract is the unquantized one of
:mod:`~mrv2_kernels.fused_moe` on those weights (activations stay in ``x``'s dtype: nothing
else is quantized). The Triton GEMMs load ``[BLOCK_K / pack, BLOCK_N]`` words a step, unpack
them along K (:func:`_int_tile`), subtract the zero points and ``tl.dot`` the small integers
(exact in bf16 / fp16) with the activations, then scale the step's fp32 product by the
group's scales: ``BLOCK_K`` divides ``G``, so a step lies in one group. MXFP4's steps may
span several groups of 32 (``BLOCK_K > G``, :func:`_int_tile`): their power-of-two scales go
into the weights' exponents instead, and the step's product needs no scaling.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .int_bits import bias, biased, e2m1
from .wna16_gemm import dequantize_wna16, pack_along_k

__all__ = ["IntExperts", "check_int_args", "dequantize_int_experts", "e2m1_values",
           "e8m0_scales", "mxfp4_codes", "pack_experts"]

#: The 16 e2m1 codes' values (code ``c``: sign ``c >> 3``, exponent ``(c >> 1) & 3``,
#: mantissa ``c & 1``).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class IntExperts(NamedTuple):
    """Integer experts' scales, zero points and format (the packed weights are ``w13`` /
    ``w2`` themselves)."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    w13_zeros: torch.Tensor | None
    w2_zeros: torch.Tensor | None
    bits: int
    group_size: int
    fp4: bool = False
    """MXFP4: e2m1 codes with uint8 e8m0 scales (module docstring)."""


def check_int_args(w13: torch.Tensor, w2: torch.Tensor, q: IntExperts, hidden: int
                   ) -> tuple[int, int]:
    """``(intermediate size, pack)`` of integer experts in the module's layout; a ValueError
    naming the argument otherwise."""
    if q.bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {q.bits}")
    if q.fp4 and (q.bits != 4 or q.w13_zeros is not None or q.w2_zeros is not None
                  or q.w13_scale.dtype != torch.uint8 or q.w2_scale.dtype != torch.uint8):
        raise ValueError("fp4 (MXFP4) experts need bits = 4, uint8 e8m0 scales and no zero "
                         "points")
    pack = 32 // q.bits
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != torch.int32 or w.dim() != 3:
            raise ValueError(f"{name} must be int32 [E, N, K / {pack}], got {w.dtype} "
                             f"{tuple(w.shape)}")
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    group = q.group_size
    for name, w, rows, cols in (("w13", w13, two_i, hidden), ("w2", w2, hidden, inter)):
        if tuple(w.shape) != (num_experts, rows, cols // pack) or cols % pack:
            raise ValueError(f"{name} must be [{num_experts}, {rows}, {cols} / {pack}], got "
                             f"{tuple(w.shape)}")
        if group <= 0 or cols % group:
            raise ValueError(f"group_size ({group}) must divide {name}'s inputs ({cols})")
    for name, t, rows, cols in (("w13_scale", q.w13_scale, two_i, hidden),
                                ("w2_scale", q.w2_scale, hidden, inter),
                                ("w13_zeros", q.w13_zeros, two_i, hidden),
                                ("w2_zeros", q.w2_zeros, hidden, inter)):
        if t is None:
            if name.endswith("scale"):
                raise ValueError(f"{name} is needed")
            continue
        want = (num_experts, rows, cols // group)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
        if name.endswith("zeros") and t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype}")
        if t.device != w13.device:
            raise ValueError(f"{name} is on {t.device}, w13 on {w13.device}")
    if (q.w13_zeros is None) != (q.w2_zeros is None):
        raise ValueError("w13_zeros and w2_zeros: both or neither")
    return inter, pack


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (integers in ``[0, 16)``)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def mxfp4_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes ``[..., K]`` of MXFP4 ``blocks`` as gpt-oss's checkpoints store them
    (uint8 ``[..., K / 32, 16]``: two codes a byte, the lower input in the low nibble)."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., K / 32, 16], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    flat = blocks.reshape(*blocks.shape[:-2], -1)
    return torch.stack([flat & 15, flat >> 4], dim=-1).reshape(*flat.shape[:-1], -1)


def e8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (s - 127)`` of uint8 e8m0 scales, as the kernels read them (the exponent
    field of an fp32: ``s = 0`` gives 0, ``s = 255`` infinity)."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


def dequantize_int_experts(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None,
                           bits: int, group_size: int, dtype: torch.dtype = torch.float32,
                           fp4: bool = False) -> torch.Tensor:
    """The real stacked weights ``[E, N, K]`` (fp32 products, one rounding to ``dtype``);
    ``fp4``: MXFP4 codes and e8m0 scales."""
    if fp4:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
        codes = ((w[..., None] >> shifts) & 15).reshape(*w.shape[:-1], -1)
        s = e8m0_scales(scale).repeat_interleave(group_size, -1)
        return (e2m1_values(codes) * s).to(dtype)
    return torch.stack([
        dequantize_wna16(w[e].T.contiguous(), scale[e].T.contiguous(),
                         None if zeros is None else zeros[e].T.contiguous(), bits, group_size,
                         dtype)
        for e in range(w.shape[0])])


def pack_experts(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``[E, N, K]`` (in ``[0, 2**bits)``) packed along K: int32 ``[E, N, K / pack]``
    (tests, benchmarks)."""
    return torch.stack([pack_along_k(q[e].T, bits).T for e in range(q.shape[0])])


@triton.jit
def _int_tile(words: tl.tensor, zeros_ptrs: tl.tensor, mask_n: tl.tensor,
              BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr, FP4: tl.constexpr = False, scale_ptrs: tl.tensor = None,
              scale_s2: int = 0, GROUP: tl.constexpr = 32,
              MAGIC: tl.constexpr = False, k_left: int = 0) -> tl.tensor:
    """``[BLOCK_K, BLOCK_N]`` int32 ``q - zero`` of ``words`` ``[BLOCK_K / pack, BLOCK_N]``
    (each word's integers spread along K), the columns' zero points at ``zeros_ptrs``;
    ``FP4``: the codes' e2m1 values (fp32, exact in bf16). ``FP4`` with ``BLOCK_K > GROUP``:
    the step spans several groups, so each value carries its group's e8m0
    scale, read at ``scale_ptrs`` (the step's first group; ``scale_s2`` apart), in its exponent:
    ``e2m1 * 2 ** (s - 127)``, still exact in bf16 (a power of two changes only the exponent;
    flushed to 0 where it would be subnormal, ``s = 0`` reads as 0 as :func:`e8m0_scales`);
    with ``MAGIC`` the value is built from its bits and multiplied by the e8m0 scale read as an
    fp32 (:func:`~mrv2_kernels.int_bits.e2m1`: two exact multiplications, subnormals kept).
    ``k_left``: the inputs from the step's start to K's end; the scales of groups past it are
    not read (past the tensor's last group, or its end: a byte 255 there is 2 ** 128 as an
    fp32, and the masked code's 0 times it NaN)."""
    PACK: tl.constexpr = 32 // BITS
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    q = (words[:, None, :] >> shifts) & ((1 << BITS) - 1)  # [BLOCK_K / PACK, PACK, BLOCK_N]
    if FP4 and BLOCK_K > GROUP:  # each word row's group's e8m0 scale
        word_group = tl.arange(0, BLOCK_K // PACK) // (GROUP // PACK)
        s = tl.load(scale_ptrs[None, :] + word_group[:, None] * scale_s2,
                    mask=(word_group * GROUP < k_left)[:, None] & mask_n[None, :],
                    other=0).to(tl.int32)[:, None, :]
    if FP4 and MAGIC and BLOCK_K > GROUP:
        scale = (s << 23).to(tl.float32, bitcast=True)  # 2 ** (s - 127); 0: 0
        out = tl.reshape(e2m1(q) * scale, (BLOCK_K, BLOCK_N))
    elif FP4:  # the fp32 bit pattern: sign, exponent e - 1 + 127 (0.5 where e = 0), mantissa
        e = (q >> 1) & 3
        m = q & 1
        if BLOCK_K > GROUP:
            field = tl.where(e == 0, 126, e + 126) + s - 127
            live = ((e > 0) | (m > 0)) & (s > 0) & (field > 0)
            field = tl.minimum(field, 255)
            mant = tl.where((e == 0) | (field == 255), 0, m << 22)
            bits = tl.where(live, (field << 23) | mant, 0)
        else:
            bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
        out = tl.reshape((bits | ((q >> 3) << 31)).to(tl.float32, bitcast=True),
                         (BLOCK_K, BLOCK_N))
    elif HAS_ZEROS:
        z = tl.load(zeros_ptrs, mask=mask_n, other=0).to(tl.int32)
        out = tl.reshape(q, (BLOCK_K, BLOCK_N)) - z[None, :]
    else:
        out = tl.reshape(q, (BLOCK_K, BLOCK_N)) - (1 << (BITS - 1))
    return out


@triton.jit
def _int_scale(ptrs: tl.tensor, mask_n: tl.tensor, FP4: tl.constexpr = False) -> tl.tensor:
    """fp32 group scales of ``BLOCK_N`` columns (``FP4``: uint8 e8m0, as
    :func:`e8m0_scales`)."""
    if FP4:
        s = tl.load(ptrs, mask=mask_n, other=0).to(tl.int32)
        return (s << 23).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask_n, other=0.0).to(tl.float32)


@triton.jit
def _int_step(acc: tl.tensor, a: tl.tensor, words: tl.tensor, zeros_ptrs: tl.tensor,
              scale_ptrs: tl.tensor, mask_n: tl.tensor, BITS: tl.constexpr,
              HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              FP4: tl.constexpr, FOLD: tl.constexpr, MAGIC: tl.constexpr,
              DOT_PRECISION: tl.constexpr, two23: tl.tensor) -> tl.tensor:
    """``acc`` plus one K step (one group) of ``a @ W``: ``words`` ``[BLOCK_K / pack,
    BLOCK_N]``, the columns' zero points and group scales at ``zeros_ptrs`` /
    ``scale_ptrs``. ``FOLD``: the tile scaled and rounded to ``a``'s dtype before the dot.
    ``MAGIC``: the weights made floats from their bits (:mod:`~mrv2_kernels.int_bits`):
    e2m1 codes by one exact multiplication; integers folded as ``biased(q) - (2 ** 23 + z)``
    in fp32, else ``tl.dot`` of ``a`` with ``bias + q`` (bf16 / fp16, exact), less ``(bias +
    z)`` times each row's sum of ``a``."""
    scale = _int_scale(scale_ptrs, mask_n, FP4)
    PACK: tl.constexpr = 32 // BITS
    # the biased tile's dtype: a's, but for bf16's 7-bit mantissa against 8-bit integers
    BDT: tl.constexpr = tl.float16 if BITS > 7 or a.dtype == tl.float16 else tl.bfloat16
    # bit-built integers, unfolded, in a's dtype: the dot of bias + q less the bias sums
    SUMS: tl.constexpr = MAGIC and not FP4 and not FOLD and (a.dtype == BDT
                                                              or a.dtype == tl.float32)
    if MAGIC:
        shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
        q = tl.reshape((words[:, None, :] >> shifts) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
        if not FP4:
            if HAS_ZEROS:
                z = tl.load(zeros_ptrs, mask=mask_n, other=0).to(tl.float32)
            else:
                z = tl.full([BLOCK_N], 1 << (BITS - 1), tl.float32)
    if SUMS:
        part = tl.dot(a, biased(q, BDT, two23).to(a.dtype), input_precision=DOT_PRECISION)
        part -= tl.sum(a.to(tl.float32), axis=1)[:, None] * (bias(BDT) + z)[None, :]
        acc += part * scale[None, :]
    else:
        if not MAGIC:
            w = _int_tile(words, zeros_ptrs, mask_n, BITS, HAS_ZEROS, BLOCK_K, BLOCK_N, FP4)
        elif FP4:
            w = e2m1(q)
        else:  # q - z from fp32 bits, exact
            w = biased(q, tl.float32, two23) - (bias(tl.float32) + z)[None, :]
        if FOLD:  # the scaled tile, rounded once, accumulates in place
            acc = tl.dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc,
                         input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION) * scale[None, :]
    return acc
