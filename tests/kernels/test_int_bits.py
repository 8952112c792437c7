"""mrv2_kernels.int_bits: floats built from bits against plain torch, over every value the
kernels feed them."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mrv2_kernels.fused_moe_int import E2M1
from mrv2_kernels.int_bits import (
    E2M1_UNSCALE,
    MAGIC_ENV_VAR,
    TWO23_BITS,
    bias,
    biased,
    e2m1,
    e2m1_scaled,
    magic_by_default,
    pair_half,
)


@triton.jit
def _biased_kernel(q_ptr: tl.tensor, out_ptr: tl.tensor, two23: int, N: tl.constexpr,
                   DTYPE: tl.constexpr) -> None:
    q = tl.load(q_ptr + tl.arange(0, N))
    # as the kernels use it: the float less its bias, exact
    tl.store(out_ptr + tl.arange(0, N), biased(q, DTYPE, two23).to(tl.float32) - bias(DTYPE))


@triton.jit
def _e2m1_kernel(q_ptr: tl.tensor, out_ptr: tl.tensor, scaled_ptr: tl.tensor,
                 N: tl.constexpr) -> None:
    q = tl.load(q_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), e2m1(q))
    tl.store(scaled_ptr + tl.arange(0, N), e2m1_scaled(q))


@triton.jit
def _pairs_kernel(x_ptr: tl.tensor, out_ptr: tl.tensor, N: tl.constexpr) -> None:
    pairs = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + tl.arange(0, N // 2))
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    tl.store(out_ptr + tl.arange(0, N // 2) * 2, pair_half(pairs, False, dtype))
    tl.store(out_ptr + tl.arange(0, N // 2) * 2 + 1, pair_half(pairs, True, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pair_halves_are_the_values(dtype: torch.dtype) -> None:
    """Two 16-bit values read as one int32: each half is its value in fp32 (negatives, a
    subnormal, infinities and zeros of both signs among them)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g).to(dtype)
    x[:6] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), -2.0, 1e-6]).to(dtype)
    out = torch.full((64,), float("nan"))
    _pairs_kernel[(1,)](x, out, N=64)
    assert torch.equal(out, x.float()) and torch.equal(out.signbit(), x.float().signbit())


@pytest.mark.parametrize(("dtype", "limit"), [(tl.float32, 1 << 23), (tl.bfloat16, 128),
                                              (tl.float16, 1024)])
def test_biased_is_bias_plus_q_for_every_q_in_range(dtype: tl.dtype, limit: int) -> None:
    """Every ``q`` a 4- or 8-bit weight takes (and the range's top, where the dtype's
    mantissa ends), in each dtype."""
    values = sorted(v for v in {*range(256), limit - 2, limit - 1} if v < limit)
    q = torch.tensor(values + [0] * (512 - len(values)), dtype=torch.int32)
    out = torch.full((512,), float("nan"))
    _biased_kernel[(1,)](q, out, TWO23_BITS, N=512, DTYPE=dtype)
    assert torch.equal(out, q.float())


def test_e2m1_values_from_their_bits_are_the_table() -> None:
    """All 16 codes, signs of zero included; the scaled values are exactly 2 ** -126 of them
    (subnormal for the codes with a zero exponent)."""
    q = torch.arange(16, dtype=torch.int32)
    out = torch.full((16,), float("nan"))
    scaled = torch.full((16,), float("nan"))
    _e2m1_kernel[(1,)](q, out, scaled, N=16)
    want = torch.tensor(E2M1)
    assert torch.equal(out, want)
    assert torch.equal(out.signbit(), want.signbit())
    assert torch.equal(scaled.double() * E2M1_UNSCALE, want.double())


def test_magic_by_default_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MAGIC_ENV_VAR, raising=False)
    assert magic_by_default()
    monkeypatch.setenv(MAGIC_ENV_VAR, "0")
    assert not magic_by_default()
    monkeypatch.setenv(MAGIC_ENV_VAR, "1")
    assert magic_by_default()
