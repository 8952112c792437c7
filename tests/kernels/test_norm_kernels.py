"""RMSNorm and SiluAndMul: Triton (interpreted on CPU) against the torch reference, old layers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import (
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch and CPU layer path")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MANTISSA_BITS = {F32: 23, BF16: 7, F16: 10}
EPS = 1e-6


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def ulp_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest ``|actual - expected|`` in ulps of ``expected.dtype`` (NaN anywhere: inf)."""
    a, e = actual.detach().double(), expected.detach().double()
    _, exp = torch.frexp(torch.maximum(a.abs(), e.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exp - 1 - MANTISSA_BITS[expected.dtype])
    finfo = torch.finfo(expected.dtype)
    ulp = ulp.clamp(min=finfo.tiny * finfo.eps)  # the subnormal spacing
    err = (a - e).abs() / ulp
    return float("inf") if err.isnan().any() else float(err.max())


def assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, ulps: float, fp32_tol: float = 1e-5
) -> None:
    """Same shape and dtype; fp32 within ``fp32_tol`` relative, half types within ``ulps`` ulp."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype == F32:
        torch.testing.assert_close(actual, expected, rtol=fp32_tol, atol=1e-6)
    else:
        assert ulp_error(actual, expected) <= ulps


# Triton's interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even, as
# torch does), and a truncation error can carry through the next rounding: under the interpreter
# bf16 results get up to 3 ulps (norm, silu: two roundings) and 1 ulp (one rounding). fp16
# conversions round to nearest in both.
INTERPRETED = DEVICE == "cpu"
NORM_ULPS = {BF16: 3 if INTERPRETED else 2, F16: 1, F32: 0}
RESIDUAL_ULPS = {BF16: 1 if INTERPRETED else 0, F16: 0, F32: 0}


def old_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm layer's torch code before the kernels, verbatim."""

    def _norm(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps)).to(dtype)

    dtype = x.dtype
    if residual is None:
        return _norm(x.float(), dtype)
    summed = x.float() + residual.float()
    return _norm(summed, dtype), summed.to(dtype)


# ------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("hidden", [48, 100, 128])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_ref(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    rows = 6
    x = randn(rows, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=1) + 1.0
    out = torch.full((rows, hidden), float("nan"), dtype=dtype, device=DEVICE)
    if not with_residual:
        got = rms_norm_triton(x, weight, EPS, out=out, block_r=4)
        assert got is out
        assert_matches(got, rms_norm_ref(x, weight, EPS), NORM_ULPS[dtype])
        return
    residual = randn(rows, hidden, dtype=dtype, seed=2)
    residual_before = residual.clone()
    x_before = x.clone()
    got, new_res = rms_norm_triton(x, weight, EPS, residual, out=out, block_r=4)
    want, want_res = rms_norm_ref(x, weight, EPS, residual_before)
    assert got is out and new_res is residual  # the new residual went into residual's storage
    assert_matches(got, want, NORM_ULPS[dtype])
    assert_matches(new_res, want_res, RESIDUAL_ULPS[dtype])
    assert torch.equal(x, x_before)
    # The norm is of the fp32 sum, not of the rounded new residual: fp32 is exact.
    if dtype == F32:
        assert torch.equal(new_res, x + residual_before)


def test_rms_norm_rounds_to_input_dtype_before_weight() -> None:
    """bf16 x with an fp32 weight: fp32 out = weight * bf16(normed), exactly as torch promotes."""
    x = randn(5, 100, dtype=BF16, seed=3)
    weight = (randn(100, seed=4) + 1.0).to(BF16).float()  # bf16-representable: exact products
    got = rms_norm_triton(x, weight, EPS, block_r=2)
    want = rms_norm_ref(x, weight, EPS)
    assert isinstance(got, torch.Tensor) and got.dtype == F32 and want.dtype == F32
    normed = got / weight
    assert torch.equal(normed.to(BF16).float(), normed)  # rounded to bf16 before the multiply
    assert ulp_error(normed.to(BF16), (want / weight).to(BF16)) <= 1


def test_rms_norm_per_head_rows_of_a_strided_qkv_view() -> None:
    """Qwen3 q/k norm: [T, heads, 128] rows read straight out of a fused QKV output."""
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 128
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=BF16, seed=5)
    qkv_before = qkv.clone()
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
    weight = randn(head_dim, dtype=BF16, seed=6)
    got = rms_norm_triton(q, weight, EPS, block_r=4)
    assert isinstance(got, torch.Tensor) and got.shape == (tokens, heads, head_dim)
    assert_matches(got, rms_norm_ref(q, weight, EPS), NORM_ULPS[BF16])
    assert torch.equal(qkv, qkv_before)


def test_rms_norm_leading_dims_and_layouts() -> None:
    weight = randn(48, seed=7)
    x4 = randn(2, 3, 2, 48, seed=8)
    assert_matches(rms_norm_triton(x4, weight, EPS), rms_norm_ref(x4, weight, EPS), 0)
    # Leading dims that cannot be viewed as [A, B, H]: copied, same values.
    xt = randn(4, 3, 2, 48, seed=9).transpose(0, 2)
    res = randn(4, 3, 2, 48, seed=10).transpose(0, 2)
    got, new_res = rms_norm_triton(xt, weight, EPS, res.clone())
    want, want_res = rms_norm_ref(xt, weight, EPS, res)
    assert_matches(got, want, 0)
    assert_matches(new_res, want_res, 0)
    x1 = randn(48, seed=11)
    assert_matches(rms_norm_triton(x1, weight, EPS), rms_norm_ref(x1, weight, EPS), 0)


