"""LayerNorm (optionally fused with the residual add): the Triton kernel (interpreted on CPU)
against the torch reference, and the reference against torch's own layer_norm and HF's norms."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mrv2_kernels.layer_norm import layer_norm, layer_norm_ref, layer_norm_triton

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: the interpreter converts fp32 -> bf16 by truncation, the GPU to nearest: one ulp apart.
TOL = {F32: dict(rtol=1e-5, atol=1e-5), BF16: dict(rtol=2 ** -7, atol=2 ** -7),
       F16: dict(rtol=1e-3, atol=1e-3)}


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0, shift: float = 0.0
          ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) + shift).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_matches_the_reference(dtype: torch.dtype, affine: str, residual: bool) -> None:
    """Rows of a width that is not a power of two (masked columns must not enter the mean or
    the variance), a mean far from zero (the variance of ``x - mean``, not ``E[x^2] -
    E[x]^2``), the outputs poisoned first; the residual written in place."""
    rows, hidden = 5, 48
    x = randn(rows, hidden, dtype=dtype, seed=1, shift=3.0)
    w = randn(hidden, dtype=dtype, seed=2) if affine != "none" else None
    b = randn(hidden, dtype=dtype, seed=3) if affine == "weight+bias" else None
    res = randn(rows, hidden, dtype=dtype, seed=4) if residual else None
    want = layer_norm_ref(x, w, b, 1e-5, None if res is None else res.clone())
    out = torch.full_like(x, float("nan"))
    got = layer_norm_triton(x, w, b, 1e-5, None if res is None else res.clone(), out=out,
                            block_r=2)
    if residual:
        assert isinstance(got, tuple) and isinstance(want, tuple)
        exact = DEVICE == "cuda" or dtype != BF16  # (the interpreter truncates to bf16)
        torch.testing.assert_close(got[1].float(), want[1].float(),
                                   **(dict(rtol=0, atol=0) if exact else TOL[dtype]))
        got, want = got[0], want[0]
    assert isinstance(got, torch.Tensor) and got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_reference_is_torch_layer_norm_and_the_fused_add_is_in_place() -> None:
    """The reference is torch's layer_norm in fp32 (HF's nn.LayerNorm); a strided per-head
    view is normed without a copy; the dispatcher's fused add writes the sum into the
    residual it was given."""
    x = randn(3, 4, 16, seed=5)[:, 1:3]  # [3, 2, 16] strided rows
    w, b = randn(16, seed=6), randn(16, seed=7)
    torch.testing.assert_close(layer_norm_ref(x, w, b, 1e-6), F.layer_norm(x, (16,), w, b, 1e-6))
    torch.testing.assert_close(layer_norm_triton(x, w, b, 1e-6), F.layer_norm(x, (16,), w, b,
                                                                             1e-6),
                               rtol=1e-5, atol=1e-5)
    y, res = randn(4, 32, seed=8), randn(4, 32, seed=9)
    total = y + res  # (before the call: on the Triton path it overwrites res)
    want = F.layer_norm(total, (32,), None, None, 1e-5)
    normed, new_res = layer_norm(y, None, None, 1e-5, res)
    torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, total)
    if DEVICE == "cuda":  # the Triton path's aliasing (module doc): the sum is in res itself
        assert new_res.data_ptr() == res.data_ptr()


def test_bad_shapes_are_refused_naming_the_field() -> None:
    x = randn(2, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, randn(7), None, 1e-5)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, None, randn(9), 1e-5)
    with pytest.raises(ValueError, match="residual shape"):
        layer_norm(x, None, None, 1e-5, randn(2, 9))
