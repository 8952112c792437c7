"""The skinny (decode) linear kernel against its torch reference and ``F.linear``."""

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

from mrv2_kernels.skinny_gemm import (
    SKINNY_MAX_M,
    skinny_linear,
    skinny_linear_ref,
    skinny_linear_triton,
    use_skinny,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

BF16, F16 = torch.bfloat16, torch.float16


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, bias: bool = True,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 accumulation in another order, then one rounding: within 2 output ulps
    ulp = 2.0 ** -7 if got.dtype == BF16 else 2.0 ** -10
    err = (got.float() - want.float()).abs()
    bound = 2 * ulp * want.float().abs() + 1e-3
    assert torch.isfinite(got.float()).all()
    assert (err <= bound).all(), f"max error {err.max().item():.4g}"


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 33, 100), (16, 64, 64),
                                           (5, 17, 300)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, split_k: int) -> None:
    x, w, b = _inputs(m, n, k, dtype, seed=m * 7 + n)
    _close(skinny_linear_triton(x, w, b, split_k=split_k), skinny_linear_ref(x, w, b))


def test_no_bias_strided_rows_and_leading_dims() -> None:
    x, w, _ = _inputs(6, 48, 80, BF16, bias=False)
    wide = torch.randn(6, 160).to(BF16).to(DEVICE)
    wide[:, :80] = x
    strided = wide[:, :80]  # rows 160 apart
    assert not strided.is_contiguous()
    _close(skinny_linear_triton(strided, w), skinny_linear_ref(x, w))
    three_d = x.view(2, 3, 80)
    got = skinny_linear_triton(three_d, w)
    assert got.shape == (2, 3, 48)
    _close(got.view(6, 48), skinny_linear_ref(x, w))


def test_split_k_is_deterministic_and_agrees_with_one_split() -> None:
    from mrv2_kernels._backend import arrival_counters

    x, w, b = _inputs(4, 40, 512, BF16, seed=3)
    first = skinny_linear_triton(x, w, b, split_k=4)
    assert torch.equal(first, skinny_linear_triton(x, w, b, split_k=4))
    # the last-arriving split adds the partials in split order: same bits as the reduce kernel
    assert torch.equal(first, skinny_linear_triton(x, w, b, split_k=4, fused_reduce=False))
    counters = arrival_counters(x.device, 1)
    assert counters is not None and int(counters.abs().sum()) == 0  # all reset
    _close(first, skinny_linear_triton(x, w, b, split_k=1))


def test_rows_do_not_depend_on_the_other_rows() -> None:
    """A row's result is the same whatever else is in the batch (same tile plan)."""
    x, w, b = _inputs(8, 40, 128, BF16, seed=4)
    alone = skinny_linear_triton(x[2:3], w, b, split_k=2)
    together = skinny_linear_triton(x, w, b, split_k=2)[2:3]
    assert torch.equal(alone, together)


def test_dispatch() -> None:
    x, w, b = _inputs(2, 24, 32, BF16)
    big = torch.randn(SKINNY_MAX_M + 1, 32).to(BF16).to(DEVICE)
    if DEVICE == "cuda":
        assert use_skinny(x, w)
        assert not use_skinny(big, w)
        assert not use_skinny(x, torch.randn(40, 32, device=DEVICE).to(BF16))  # K < N: cuBLAS
        assert not use_skinny(x.float(), w.float())  # fp32 stays with cuBLAS
    else:
        assert not use_skinny(x, w)  # CPU tensors take F.linear unless Triton is forced
    _close(skinny_linear(x, w, b), F.linear(x.float(), w.float(), b.float()).to(BF16))
    assert skinny_linear_triton(x[:0], w, b).shape == (0, 24)
    with pytest.raises(ValueError, match="do not match"):
        skinny_linear_triton(x, w[:, :16])


@pytest.mark.skipif(DEVICE != "cuda", reason="real decode shapes: GPU only")
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_decode_shapes_match_cublas(m: int, n: int, k: int) -> None:
    x, w, _ = _inputs(m, n, k, BF16, seed=n + k)
    _close(skinny_linear_triton(x, w), F.linear(x, w))


@pytest.mark.parametrize("split_k", [1, 3])
def test_early_weights_gives_the_same_bits(split_k: int, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """The variant that loads the first weight tile before waiting for the previous kernel
    (``MRV2_PDL_EARLY_WEIGHTS``, its first iteration peeled) adds the tiles in the same order:
    the same bits, with K longer than one tile and splits."""
    from mrv2_kernels import skinny_gemm

    x, w, b = _inputs(3, 33, 200, BF16, seed=5)
    plain = skinny_linear_triton(x, w, b, split_k=split_k, block_k=32)
    monkeypatch.setattr(skinny_gemm, "pdl_early_weights", lambda t, default=False: True)
    assert torch.equal(skinny_linear_triton(x, w, b, split_k=split_k, block_k=32), plain)