def test_rms_norm_residual_aliasing_rules() -> None:
    x = randn(4, 100, dtype=BF16, seed=12)
    weight = randn(100, dtype=BF16, seed=13)
    # An fp32 residual cannot hold the bf16 sum: fresh tensor, residual untouched.
    res32 = randn(4, 100, seed=14)
    before = res32.clone()
    got, new_res = rms_norm_triton(x, weight, EPS, res32)
    want, want_res = rms_norm_ref(x, weight, EPS, before)
    assert new_res.dtype == BF16 and new_res.data_ptr() != res32.data_ptr()
    assert torch.equal(res32, before)
    assert_matches(got, want, NORM_ULPS[BF16])
    assert_matches(new_res, want_res, RESIDUAL_ULPS[BF16])
    # residual is x itself: each row is read whole before it is written.
    x = randn(4, 100, seed=15)
    want, want_res = rms_norm_ref(x, weight.float(), EPS, x)
    got, new_res = rms_norm_triton(x, weight.float(), EPS, x, block_r=2)
    assert new_res is x
    assert_matches(got, want, 0)
    assert_matches(new_res, want_res, 0)


def test_rms_norm_rejects_bad_arguments() -> None:
    x = randn(2, 48)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, randn(47), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, randn(48), EPS, randn(3, 48))
    with pytest.raises(ValueError, match="out"):
        rms_norm_triton(x, randn(48), EPS, out=torch.empty(2, 48, dtype=BF16))
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_triton(x, randn(48), EPS, block_r=3)


@CPU_ONLY
def test_rms_norm_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    x, res, weight = randn(3, 48, seed=16), randn(3, 48, seed=17), randn(48, seed=18)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    res_arg = res.clone()
    got, new_res = rms_norm(x, weight, EPS, res_arg)
    want, want_res = old_rms_norm(x, weight, EPS, res)
    assert torch.equal(got, want) and torch.equal(new_res, want_res)
    assert torch.equal(res_arg, res)  # the reference leaves the residual alone
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    got, new_res = rms_norm(x, weight, EPS, res_arg)
    assert new_res is res_arg  # the Triton path ran: in place
    assert_matches(got, want, 0)
    assert_matches(new_res, want_res, 0)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rms_norm_layer_unchanged_on_cpu(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer module gives bit-identical results to its old torch code on CPU."""
    from mrv2.layers import RMSNorm

    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    norm = RMSNorm(100, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(100, seed=19))
    x, res = randn(5, 100, dtype=dtype, seed=20), randn(5, 100, dtype=dtype, seed=21)
    with torch.no_grad():
        plain = norm(x)
        got, new_res = norm(x, res)
    assert isinstance(plain, torch.Tensor)
    assert torch.equal(plain, old_rms_norm(x, norm.weight, 1e-5))
    want, want_res = old_rms_norm(x, norm.weight, 1e-5, res)
    assert torch.equal(got, want) and torch.equal(new_res, want_res)
    # Forced onto the kernel, the same module agrees within rounding.
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    with torch.no_grad():
        got, new_res = norm(x, res.clone())
    assert_matches(got, want, NORM_ULPS[dtype])
    assert_matches(new_res, want_res, RESIDUAL_ULPS[dtype])


# -------------------------------------------------------------------------------- SiluAndMul


def old_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


SILU_ULPS = {BF16: 3 if INTERPRETED else 2, F16: 1, F32: 0}


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("d", [48, 100])
def test_silu_and_mul_triton_matches_ref(dtype: torch.dtype, d: int) -> None:
    x = randn(3, 2 * d, dtype=dtype, seed=d, scale=4.0)
    got = silu_and_mul_triton(x, block=32)
    want = silu_and_mul_ref(x)
    assert got.shape == (3, d)
    assert_matches(got, want, SILU_ULPS[dtype], fp32_tol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_and_mul_strided_rows_and_leading_dims() -> None:
    big = randn(4, 300, dtype=BF16, seed=22, scale=4.0)
    x = big[:, :200]  # [gate | up] rows with a row stride of 300
    assert not x.is_contiguous()
    assert_matches(silu_and_mul_triton(x, block=64), silu_and_mul_ref(x), SILU_ULPS[BF16])
    x3 = randn(2, 3, 96, seed=23, scale=4.0)
    got = silu_and_mul_triton(x3)
    assert got.shape == (2, 3, 48)
    assert_matches(got, silu_and_mul_ref(x3), 0, fp32_tol=1e-6)
    # Extremes: silu(-inf-ish) -> -0, silu(large) -> large; no NaN from exp overflow.
    ext = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 2.0, 3.0, -1.0, 1.0]], device=DEVICE)
    assert_matches(silu_and_mul_triton(ext), silu_and_mul_ref(ext), 0, fp32_tol=1e-6)


def test_silu_and_mul_rounds_twice_like_torch() -> None:
    """fp16 (rounded to nearest under the interpreter too): torch rounds silu, then the product.

    Skipping the first rounding changes about a quarter of the results; an ``exp`` that differs
    in the last fp32 bit flips the odd one, hence the small allowance.
    """
    x = randn(2, 2048, dtype=F16, seed=25, scale=4.0)
    got, want = silu_and_mul_triton(x, block=256), silu_and_mul_ref(x)
    assert (got != want).float().mean() < 0.01
    assert_matches(got, want, SILU_ULPS[F16])


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(randn(2, 7))


@CPU_ONLY
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_and_mul_dispatch_and_layer(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mrv2.layers import SiluAndMul

    x = randn(3, 96, dtype=dtype, seed=24, scale=4.0)
    layer = SiluAndMul()
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    assert torch.equal(silu_and_mul(x), old_silu_and_mul(x))
    assert torch.equal(layer(x), old_silu_and_mul(x))
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert_matches(layer(x), old_silu_and_mul(x), SILU_ULPS[dtype])
