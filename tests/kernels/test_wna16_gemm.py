"""Weight-only integer GEMM (GPTQ / AWQ layers): packing, the dequantizing reference against
a per-element formula, and the Triton kernel (split-K included) against the reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import wna16_gemm as wg
from mrv2_kernels.wna16_gemm import (
    WNA16Tiles,
    dequantize_wna16,
    pack_along_k,
    unpack_along_k,
    wna16_linear,
    wna16_linear_ref,
    wna16_linear_triton,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the Triton path allocates starts as NaN."""
    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(wg, "_empty", empty)


def _weight(k: int, n: int, bits: int, group: int, asym: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Random packed weight, scales, zeros (or None) and the integers ``[K, N]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.int64)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    zeros = (torch.randint(0, 2**bits, (k // group, n), generator=g).to(torch.uint8)
             if asym else None)
    return pack_along_k(q, bits), scales, zeros, q


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_and_puts_row_k_at_its_bits(bits: int) -> None:
    q = torch.randint(0, 2**bits, (32, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_along_k(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (32 * bits // 32, 5)
    assert torch.equal(unpack_along_k(packed, bits).long(), q)
    # row 3 sits at bits 3 * bits of word 0 (read as unsigned)
    word = int(packed[0, 2]) & 0xFFFFFFFF
    assert (word >> (3 * bits)) & ((1 << bits) - 1) == int(q[3, 2])


@pytest.mark.parametrize("bits,asym", [(4, False), (4, True), (8, True)])
def test_dequantize_is_the_per_element_formula(bits: int, asym: bool) -> None:
    k, n, group = 64, 6, 16
    packed, scales, zeros, q = _weight(k, n, bits, group, asym, seed=2)
    w = dequantize_wna16(packed, scales, zeros, bits, group)
    assert w.shape == (n, k)
    for kk, nn in [(0, 0), (17, 3), (63, 5), (40, 1)]:
        z = int(zeros[kk // group, nn]) if zeros is not None else 2 ** (bits - 1)
        expected = (int(q[kk, nn]) - z) * float(scales[kk // group, nn])
        assert w[nn, kk].item() == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("m,n,k,group,bits,asym,bias,splits,dtype", [
    (3, 40, 64, 32, 4, False, False, 1, torch.float32),
    (5, 32, 96, 32, 4, True, True, 3, torch.float32),
    (17, 48, 64, 64, 8, True, False, 2, torch.bfloat16),
    (2, 24, 32, 16, 4, True, True, 1, torch.float16),
])
def test_triton_matches_reference(m: int, n: int, k: int, group: int, bits: int, asym: bool,
                                  bias: bool, splits: int, dtype: torch.dtype) -> None:
    packed, scales, zeros, _ = _weight(k, n, bits, group, asym, seed=m + n)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (x, packed, scales, zeros, b)]
    tiles = WNA16Tiles(16, 16, 16, splits) if DEVICE == "cpu" else WNA16Tiles(16, 32, 16, splits)
    got = wna16_linear_triton(args[0], args[1], args[2], args[3], bits, group, args[4], tiles)
    expected = wna16_linear_ref(x, packed, scales, zeros, bits, group, b)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tol, atol=tol)


def test_reference_matches_the_unquantized_product_of_its_weight() -> None:
    """The dispatcher (either path) is ``x @ W.T`` of the dequantized W, leading dimensions
    kept."""
    packed, scales, zeros, _ = _weight(32, 8, 4, 32, True, seed=3)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(4))
    w = dequantize_wna16(packed, scales, zeros, 4, 32)
    y = wna16_linear(x, packed, scales, zeros, 4, 32)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(group=24), r"group_size \(24\) must divide K"),
    (dict(scales_shape=(3, 8)), r"scales must be \[2, 8\]"),
    (dict(bits=3), r"bits must be 4 or 8"),
])
def test_bad_layout_is_named(bad: dict[str, object], match: str) -> None:
    packed, scales, zeros, _ = _weight(64, 8, 4, 32, True, seed=5)
    if "scales_shape" in bad:
        scales = torch.ones(*bad["scales_shape"])  # type: ignore[misc]
    group = int(bad.get("group", 32))  # type: ignore[call-overload]
    bits = int(bad.get("bits", 4))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=match):
        dequantize_wna16(packed, scales, zeros, bits, group)
