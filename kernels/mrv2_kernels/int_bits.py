"""Small integers and e2m1 codes as floats, built from bits with integer ops.

Decoding quantized weights in a decode GEMM is bound by instruction throughput, not memory:
Hopper converts an integer to a float (``I2F``, ``I2FP``) at a quarter of the rate of its
integer and fp32 arithmetic, and a 4-bit weight tile needs one conversion per weight
(``python -m mrv2_kernels.bench_int``: the W4A16 and MXFP4 kernels ran at 0.13-0.56 of their
byte floors on an H100). The helpers here place the bits where a float's mantissa or
exponent is, so a conversion becomes an OR (which the compiler merges with the mask that
unpacks the integer, one ``LOP3``) and, where needed, one exact subtraction or
multiplication:

- :func:`biased`: ``q`` in ``[0, 2 ** 23)`` OR-ed into the mantissa of ``2 ** 23`` reads as
  the fp32 ``2 ** 23 + q`` (bf16: ``128 + q`` for ``q < 128``; fp16: ``1024 + q`` for
  ``q < 1024``), exactly; :func:`bias` is the ``2 ** 23`` / 128 / 1024 to subtract (with the
  zero point: ``q - z = biased(q) - (bias + z)``, exact).
- :func:`e2m1_scaled`: a 4-bit e2m1 code ``c`` (sign, 2 exponent bits, 1 mantissa bit) with
  its 3 low bits placed as an fp32's low exponent bits and top mantissa bit and its sign bit
  as the sign reads as ``e2m1(c) * 2 ** -126`` exactly (the codes with a zero exponent land
  on fp32 subnormals, which the GPU's ``FMUL`` takes at full rate without flushing); one
  multiplication by ``2 ** 126`` (or by ``2 ** 126`` times a scale) gives the value.

The kernels that use them (:mod:`~mrv2_kernels.wna16_gemm`, the integer experts of
:mod:`~mrv2_kernels.fused_moe_kernels`) are tested against their plain-torch references on
the CPU interpreter, whose numpy arithmetic keeps the same bits.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["E2M1_UNSCALE", "MAGIC_ENV_VAR", "TWO23_BITS", "bias", "biased", "e2m1",
           "e2m1_scaled", "magic_by_default", "pair_half"]

#: ``MRV2_INT_MAGIC=0`` keeps the default tiles off the bit-built weights (the A/B switch of
#: ``scripts/gpu_session.sh magicab``); explicit tiles still choose for themselves.
MAGIC_ENV_VAR = "MRV2_INT_MAGIC"


def magic_by_default() -> bool:
    """Whether the default tiles (``wna16_tiles``, the MXFP4 experts' plan) build weights
    from their bits: unless :data:`MAGIC_ENV_VAR` is ``0``."""
    return os.environ.get(MAGIC_ENV_VAR, "1") != "0"

#: The fp32 bits of ``2 ** 23``: what kernels pass as :func:`biased`'s ``two23``.
TWO23_BITS = 0x4B000000

#: ``2 ** 126``: what :func:`e2m1_scaled`'s values are multiplied by to read as e2m1 values.
E2M1_UNSCALE = 2.0 ** 126


@triton.jit
def biased(q: tl.tensor, DTYPE: tl.constexpr, two23: tl.tensor) -> tl.tensor:
    """``bias(DTYPE) + q`` as ``DTYPE`` (fp32, bf16 or fp16), exact for ``q`` in ``[0, 2 **
    23)``, ``[0, 128)``, ``[0, 1024)``: int32 ``q``'s bits OR-ed into the bias's mantissa.
    ``two23``: the fp32 bits of ``2 ** 23`` (:data:`TWO23_BITS`), a kernel argument: with the
    float's bits a run-time value the compiler keeps them in a register and merges the mask
    that unpacked ``q`` and this OR into one ``LOP3`` (with two immediates it emits two)."""
    if tl.float32 == DTYPE:
        out = (q | two23).to(tl.float32, bitcast=True)
    elif tl.bfloat16 == DTYPE:  # 2 ** 7: 16 exponent steps below 2 ** 23, bf16's high half
        out = (q | ((two23 >> 16) - 0x800)).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:  # fp16 2 ** 10
        out = (q | ((two23 >> 16) + 0x1900)).to(tl.int16).to(tl.float16, bitcast=True)
    return out


@triton.jit
def bias(DTYPE: tl.constexpr) -> tl.constexpr:
    """The float :func:`biased` adds: ``2 ** 23`` (fp32), 128 (bf16) or 1024 (fp16)."""
    if tl.float32 == DTYPE:
        return 8388608.0
    elif tl.bfloat16 == DTYPE:
        return 128.0
    else:
        return 1024.0


@triton.jit
def e2m1_scaled(q: tl.tensor) -> tl.tensor:
    """fp32 ``e2m1(q) * 2 ** -126`` of int32 codes ``q`` in ``[0, 16)`` (module docstring):
    bits 0-2 to fp32 bits 22-24, bit 3 to the sign."""
    return (((q & 7) << 22) | ((q & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1(q: tl.tensor) -> tl.tensor:
    """fp32 e2m1 values of int32 codes ``q`` in ``[0, 16)``: :func:`e2m1_scaled` times ``2 **
    126`` (exact: a power of two)."""
    return e2m1_scaled(q) * 8.507059173023462e37


@triton.jit
def pair_half(pairs: tl.tensor, HIGH: tl.constexpr, DTYPE: tl.constexpr) -> tl.tensor:
    """fp32 of the low or ``HIGH`` 16-bit half of int32 ``pairs``, two ``DTYPE`` (bf16 or
    fp16) values read as one int32 (a 4-byte load, which the compiler can pipeline; a 2-byte
    one it cannot): a bf16's bits are an fp32's high half (a shift or a mask), an fp16 is
    converted."""
    if DTYPE.is_bf16():
        if HIGH:
            out = (pairs & -65536).to(tl.float32, bitcast=True)
        else:
            out = (pairs << 16).to(tl.float32, bitcast=True)
    else:
        half = (pairs >> 16) if HIGH else pairs
        out = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return out
